/* Picks over a vocabulary's logits on a CPU: one level of the draft's beam search for every request at once
 * (beam_picks: speculate.py, _expand_on_device), and the greedy draws' first maximum of each row (first_argmax:
 * verify.py).
 *
 * beam_picks.
 * Row (b, f) of x [n * F, V] (float32) holds the draft's logits at request b's frontier node f, and base[b, f]
 * (float64) that node's log path probability. For each row:
 *     m          = max_v x[v]
 *     lse        = log(sum_v exp(x[v] - m))          (float32: eight lanes over the row, then across the lanes)
 *     picks      = the row's k greatest logits, greatest first, ties to the lower token id
 *     value_i    = (x[pick_i] - m) - lse               (the log-softmax at pick i, float32)
 *     score_i    = base[b, f] + value_i                (float64)
 * Request b's candidate j = f * k + i is token picks_i of row (b, f), child of tree node frontier + f.
 * A beam (width > 0) keeps the ``width`` candidates with the greatest scores, greatest first, ties to the lower j;
 * a static tree (width == 0) keeps every candidate, in order. Only a node's own top k children can be among a
 * level's best, and the log-softmax keeps a row's order, so the [F * V] scores are never formed.
 *
 * A row is read twice: once for the picks (the first of them is m) and the check that every logit is finite, once
 * for the sum. Every exponential is exp8_fma (vexp.h: exp8's polynomial with fused multiply-adds). Torch's
 * log_softmax sums in another order with another exponential, so a value may differ from its float32 result in the
 * last bits: the draft's guesses, never the verified output.
 *
 * Rows of base and of the three outputs are ld_base and ld_out elements apart (F and the kept count when packed;
 * a search that writes every level into one [n, K] array per output passes K: its levels are column ranges).
 *
 * Ancestor rows (anc, optional): bool [n, S, S], request b's row i the tree nodes on node i's path. The kept
 * candidates are the next level's nodes, tree indices frontier + F + o; each one's row gets its parent's row or'ed
 * into it (it holds its own diagonal bit already): what the next level's mask reads, grown in the same call.
 *
 * Returns 0; 1 when a logit is not finite (NaN or +-inf: the outputs are then unspecified, and beam search
 * refuses the tree); -1 when the scratch could not be allocated.
 *
 * first_argmax. out[r] = the index of row r's first maximum, a NaN counting as the maximum (its first NaN): what
 * torch.argmax returns, bit for bit (comparisons only, no arithmetic). The target's greedy draws take it, so it
 * must be exact: it decides the emitted tokens.
 *
 * head_refine. The int8 LM head's float32 pass (quant.py, Int8Head) and its greedy draw, one row at a time while
 * the row is in the cache. Row r of y [n, V] is the head's output for input x[r] [K]; q int8 [V, K] and c float [V]
 * its weights (W[t] = c[t] q[t]). For each row:
 *     T        = the row's k greatest logits (ties to the lower token id), and u the greatest outside T
 *     y[r, t]  = sum_j (q[t, j] c[t]) x[r, j]    for t in T (float32: each product rounded, the sum in eight lanes
 *                over j in order, then across them: one fixed order, whatever n or the thread count)
 *     out[r]   = the row's first maximum after that: the first t in T with the greatest refined value when that
 *                value exceeds u (nothing outside T reaches u), else first_argmax's scan of the row
 * A row holding a NaN is left as it is (out[r] its first NaN, as first_argmax answers). k < V.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vexp.h"

/* Below this many logits a level runs on one thread: forking costs more than it saves. */
#define PARALLEL_MIN (1L << 16)

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* Insert (value, index) into the k greatest so far (``top`` sorted greatest first, ties by index: an equal value
 * seen later goes after the ones already held). ``count`` < k until the list is full. */
static inline void insert(float *top, int64_t *at, int *count, int k, float value, int64_t index) {
    int c = *count;
    if (c == k) {
        if (!(value > top[k - 1])) return;
        c = k - 1;
    } else {
        *count = c + 1;
    }
    while (c > 0 && value > top[c - 1]) {
        top[c] = top[c - 1];
        at[c] = at[c - 1];
        c--;
    }
    top[c] = value;
    at[c] = index;
}

/* One row: its k picks (token ids, log-softmax values). Returns 1 when a logit is not finite.
 * Two passes over the row: the picks (the first of which is the maximum m), with the check for a logit that is not
 * finite; then the sum of exp(x - m). */
static int row_picks(const float *x, int V, int k, int64_t *pick, float *value) {
    float top[k];
    int count = 0, v = 0, nonfinite = 0;
    __m256 bad = _mm256_setzero_ps();
    for (; v < k && v < V; v++) insert(top, pick, &count, k, x[v], v);
    for (; v < V && (V - v) % 8; v++) insert(top, pick, &count, k, x[v], v); /* align the rest to 8 */
    for (int t = 0; t < v; t++) nonfinite |= !isfinite(x[t]);
    for (; v + 8 <= V; v += 8) {
        __m256 xv = _mm256_loadu_ps(x + v);
        __m256 d = _mm256_sub_ps(xv, xv); /* 0 for a finite logit, NaN for NaN and +-inf */
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(d, d, _CMP_UNORD_Q));
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(xv, _mm256_set1_ps(top[k - 1]), _CMP_GT_OQ));
        while (hit) { /* greater than the k-th so far: a later equal logit never is (ties to the lower id) */
            int t = __builtin_ctz(hit);
            insert(top, pick, &count, k, x[v + t], v + t);
            hit &= hit - 1;
        }
    }
    if (nonfinite || _mm256_movemask_ps(bad)) return 1;
    float m = top[0]; /* the maximum: the greatest pick */

    __m256 vm = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
    for (v = 0; v + 8 <= V; v += 8) acc = _mm256_add_ps(acc, exp8_fma(_mm256_sub_ps(_mm256_loadu_ps(x + v), vm)));
    float sum = hsum8(acc);
    if (v < V) { /* the tail, padded with -inf (weighs nothing) */
        float tail[8];
        for (int t = 0; t < 8; t++) tail[t] = v + t < V ? x[v + t] : -INFINITY;
        sum += hsum8(exp8_fma(_mm256_sub_ps(_mm256_loadu_ps(tail), vm)));
    }
    float lse = logf(sum);
    for (int i = 0; i < k; i++) value[i] = (top[i] - m) - lse;
    return 0;
}

int beam_picks(const float *x, int n, int F, int V, const double *base, long ld_base, int k, int width,
               int64_t frontier, int64_t *tok, int64_t *parent, double *score, long ld_out, unsigned char *anc,
               int S, int threads) {
    long rows = (long)n * F;
    int64_t *pick = (int64_t *)malloc(sizeof(int64_t) * (size_t)(rows * k));
    float *value = (float *)malloc(sizeof(float) * (size_t)(rows * k));
    if (!pick || !value) {
        free(pick);
        free(value);
        return -1;
    }
    int bad = 0;
    if (threads > 1 && rows * V >= PARALLEL_MIN) {
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : bad)
        for (long r = 0; r < rows; r++) bad |= row_picks(x + r * V, V, k, pick + r * k, value + r * k);
    } else { /* no OpenMP region at all: entering one, even for one thread, costs more than a small level's picks */
        for (long r = 0; r < rows; r++) bad |= row_picks(x + r * V, V, k, pick + r * k, value + r * k);
    }
    if (!bad) {
        int cands = F * k, keep = width > 0 ? (width < cands ? width : cands) : cands;
        for (int b = 0; b < n; b++) {
            const int64_t *p = pick + (long)b * cands;
            const float *val = value + (long)b * cands;
            int64_t *t_out = tok + (long)b * ld_out, *p_out = parent + (long)b * ld_out;
            double *s_out = score + (long)b * ld_out;
            const double *b_in = base + (long)b * ld_base;
            if (width == 0 || cands == 1) { /* every candidate, in order */
                for (int j = 0; j < cands; j++) {
                    t_out[j] = p[j];
                    p_out[j] = frontier + j / k;
                    s_out[j] = b_in[j / k] + (double)val[j];
                }
            } else {
                double s[cands];
                char taken[cands];
                for (int j = 0; j < cands; j++) {
                    s[j] = b_in[j / k] + (double)val[j];
                    taken[j] = 0;
                }
                for (int o = 0; o < keep; o++) { /* the greatest not yet kept, ties to the lower j */
                    int best = -1;
                    for (int j = 0; j < cands; j++)
                        if (!taken[j] && (best < 0 || s[j] > s[best])) best = j;
                    taken[best] = 1;
                    t_out[o] = p[best];
                    p_out[o] = frontier + best / k;
                    s_out[o] = s[best];
                }
            }
            if (anc) { /* node frontier + F + o: its parent's row or'ed into its own */
                unsigned char *rows = anc + (long)b * S * S;
                for (int o = 0; o < keep; o++) {
                    unsigned char *row = rows + (frontier + F + o) * S;
                    const unsigned char *up = rows + p_out[o] * S;
                    for (int j = 0; j < S; j++) row[j] |= up[j];
                }
            }
        }
    }
    free(pick);
    free(value);
    return bad;
}

/* The first NaN of a row, or -1. */
static long first_nan(const float *x, int V) {
    int v = 0;
    for (; v + 8 <= V; v += 8) {
        __m256 xv = _mm256_loadu_ps(x + v);
        if (_mm256_movemask_ps(_mm256_cmp_ps(xv, xv, _CMP_UNORD_Q))) break;
    }
    for (; v < V; v++)
        if (x[v] != x[v]) return v;
    return -1;
}

/* One row's first maximum (a NaN counting as the maximum). */
static int64_t argmax_row(const float *row, int V) {
    /* the maximum: four running maxima (one would chain every load on the last max's latency), and the NaN
     * check one compare per two vectors (unordered: either holds a NaN) */
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    __m256 nan0 = _mm256_setzero_ps(), nan1 = nan0;
    int v = 0;
    for (; v + 32 <= V; v += 32) {
        __m256 a = _mm256_loadu_ps(row + v), b = _mm256_loadu_ps(row + v + 8);
        __m256 c = _mm256_loadu_ps(row + v + 16), d = _mm256_loadu_ps(row + v + 24);
        m0 = _mm256_max_ps(m0, a);
        m1 = _mm256_max_ps(m1, b);
        m2 = _mm256_max_ps(m2, c);
        m3 = _mm256_max_ps(m3, d);
        nan0 = _mm256_or_ps(nan0, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
        nan1 = _mm256_or_ps(nan1, _mm256_cmp_ps(c, d, _CMP_UNORD_Q));
    }
    for (; v + 8 <= V; v += 8) {
        __m256 xv = _mm256_loadu_ps(row + v);
        m0 = _mm256_max_ps(m0, xv);
        nan0 = _mm256_or_ps(nan0, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
    }
    /* max is exact in any order: without a NaN, the same maximum as one running max */
    float m = hmax8(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    int has_nan = _mm256_movemask_ps(_mm256_or_ps(nan0, nan1)) != 0;
    for (int t = v; t < V; t++) {
        has_nan |= row[t] != row[t];
        m = row[t] > m ? row[t] : m;
    }
    if (has_nan) return first_nan(row, V);
    /* its first index: the first 32 that hold it, then the first 8 among them, then the one */
    __m256 vm = _mm256_set1_ps(m);
    for (v = 0; v + 32 <= V; v += 32) {
        __m256 e = _mm256_or_ps(
            _mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + v), vm, _CMP_EQ_OQ),
                         _mm256_cmp_ps(_mm256_loadu_ps(row + v + 8), vm, _CMP_EQ_OQ)),
            _mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + v + 16), vm, _CMP_EQ_OQ),
                         _mm256_cmp_ps(_mm256_loadu_ps(row + v + 24), vm, _CMP_EQ_OQ)));
        if (_mm256_movemask_ps(e)) break;
    }
    for (; v + 8 <= V; v += 8)
        if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + v), vm, _CMP_EQ_OQ))) break;
    for (; v < V; v++)
        if (row[v] == m) break;
    return v;
}

void first_argmax(const float *x, long n, int V, int64_t *out, int threads) {
    if (threads > 1 && n * V >= PARALLEL_MIN) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long r = 0; r < n; r++) out[r] = argmax_row(x + r * V, V);
    } else { /* no OpenMP region: see beam_picks */
        for (long r = 0; r < n; r++) out[r] = argmax_row(x + r * V, V);
    }
}

/* x[0 .. K) against one int8 weight row, float32: (q[j] c) x[j], summed in eight lanes in order, then across. */
static float refined_dot(const int8_t *q, float c, const float *x, int K) {
    __m256 acc = _mm256_setzero_ps(), cv = _mm256_set1_ps(c);
    int j = 0;
    for (; j + 8 <= K; j += 8) {
        __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + j)))),
                                 cv);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(w, _mm256_loadu_ps(x + j)));
    }
    float s = hsum8(acc);
    for (; j < K; j++) s += ((float)q[j] * c) * x[j];
    return s;
}

/* head_refine for one row (the header); k + 1 <= V. */
static int64_t refine_row(float *row, int V, const float *x, int K, const int8_t *q, const float *c, int k) {
    int kk = k + 1, count = 0, v = 0;
    float top[kk];
    int64_t at[kk];
    int nan = 0;
    for (; v < kk; v++) {
        nan |= row[v] != row[v];
        insert(top, at, &count, kk, row[v], v);
    }
    for (; v < V && (V - v) % 8; v++) {
        nan |= row[v] != row[v];
        insert(top, at, &count, kk, row[v], v);
    }
    __m256 bad = _mm256_setzero_ps();
    for (; v + 8 <= V; v += 8) {
        __m256 xv = _mm256_loadu_ps(row + v);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(xv, _mm256_set1_ps(top[kk - 1]), _CMP_GT_OQ));
        while (hit) { /* greater than the (k+1)-th so far: a later equal logit never is (ties to the lower id) */
            int t = __builtin_ctz(hit);
            insert(top, at, &count, kk, row[v + t], v + t);
            hit &= hit - 1;
        }
    }
    if (nan || _mm256_movemask_ps(bad)) return first_nan(row, V);
    float best = -INFINITY;
    int64_t first = -1;
    int nan_refined = 0;
    for (int i = 0; i < k; i++) {
        int64_t t = at[i];
        float e = refined_dot(q + t * (long)K, c[t], x, K);
        row[t] = e;
        nan_refined |= e != e;
        if (first < 0 || e > best || (e == best && t < first)) { /* the first of the greatest refined values */
            best = e;
            first = t;
        }
    }
    /* u = top[k] bounds every logit outside T; a NaN refined value (an input's NaN or infinity) is the row's
     * maximum wherever it sits: the scan finds the first */
    return !nan_refined && best > top[k] ? first : argmax_row(row, V);
}

int head_refine(float *y, long n, int V, const float *x, int K, const int8_t *q, const float *c, int k,
                int64_t *out, int threads) {
    if (k < 1 || k >= V) return -1;
    if (threads > 1 && n * V >= PARALLEL_MIN) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long r = 0; r < n; r++) out[r] = refine_row(y + r * V, V, x + r * K, K, q, c, k);
    } else { /* no OpenMP region: see beam_picks */
        for (long r = 0; r < n; r++) out[r] = refine_row(y + r * V, V, x + r * K, K, q, c, k);
    }
    return 0;
}
