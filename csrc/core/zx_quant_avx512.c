/* zx_quant_avx512.c — AVX-512 (F, BW, VL) chunk kernels of the blockwise quantization,
 * 16 fp32 lanes.
 *
 * Each function enables the ISA with a target attribute; zx_quant.c calls here only
 * after zx_cpu_supports(ZX_ISA_AVX512). The encode/decode bodies come from
 * zx_quant_simd.inc; the vocabulary and the amax scan are AVX-512-specific.
 */
#include "zx_quant_internal.h"

#if ZX_HAVE_X86_SIMD
#include <immintrin.h>

#define ZX_SIMD_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
#define ZX_SIMD_SUFFIX avx512

/* ---- vocabulary ---- */
typedef __m512 vec;
#define VEC_WIDTH 16

static inline ZX_SIMD_TARGET vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline ZX_SIMD_TARGET void vec_store(float *p, vec a) { _mm512_storeu_ps(p, a); }
static inline ZX_SIMD_TARGET vec vec_set1(float a) { return _mm512_set1_ps(a); }
static inline ZX_SIMD_TARGET vec vec_add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_div(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_min(vec a, vec b) { return _mm512_min_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_max(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline ZX_SIMD_TARGET vec vec_round_even(vec a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* 16 integral floats -> 16 int32 -> 16 int8 (vpmovdb truncates; the values fit) */
static inline ZX_SIMD_TARGET void vec_store_i8(int8_t *p, vec a) {
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a)));
}
static inline ZX_SIMD_TARGET vec vec_load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

#include "zx_quant_simd.inc"

/* ---- amax scan ---- */
ZX_SIMD_TARGET
uint32_t zx_q_absmax_avx512(size_t n, const float *x) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    __m512i acc = _mm512_setzero_si512();
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i u = _mm512_and_si512(_mm512_loadu_si512((const void *)(x + i)), abs_mask);
        acc = _mm512_max_epu32(acc, u);
    }
    uint32_t amax = (uint32_t)_mm512_reduce_max_epu32(acc);
    uint32_t tail = zx_q_absmax_ref(n - i, x + i);
    return tail > amax ? tail : amax;
}

#else
typedef int zx_quant_avx512_unused; /* ISO C wants a non-empty file */
#endif
