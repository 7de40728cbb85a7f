/* Attention over the paged KV cache for CPU rows, one function of each query row's visible keys.
 *
 * For query row r of grid g (g < G, r < Q) and head h, with R = H / Hkv query heads per KV head:
 *     keys      j_0 < j_1 < ... < j_{n-1}: the columns j of row r where mask[g, r, j] is set (all K without a mask)
 *     slots     t_c = key_slots[g, j_c]: where key j_c's K and V rows live in the layer's cache
 *     scores    s_c = scale * (q[g, r, h] . k[t_c, h / R])
 *     weights   p_c = exp(s_c - max_c s_c)
 *     out[g, r, h] = (sum_c p_c v[t_c, h / R]) / (sum_c p_c)        (a row that sees no key: zeros)
 * A row's visible keys are gathered into a dense list before anything is summed, so the operations on it, and
 * their order, depend only on which keys it sees and in what order: never on the grid around it (padding,
 * masked cells, the other rows) nor on the thread count. A token's output is then bitwise the same decoded
 * alone or verified inside a tree, the property lossless speculation needs; torch's SDPA gets there only by
 * summing in float64. q . k runs in eight lanes over D then one horizontal sum; every exponential comes from one
 * vector polynomial (exp8, Cephes' expf), applied to all scores alike; the sums run in key order. Built with
 * -ffp-contract=off (see q8dot.c).
 *
 * Layouts (float32): q row (g, r) at q + (g * Q + r) * q_stride, its heads D apart; k_cache and v_cache
 * [slots, Hkv, D]; key_slots int64 [G, K]; mask bool [G, Q, K] or NULL; out [G * Q, H, D]. D a multiple of 8,
 * at most 256.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vexp.h"

#define MAX_D 256

static inline float dot(const float *a, const float *b, int D) {
    __m256 acc = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

/* One (row, head): ``score`` and ``slot`` are scratch for K entries (K rounded up to 8 for the scores). */
static void attend_row(const float *q, const float *k_cache, const float *v_cache, const int64_t *slots,
                       const uint8_t *mask, int K, int Hkv, int D, int kvh, float scale, float *score,
                       int64_t *slot, float *out) {
    long kv_row = (long)Hkv * D;
    int n = 0;
    float top = -INFINITY;
    for (int j = 0; j < K; j++) {
        if (mask && !mask[j]) continue;
        slot[n] = slots[j];
        float s = scale * dot(q, k_cache + slots[j] * kv_row + (long)kvh * D, D);
        score[n++] = s;
        top = s > top ? s : top;
    }
    if (n == 0) {
        for (int d = 0; d < D; d++) out[d] = 0.f;
        return;
    }
    int padded = (n + 7) & ~7;
    for (int c = n; c < padded; c++) score[c] = -INFINITY;
    __m256 vtop = _mm256_set1_ps(top);
    for (int c = 0; c < padded; c += 8)
        _mm256_storeu_ps(score + c, exp8(_mm256_sub_ps(_mm256_loadu_ps(score + c), vtop)));
    __m256 acc[MAX_D / 8];
    for (int d = 0; d < D / 8; d++) acc[d] = _mm256_setzero_ps();
    float total = 0.f;
    for (int c = 0; c < n; c++) {
        const float *v = v_cache + slot[c] * kv_row + (long)kvh * D;
        __m256 p = _mm256_set1_ps(score[c]);
        total += score[c];
        for (int d = 0; d < D / 8; d++) acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * d), acc[d]);
    }
    __m256 inv = _mm256_set1_ps(1.0f / total);
    for (int d = 0; d < D / 8; d++) _mm256_storeu_ps(out + 8 * d, _mm256_mul_ps(acc[d], inv));
}

/* Every (grid, row, head) of a forward; returns 0, or -1 when the scratch could not be allocated. */
int attend_paged(const float *q, long q_stride, const float *k_cache, const float *v_cache,
                 const int64_t *key_slots, const uint8_t *mask, int G, int Q, int K, int H, int Hkv, int D,
                 float scale, float *out, int threads) {
    int per_kv = H / Hkv, failed = 0;
    long items = (long)G * Q * H;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *score = (float *)malloc(sizeof(float) * (size_t)(K + 8));
        int64_t *slot = (int64_t *)malloc(sizeof(int64_t) * (size_t)K);
        failed = !score || !slot;
#pragma omp for schedule(static)
        for (long it = 0; it < items; it++) {
            if (!score || !slot) continue; /* every thread meets the loop; one without scratch reports it */
            long row = it / H; /* g * Q + r */
            int h = (int)(it % H), g = (int)(row / Q);
            attend_row(q + row * q_stride + (long)h * D, k_cache, v_cache, key_slots + (long)g * K,
                       mask ? mask + row * K : 0, K, Hkv, D, h / per_kv, scale, score, slot,
                       out + (row * H + h) * D);
        }
        free(score);
        free(slot);
    }
    return failed ? -1 : 0;
}
