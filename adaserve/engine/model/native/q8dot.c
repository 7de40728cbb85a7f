/* Integer dot products for weight-quantized linear layers on x86-64 CPUs with AVX2 and FMA.
 *
 * y[r, n] = sum_k x[r, k] W[n, k], with the activations quantized per row in blocks of 32 (GGUF's Q8 form):
 *     x[r, k] ~ s[r, g] * a[r, k],  a int8 in -127..127,  s = max|x[r, block g]| / 127
 * and the weights in one of two forms:
 *     int4   W[n, k] = d[n, g] * q[n, k] + m[n, g],  q in 0..15       (GGUF Q4_1)
 *            y[r, n] = sum_g s[r, g] d[n, g] (q . a)_g  +  m[n, g] (s[r, g] sum_g a)
 *     int8   W[n, k] = c[n] * q[n, k],  q int8                        (one scale per output row)
 *            y[r, n] = c[n] * sum_g s[r, g] (q . a)_g
 * The products within a block, (q . a)_g, are integers, exact in any order (_mm256_maddubs_epi16 then
 * _mm256_madd_epi16: |15 * 127 * 2| and |127 * 127 * 2| fit int16; or, where the CPU has VNNI and the build
 * enables it, _mm256_dpbusd_epi32, which forms the same eight lanes of four products in one instruction: the
 * results are bitwise those of the AVX2 build). Every (r, n) is computed by one thread in one
 * fixed sequence of float operations (eight lanes accumulated over the blocks in order, then one horizontal sum),
 * whatever the number of rows M, the row and column blocking and the thread count, so a row's result never depends
 * on the batch it came in: the property lossless speculation needs.
 *
 * Tiles: ROWS activation rows share each decoded weight block, and COLS output columns each loaded activation block
 * (and its scales), so a verification of a few rows reads and decodes its weights about once, not once a row or a
 * column; the accumulators of a tile stay in registers (an AVX2 build's two-column tiles take two rows, its 16
 * vector registers holding four accumulators). Where two-column tiles measured no faster (an AVX2 build's int4
 * products from 16 rows, the int8 head from 8), each column is its own tile, as before them. An int4 tile forms its
 * rows' scales d * s and sums m * s sum(a) four rows at a time in vector lanes (each lane the float operations the
 * scalar form made, so the same bits; an AVX2 build only in its full 4-row tiles, where that measured faster), from
 * the scales laid out by block (linear_q4 quantizes into that layout).
 *
 * Built with -ffp-contract=off so that the compiler fuses no multiply-add on its own in one loop and not in another.
 *
 * Layouts: a int8 [M, K]; s and s*sum(a) float [M, K/32] (mm_q4_q8 takes them by block: [K/32, M rounded up to 4],
 * zero padded, as linear_q4's quantize_rows writes them); int4 weights [N, K/32, 16] bytes, byte j of a block
 * holding column j in its low nibble and column j + 16 in its high one; d, m float [N, K/32]; int8 weights [N, K];
 * c float [N]; y float [M, N]. K is a multiple of 32.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 32
#define ROWS 4 /* activation rows sharing one decode of a weight block */
#define COLS 2 /* output columns sharing one load of an activation block */
#if defined(__AVX512VL__)
#define WIDE_ROWS 4 /* rows of a COLS-column tile: 32 vector registers hold its 8 accumulators */
#define Q4_WIDE_MAX_M 1073741824 /* the int4 products take column tiles at any M */
#define VECTOR_SCALES 1 /* every int4 tile forms its rows' scales four at a time (q4_tile) */
#else
#define WIDE_ROWS 2 /* AVX2's 16 registers: 4 accumulators, so that none spills */
#define Q4_WIDE_MAX_M 15 /* from 16 rows on, AVX2's 2x2 tiles read a few percent behind one column's 4-row tiles */
#define VECTOR_SCALES 0 /* only its full 4-row tiles do: its 2- and 3-row ones read slower so (registers) */
#endif
#define Q8_WIDE_MAX_M 7 /* the int8 head's column tiles read a few percent behind from 8 rows on */

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

/* the largest of eight lanes */
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* (q . a) of one block as eight int32 lanes, converted to float; q unsigned 0..15 (or |w|), a signed */
static inline __m256 block_dot(__m256i q, __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    /* one instruction for the two below, the same eight lanes: each the exact sum of four adjacent products */
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), q, a));
#elif defined(__AVXVNNI__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, a));
#else
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q, a), ones));
#endif
}

static inline __m256i unpack_q4(const uint8_t *p) {
    const __m128i low = _mm_set1_epi8(0x0F);
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}

/* The activations' int8 codes per block of 32: a = round(x * (127 / amax)), half to even (the vector
 * rounding and nearbyintf in the default mode agree), s = amax / 127, and s * sum(a); row r's block g scales at
 * r * rs + g * gs (by row: rs = K/32, gs = 1; by block, as mm_q4_q8 reads them: rs = 1, gs = the padded rows). */
static void quantize_rows(const float *x, int M, int K, int8_t *a, float *s, float *s_sum, long rs, long gs) {
    int G = K / BLOCK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (long r = 0; r < M; r++)
        for (int g = 0; g < G; g++) {
            const float *p = x + r * K + (long)g * BLOCK;
            int8_t *out = a + r * K + (long)g * BLOCK;
            __m256 v[4], mx = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(p + 8 * i);
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
            }
            float amax = hmax8(mx);
            __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            __m256i q[4];
            for (int i = 0; i < 4; i++)
                q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            /* int32 -> int16 -> int8 with saturation (|q| <= 127 already); packs interleave 128-bit lanes */
            __m256i q16 = _mm256_packs_epi32(q[0], q[1]), q16b = _mm256_packs_epi32(q[2], q[3]);
            __m256i q8 = _mm256_packs_epi16(q16, q16b);
            q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)out, q8);
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_hadd_epi32(s4, s4);
            s4 = _mm_hadd_epi32(s4, s4);
            s[r * rs + g * gs] = amax / 127.f;
            s_sum[r * rs + g * gs] = (amax / 127.f) * (float)_mm_cvtsi128_si32(s4);
        }
}

/* quantize_rows with the scales by row: s and s*sum(a) float [M, K/32] */
void quantize_rows_q8(const float *x, int M, int K, int8_t *a, float *s, float *s_sum) {
    quantize_rows(x, M, K, a, s, s_sum, K / BLOCK, 1);
}

/* R activation rows (1 <= R <= ROWS) against C output columns n0 .. n0 + C - 1 (1 <= C <= COLS): each weight block
 * decoded once for the R rows, each activation block loaded once for the C columns, every (r, n) summed in the order
 * stated at the top (the tile a row or a column falls in changes no bit). The rows' scales are read from st and sumt
 * ([G][MP]: block g's scales of rows 0 .. MP - 1, MP = M rounded up to 4, the padding 0). With vector scales one
 * multiply forms four rows' d * s of a column (lane i the float product the scalar form makes) and the four rows'
 * m * s sum(a) terms are added in four lanes (each lane one row's sum, in block order): the same bits, fewer
 * instructions. Called with constant R and C, so that the compiler unrolls both and keeps their accumulators in
 * registers. */
static inline __attribute__((always_inline)) void q4_tile(int R, int C, const int8_t *a, const float *st,
                                                          const float *sumt, long MP, long r0, int K,
                                                          const uint8_t *w, const float *d, const float *m, long n0,
                                                          int N, float *y) {
    const int vector = VECTOR_SCALES || R == ROWS;
    int G = K / BLOCK;
    __m256 acc[COLS][ROWS];
    __m128 macc4[COLS]; /* vector scales: the rows' m terms, lane i row r0 + i */
    float macc[COLS][ROWS]; /* scalar scales: the same sums, one float each */
    for (int c = 0; c < C; c++) {
        macc4[c] = _mm_setzero_ps();
        for (int i = 0; i < R; i++) acc[c][i] = _mm256_setzero_ps(), macc[c][i] = 0.f;
    }
    for (int g = 0; g < G; g++) {
        const float *sg = st + g * MP + r0, *sum = sumt + g * MP + r0;
        __m256i q[COLS];
        __m256 scale[COLS];
        for (int c = 0; c < C; c++) {
            long at = (n0 + c) * G + g;
            q[c] = unpack_q4(w + at * 16);
            if (vector) {
                scale[c] = _mm256_castps128_ps256(_mm_mul_ps(_mm_set1_ps(d[at]), _mm_loadu_ps(sg)));
                macc4[c] = _mm_add_ps(macc4[c], _mm_mul_ps(_mm_set1_ps(m[at]), _mm_loadu_ps(sum)));
            }
        }
        for (int i = 0; i < R; i++) {
            __m256i av = _mm256_loadu_si256((const __m256i *)(a + (r0 + i) * K + (long)g * BLOCK));
            for (int c = 0; c < C; c++) {
                long at = (n0 + c) * G + g;
                __m256 si = vector ? _mm256_permutevar8x32_ps(scale[c], _mm256_set1_epi32(i)) /* lane i, 8 times */
                                   : _mm256_set1_ps(d[at] * sg[i]);
                acc[c][i] = _mm256_fmadd_ps(block_dot(q[c], av), si, acc[c][i]);
                if (!vector) macc[c][i] += m[at] * sum[i];
            }
        }
    }
    for (int c = 0; c < C; c++) {
        if (vector) _mm_storeu_ps(macc[c], macc4[c]); /* R <= 4 = the lanes */
        for (int i = 0; i < R; i++) y[(r0 + i) * N + n0 + c] = hsum8(acc[c][i]) + macc[c][i];
    }
}

/* Every row tile of columns n0 .. n0 + C - 1: ROWS rows at a time, then the last rows in one tile (a constant size,
 * unrolled: a 2- or 3-row verification decodes each weight block once, not once a row). */
static inline __attribute__((always_inline)) void q4_columns(int C, const int8_t *a, const float *st,
                                                             const float *sumt, long MP, int M, int K,
                                                             const uint8_t *w, const float *d, const float *m,
                                                             long n0, int N, float *y) {
    long r = 0;
    if (C == 1 || WIDE_ROWS == ROWS)
        for (; r + ROWS <= M; r += ROWS) q4_tile(ROWS, C, a, st, sumt, MP, r, K, w, d, m, n0, N, y);
    else
        for (; r + WIDE_ROWS <= M; r += WIDE_ROWS) q4_tile(WIDE_ROWS, C, a, st, sumt, MP, r, K, w, d, m, n0, N, y);
    switch (M - r) {
    case 3: q4_tile(3, C, a, st, sumt, MP, r, K, w, d, m, n0, N, y); break;
    case 2: q4_tile(2, C, a, st, sumt, MP, r, K, w, d, m, n0, N, y); break;
    case 1: q4_tile(1, C, a, st, sumt, MP, r, K, w, d, m, n0, N, y); break;
    }
}

/* a int8 [M, K]; st and sumt the rows' scales by block, [G][MP] (q4_tile); the rest as at the top. */
void mm_q4_q8(const int8_t *a, const float *st, const float *sumt, int M, int K, const uint8_t *w,
              const float *d, const float *m, int N, float *y, int threads) {
    long MP = ((long)M + 3) & ~3L;
    if (M > Q4_WIDE_MAX_M) { /* one column at a time */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long n = 0; n < N; n++) q4_columns(1, a, st, sumt, MP, M, K, w, d, m, n, N, y);
        return;
    }
    long tiles = N / COLS; /* COLS columns a tile, then the last N % COLS one by one */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < tiles; t++) q4_columns(COLS, a, st, sumt, MP, M, K, w, d, m, t * COLS, N, y);
    for (long n = tiles * COLS; n < N; n++) q4_columns(1, a, st, sumt, MP, M, K, w, d, m, n, N, y);
}

/* q4_tile's int8 form: R rows against C columns, each (r, n) c[n] times its blocks' sum in order. */
static inline __attribute__((always_inline)) void q8_tile(int R, int C, const int8_t *a, const float *s, long r0,
                                                          int K, const int8_t *w, const float *cn, long n0, int N,
                                                          float *y) {
    int G = K / BLOCK;
    __m256 acc[COLS][ROWS];
    for (int c = 0; c < C; c++)
        for (int i = 0; i < R; i++) acc[c][i] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m256i wv[COLS], wabs[COLS];
        for (int c = 0; c < C; c++) {
            wv[c] = _mm256_loadu_si256((const __m256i *)(w + (n0 + c) * K + (long)g * BLOCK));
            wabs[c] = _mm256_sign_epi8(wv[c], wv[c]); /* |w|, and a takes w's sign: q . a unchanged */
        }
        for (int i = 0; i < R; i++) {
            long row = r0 + i;
            __m256i av = _mm256_loadu_si256((const __m256i *)(a + row * K + (long)g * BLOCK));
            __m256 sg = _mm256_set1_ps(s[row * G + g]);
            for (int c = 0; c < C; c++)
                acc[c][i] = _mm256_fmadd_ps(block_dot(wabs[c], _mm256_sign_epi8(av, wv[c])), sg, acc[c][i]);
        }
    }
    for (int c = 0; c < C; c++)
        for (int i = 0; i < R; i++) y[(r0 + i) * N + n0 + c] = cn[n0 + c] * hsum8(acc[c][i]);
}

static inline __attribute__((always_inline)) void q8_columns(int C, const int8_t *a, const float *s, int M, int K,
                                                             const int8_t *w, const float *cn, long n0, int N,
                                                             float *y) {
    long r = 0;
    if (C == 1 || WIDE_ROWS == ROWS)
        for (; r + ROWS <= M; r += ROWS) q8_tile(ROWS, C, a, s, r, K, w, cn, n0, N, y);
    else
        for (; r + WIDE_ROWS <= M; r += WIDE_ROWS) q8_tile(WIDE_ROWS, C, a, s, r, K, w, cn, n0, N, y);
    switch (M - r) {
    case 3: q8_tile(3, C, a, s, r, K, w, cn, n0, N, y); break;
    case 2: q8_tile(2, C, a, s, r, K, w, cn, n0, N, y); break;
    case 1: q8_tile(1, C, a, s, r, K, w, cn, n0, N, y); break;
    }
}

void mm_q8_q8(const int8_t *a, const float *s, int M, int K, const int8_t *w, const float *c, int N, float *y,
              int threads) {
    if (M > Q8_WIDE_MAX_M) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long n = 0; n < N; n++) q8_columns(1, a, s, M, K, w, c, n, N, y);
        return;
    }
    long tiles = N / COLS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < tiles; t++) q8_columns(COLS, a, s, M, K, w, c, t * COLS, N, y);
    for (long n = tiles * COLS; n < N; n++) q8_columns(1, a, s, M, K, w, c, n, N, y);
}

/* The layers' entry points: x float32 [M, K] quantized here (scratch from malloc), then the product. Return 0,
 * or -1 when the scratch could not be allocated (y is then untouched). The scratch's scales hold ``rows`` rows a
 * block (M, or M rounded up to 4 for mm_q4_q8's scales by block), zeroed: padding rows read 0. */
static int scratch(int M, int K, long rows, int8_t **a, float **s, float **s_sum) {
    long G = K / BLOCK;
    *a = (int8_t *)malloc((size_t)M * K);
    *s = (float *)calloc((size_t)rows * G * 2, sizeof(float));
    *s_sum = *s ? *s + (size_t)rows * G : 0;
    if (!*a || !*s) {
        free(*a);
        free(*s);
        return -1;
    }
    return 0;
}

int linear_q4(const float *x, int M, int K, const uint8_t *w, const float *d, const float *m, int N, float *y,
              int threads) {
    int8_t *a;
    float *s, *s_sum;
    long MP = ((long)M + 3) & ~3L;
    if (scratch(M, K, MP, &a, &s, &s_sum)) return -1;
    quantize_rows(x, M, K, a, s, s_sum, 1, MP); /* the scales by block, as mm_q4_q8 reads them */
    mm_q4_q8(a, s, s_sum, M, K, w, d, m, N, y, threads);
    free(a);
    free(s);
    return 0;
}

int linear_q8(const float *x, int M, int K, const int8_t *w, const float *c, int N, float *y, int threads) {
    int8_t *a;
    float *s, *s_sum;
    if (scratch(M, K, M, &a, &s, &s_sum)) return -1;
    quantize_rows_q8(x, M, K, a, s, s_sum);
    mm_q8_q8(a, s, M, K, w, c, N, y, threads);
    free(a);
    free(s);
    return 0;
}

/* RMSNorm of each row, Hugging Face's order: y = w * (x / sqrt(mean(x^2) + eps)), the squares summed in eight
 * lanes then the tail, one fixed order per row. x, y float32 [M, K]; w float32 [K]. */
void rms_norm_f32(const float *x, int M, int K, const float *w, float eps, float *y) {
    for (long r = 0; r < M; r++) {
        const float *p = x + r * K;
        float *out = y + r * K;
        __m256 acc = _mm256_setzero_ps();
        int k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 v = _mm256_loadu_ps(p + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8(acc);
        for (; k < K; k++) ss += p[k] * p[k];
        __m256 inv = _mm256_set1_ps(1.0f / sqrtf(ss / (float)K + eps));
        k = 0;
        for (; k + 8 <= K; k += 8)
            _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_loadu_ps(w + k),
                                                    _mm256_mul_ps(_mm256_loadu_ps(p + k), inv)));
        for (; k < K; k++) out[k] = w[k] * (p[k] * _mm256_cvtss_f32(inv));
    }
}
