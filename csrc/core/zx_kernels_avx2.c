/* zx_kernels_avx2.c — AVX2 + FMA + F16C kernels, 8 fp32 lanes.
 *
 * Compiled with the core's plain flags: each function enables the ISA itself with
 * a target attribute, and zx_kernels.c only calls here after zx_cpu_supports().
 * The optimizer bodies come from zx_kernels_simd.inc, written in the AVX2 vocabulary
 * of zx_simd_avx2.h (Note [One SIMD body, two vocabularies] in zx_simd.h); what is
 * specific to the kernels on AVX2 lives here: the gradient scan and the
 * fp32 -> bf16/fp16 conversions.
 */
#include "zx_kernels_internal.h"

#if ZX_HAVE_X86_SIMD
#include "zx_simd_avx2.h"       /* defines: vec, vec_*, ZX_SIMD_TARGET, ZX_SIMD_NAME */
#include "zx_kernels_simd.inc"  /* defines: zx_adam_avx2, zx_adam_lp_avx2, zx_sgd_avx2, ... */
#include "zx_kernels_sr_simd.inc"  /* defines: zx_adam_bf16s_avx2 */

/* ---- gradient scan ---- */
ZX_SIMD_TARGET
void zx_grad_sumsq_avx2(size_t n, const float *grad, float scale, double *sumsq,
                        int64_t *nonfinite) {
    const __m256i exp_mask = _mm256_set1_epi32(0x7f800000);
    const __m256d scale_d = _mm256_set1_pd((double)scale);
    __m256d acc_lo = _mm256_setzero_pd(), acc_hi = _mm256_setzero_pd();
    int64_t bad = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(grad + i);
        /* non-finite <=> exponent bits all ones */
        __m256i e = _mm256_and_si256(_mm256_castps_si256(g), exp_mask);
        __m256 nonfin = _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, exp_mask));
        bad += __builtin_popcount((unsigned)_mm256_movemask_ps(nonfin));
        g = _mm256_andnot_ps(nonfin, g);  /* inf/nan lanes add 0 */
        __m256d x_lo = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(g)), scale_d);
        __m256d x_hi = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(g, 1)), scale_d);
        acc_lo = _mm256_fmadd_pd(x_lo, x_lo, acc_lo);
        acc_hi = _mm256_fmadd_pd(x_hi, x_hi, acc_hi);
    }
    __m256d acc = _mm256_add_pd(acc_lo, acc_hi);
    __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(acc), _mm256_extractf128_pd(acc, 1));
    double sum = _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
    zx_grad_sumsq_ref(n - i, grad + i, scale, &sum, &bad);
    *sumsq += sum;
    *nonfinite += bad;
}

/* ---- fp32 -> bf16 / fp16 ---- */

ZX_SIMD_TARGET
void zx_cast_from_f32_avx2(size_t n, const float *src, void *dst, zx_dtype dtype, int stream) {
    (void)stream;   /* Note [Streaming copy-out]: AVX-512 only */
    uint16_t *out = (uint16_t *)dst;
    size_t i = 0;
    if (dtype == ZX_BF16) {
        for (; i + VEC_WIDTH <= n; i += VEC_WIDTH)
            vec_u16_store(out + i, vec_to_bf16(vec_load(src + i)), 0);
    } else {
        for (; i + VEC_WIDTH <= n; i += VEC_WIDTH)
            vec_u16_store(out + i, vec_to_f16(vec_load(src + i)), 0);
    }
    zx_cast_from_f32_ref(n - i, src + i, out + i, dtype);
}

#else
typedef int zx_kernels_avx2_unused; /* ISO C wants a non-empty file */
#endif
