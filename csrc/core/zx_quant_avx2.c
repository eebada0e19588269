/* zx_quant_avx2.c — AVX2 chunk kernels of the blockwise quantization, 8 fp32 lanes.
 *
 * Each function enables the ISA with a target attribute; zx_quant.c calls here only
 * after zx_cpu_supports(ZX_ISA_AVX2). The encode/decode bodies come from
 * zx_quant_simd.inc, in the vocabulary the kernels use too (zx_simd_avx2.h); the amax
 * scan is AVX2-specific.
 */
#include "zx_quant_internal.h"

#if ZX_HAVE_X86_SIMD
#include "zx_simd_avx2.h"     /* defines: vec, vec_*, ZX_SIMD_TARGET, ZX_SIMD_NAME */
#include "zx_quant_simd.inc"  /* defines: zx_q_encode_avx2, zx_q_decode_avx2 */

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
