/* zx_quant_avx2.c — AVX2 chunk kernels of the blockwise quantization, 8 fp32 lanes.
 *
 * Each function enables the ISA with a target attribute; zx_quant.c calls here only
 * after zx_cpu_supports(ZX_ISA_AVX2). The encode/decode bodies come from
 * zx_quant_simd.inc; the vocabulary and the amax scan are AVX2-specific.
 */
#include "zx_quant_internal.h"

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
static inline ZX_SIMD_TARGET vec vec_min(vec a, vec b) { return _mm256_min_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_max(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_round_even(vec a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* 8 integral floats -> 8 int32 -> 8 int16 -> 8 int8 (saturating packs never saturate:
 * the values are within [-127, 127]) */
static inline ZX_SIMD_TARGET void vec_store_i8(int8_t *p, vec a) {
    __m256i i32 = _mm256_cvtps_epi32(a);
    __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(i16, i16));
}
static inline ZX_SIMD_TARGET vec vec_load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

#include "zx_quant_simd.inc"

/* ---- amax scan ---- */
ZX_SIMD_TARGET
uint32_t zx_q_absmax_avx2(size_t n, const float *x) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    __m256i acc = _mm256_setzero_si256();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i u = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), abs_mask);
        acc = _mm256_max_epu32(acc, u);
    }
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    uint32_t amax = (uint32_t)_mm_cvtsi128_si32(m);
    uint32_t tail = zx_q_absmax_ref(n - i, x + i);
    return tail > amax ? tail : amax;
}

#else
typedef int zx_quant_avx2_unused; /* ISO C wants a non-empty file */
#endif
