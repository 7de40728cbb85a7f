/* The CPU kernels' vector exponentials: exp8 (attend.c's attention weights) and exp8_fma, the same polynomial with
 * fused multiply-adds (picks.c's log-softmax sums over a vocabulary, where it is a fifth of a draft level's picks'
 * time less). Included, not compiled alone. */
#ifndef ADASERVE_VEXP_H
#define ADASERVE_VEXP_H
#include <immintrin.h>

/* What both exponentials share: x clamped to -87 (``under``: the lanes below it, whose result is 0, so that -inf
 * padding weighs nothing), n = round(x / ln2); and at the end y * 2^n, 0 on those lanes. */
static inline __m256 exp8_range(__m256 *x, __m256 *under) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    *under = _mm256_cmp_ps(*x, lo, _CMP_LT_OQ);
    *x = _mm256_max_ps(*x, lo);
    return _mm256_round_ps(_mm256_mul_ps(*x, _mm256_set1_ps(1.44269504088896341f)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

static inline __m256 exp8_scale(__m256 y, __m256 n, __m256 under) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

/* exp(x) for x <= 0, eight at a time: x = n ln2 + f, exp(f) by Cephes' degree-6 polynomial, times 2^n; 0 below
 * -87 (where float32's exp is no longer normal). */
static inline __m256 exp8(__m256 x) {
    __m256 under, n = exp8_range(&x, &under);
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), x), _mm256_set1_ps(1.0f));
    return exp8_scale(y, n, under);
}

/* exp8's polynomial with fused multiply-adds: the same reduction and coefficients in about half the instructions,
 * each step rounded once instead of twice (so not exp8's bits: within float32's rounding of it). For sums that only
 * need float32 accuracy (picks.c's log-sum-exp over a vocabulary), not for attention's weights, which keep exp8. */
static inline __m256 exp8_fma(__m256 x) {
    __m256 under, n = exp8_range(&x, &under);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_fmadd_ps(_mm256_set1_ps(1.9875691500e-4f), x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
    return exp8_scale(y, n, under);
}

#endif
