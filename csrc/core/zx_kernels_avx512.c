/* zx_kernels_avx512.c — AVX-512 (F, BW, VL) kernels, 16 fp32 lanes.
 *
 * Compiled with the core's plain flags: each function enables the ISA itself with
 * a target attribute, and zx_kernels.c only calls here after zx_cpu_supports().
 * The optimizer bodies come from zx_kernels_simd.inc, written in the AVX-512
 * vocabulary of zx_simd_avx512.h (Note [One SIMD body, two vocabularies] in
 * zx_simd.h); what is specific to the kernels on AVX-512 lives here: the gradient
 * scan and the fp32 -> bf16/fp16 conversions. bf16 uses vcvtneps2bf16
 * when the CPU has AVX512-BF16, else the same integer rounding as the reference.
 */
#include "zx_kernels_internal.h"

#if ZX_HAVE_X86_SIMD
#include "zx_simd_avx512.h"     /* defines: vec, vec_*, ZX_SIMD_TARGET(_BF16), ZX_SIMD_NAME */
#include "zx_kernels_simd.inc"  /* defines: zx_adam_avx512, zx_adam_lp_avx512, zx_sgd_avx512, ... */
#include "zx_kernels_sr_simd.inc"  /* defines: zx_adam_bf16s_avx512 */

/* ---- gradient scan ---- */
ZX_SIMD_TARGET
void zx_grad_sumsq_avx512(size_t n, const float *grad, float scale, double *sumsq,
                          int64_t *nonfinite) {
    const __m512i exp_mask = _mm512_set1_epi32(0x7f800000);
    const __m512d scale_d = _mm512_set1_pd((double)scale);
    __m512d acc_lo = _mm512_setzero_pd(), acc_hi = _mm512_setzero_pd();
    int64_t bad = 0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 g = _mm512_loadu_ps(grad + i);
        /* finite <=> exponent bits not all ones */
        __m512i e = _mm512_and_si512(_mm512_castps_si512(g), exp_mask);
        __mmask16 finite = _mm512_cmpneq_epi32_mask(e, exp_mask);
        bad += 16 - __builtin_popcount((unsigned)finite);
        g = _mm512_maskz_mov_ps(finite, g);  /* inf/nan lanes add 0 */
        __m256 g_lo = _mm512_castps512_ps256(g);
        __m256 g_hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1));
        __m512d x_lo = _mm512_mul_pd(_mm512_cvtps_pd(g_lo), scale_d);  /* exact */
        __m512d x_hi = _mm512_mul_pd(_mm512_cvtps_pd(g_hi), scale_d);
        acc_lo = _mm512_fmadd_pd(x_lo, x_lo, acc_lo);
        acc_hi = _mm512_fmadd_pd(x_hi, x_hi, acc_hi);
    }
    double sum = _mm512_reduce_add_pd(_mm512_add_pd(acc_lo, acc_hi));
    zx_grad_sumsq_ref(n - i, grad + i, scale, &sum, &bad);
    *sumsq += sum;
    *nonfinite += bad;
}

/* ---- fp32 -> bf16 / fp16 ---- */

/* Note [Streaming copy-out]
 * The optimizer's copy-out writes a low-precision array nothing reads before the
 * all-gather, usually far larger than the caches. A plain store first reads each
 * destination line (write-allocate): +2 bytes of traffic per parameter on top of
 * the 2 written. With stream = 1 the aligned middle uses non-temporal stores
 * (vmovntdq), which write whole lines without reading them; an sfence at the end
 * orders them before whatever the caller does next. */

/* Elements to convert with the reference before dst is 32-byte aligned (stream only). */
static size_t stream_head(size_t n, const uint16_t *dst, int stream) {
    if (!stream) return 0;
    size_t head = ((32 - ((uintptr_t)dst & 31)) & 31) / sizeof *dst;
    if ((uintptr_t)dst & 1) head = n;   /* odd address: never aligned, no streaming */
    return head < n ? head : n;
}

static ZX_SIMD_TARGET void cast_bf16_int(size_t n, const float *src, uint16_t *dst, int stream) {
    size_t i = stream_head(n, dst, stream);
    zx_cast_from_f32_ref(i, src, dst, ZX_BF16);
    for (; i + VEC_WIDTH <= n; i += VEC_WIDTH)
        vec_u16_store(dst + i, vec_to_bf16(vec_load(src + i)), stream);
    zx_cast_from_f32_ref(n - i, src + i, dst + i, ZX_BF16);
}

/* vcvtneps2bf16 rounds to nearest even and quiets NaN like the reference, but
 * flushes subnormal inputs to zero; those (rare) vectors are redone in integers. */
static ZX_SIMD_TARGET_BF16 void cast_bf16_native(size_t n, const float *src, uint16_t *dst, int stream) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    const __m512i min_normal = _mm512_set1_epi32(0x00800000);
    size_t i = stream_head(n, dst, stream);
    zx_cast_from_f32_ref(i, src, dst, ZX_BF16);
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(src + i);
        __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
        __m512i a = _mm512_and_si512(_mm512_castps_si512(x), abs_mask);
        __mmask16 sub = _mm512_cmplt_epi32_mask(a, min_normal) &
                        _mm512_test_epi32_mask(a, a);
        if (sub) r = vec_to_bf16(x);
        vec_u16_store(dst + i, r, stream);
    }
    zx_cast_from_f32_ref(n - i, src + i, dst + i, ZX_BF16);
}

ZX_SIMD_TARGET
void zx_cast_from_f32_avx512(size_t n, const float *src, void *dst, zx_dtype dtype, int stream) {
    uint16_t *out = (uint16_t *)dst;
    if (dtype == ZX_BF16) {
        if (zx_cpu_has_avx512_bf16())
            cast_bf16_native(n, src, out, stream);
        else
            cast_bf16_int(n, src, out, stream);
    } else {
        size_t i = stream_head(n, out, stream);
        zx_cast_from_f32_ref(i, src, out, ZX_F16);
        for (; i + VEC_WIDTH <= n; i += VEC_WIDTH)
            vec_u16_store(out + i, vec_to_f16(vec_load(src + i)), stream);
        zx_cast_from_f32_ref(n - i, src + i, out + i, ZX_F16);
    }
    if (stream) vec_store_fence();
}

#else
typedef int zx_kernels_avx512_unused; /* ISO C wants a non-empty file */
#endif
