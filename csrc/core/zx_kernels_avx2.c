/* zx_kernels_avx2.c — AVX2 + FMA + F16C kernels, 8 fp32 lanes.
 *
 * Compiled with the core's plain flags: each function enables the ISA itself with
 * a target attribute, and zx_kernels.c only calls here after zx_cpu_supports().
 * The optimizer bodies come from zx_kernels_simd.inc (Note [One SIMD body, two
 * vocabularies]); what is specific to AVX2 lives here: the vocabulary, the
 * gradient scan and the fp32 -> bf16/fp16 conversions.
 */
#include "zx_kernels_internal.h"

#if ZX_HAVE_X86_SIMD
#include <immintrin.h>

#define ZX_SIMD_TARGET __attribute__((target("avx2,fma,f16c")))
#define ZX_SIMD_SUFFIX avx2

/* ---- vocabulary ---- */
typedef __m256 vec;
#define VEC_WIDTH 8

static inline ZX_SIMD_TARGET vec vec_load(const float *p) { return _mm256_loadu_ps(p); }
static inline ZX_SIMD_TARGET void vec_store(float *p, vec a) { _mm256_storeu_ps(p, a); }
static inline ZX_SIMD_TARGET vec vec_set1(float a) { return _mm256_set1_ps(a); }
static inline ZX_SIMD_TARGET vec vec_add(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_div(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_sqrt(vec a) { return _mm256_sqrt_ps(a); }
static inline ZX_SIMD_TARGET vec vec_fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
/* torch.maximum: vmaxps gives (a > b ? a : b); lanes with a NaN get a + b (NaN). */
static inline ZX_SIMD_TARGET vec vec_max_nan(vec a, vec b) {
    vec nan = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_max_ps(a, b), _mm256_add_ps(a, b), nan);
}
static inline ZX_SIMD_TARGET vec vec_load_bf16(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline ZX_SIMD_TARGET vec vec_load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* Round 8 fp32 to bf16 exactly like zx_f32_to_bf16_ref, with integer arithmetic. */
static inline ZX_SIMD_TARGET __m128i bf16_round_int(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i hi = _mm256_srli_epi32(u, 16);
    __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x0040));
    r = _mm256_blendv_epi8(r, quiet, nan);
    /* 8 x u32 (each <= 0xffff) -> 8 x u16 */
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* One vector of the low-precision copy (lp_dtype ZX_BF16 or ZX_F16), streamed past the
 * caches when `stream` (Note [Streaming copy-out] in zx_kernels_avx512.c; dst then
 * 16-byte aligned). */
static inline ZX_SIMD_TARGET void vec_store_lp(uint16_t *dst, vec a, int lp_dtype, int stream) {
    __m128i r = lp_dtype == ZX_BF16 ? bf16_round_int(a) : _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT);
    if (stream)
        _mm_stream_si128((__m128i *)dst, r);
    else
        _mm_storeu_si128((__m128i *)dst, r);
}
#define VEC_LP_ALIGN 16
static inline ZX_SIMD_TARGET void vec_store_fence(void) { _mm_sfence(); }

#include "zx_kernels_simd.inc"

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
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(out + i), bf16_round_int(_mm256_loadu_ps(src + i)));
    } else {
        for (; i + 8 <= n; i += 8) {
            __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
            _mm_storeu_si128((__m128i *)(out + i), h);
        }
    }
    zx_cast_from_f32_ref(n - i, src + i, out + i, dtype);
}

#else
typedef int zx_kernels_avx2_unused; /* ISO C wants a non-empty file */
#endif
