/* zx_quant_avx512.c — AVX-512 (F, BW, VL) chunk kernels of the blockwise quantization,
 * 16 fp32 lanes.
 *
 * Each function enables the ISA with a target attribute; zx_quant.c calls here only
 * after zx_cpu_supports(ZX_ISA_AVX512). The encode/decode bodies come from
 * zx_quant_simd.inc, in the vocabulary the kernels use too (zx_simd_avx512.h); the amax
 * scan is AVX-512-specific.
 */
#include "zx_quant_internal.h"

#if ZX_HAVE_X86_SIMD
#include "zx_simd_avx512.h"   /* defines: vec, vec_*, ZX_SIMD_TARGET, ZX_SIMD_NAME */
#include "zx_quant_simd.inc"  /* defines: zx_q_encode_avx512, zx_q_decode_avx512 */

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
