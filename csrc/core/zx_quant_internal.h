/* zx_quant_internal.h — what the quantization files of the core share, not part of the API.
 *
 *   zx_quant.c           public entry points: validate, walk blocks in chunks, convert
 *                        dtypes, pack int4, choose each block's scale, dispatch on isa
 *   zx_quant_ref.c       scalar reference chunk kernels (the oracle)  defines: zx_q_*_ref
 *   zx_quant_avx2.c      AVX2 chunk kernels                           defines: zx_q_*_avx2
 *   zx_quant_avx512.c    AVX-512 chunk kernels                        defines: zx_q_*_avx512
 *   zx_quant_simd.inc    the one SIMD body both files instantiate, in the vocabulary
 *                        of zx_simd_avx2.h / zx_simd_avx512.h (the kernels' own)
 *
 * The chunk kernels see fp32 only and never a whole block's logic: the entry points
 * compute the block's amax (zx_q_absmax_*), its scale (zx_quant_block_scale, written
 * once), then encode / decode the block chunk by chunk. Every operation is a
 * correctly rounded IEEE one (div, mul, sub, round-to-nearest-even), so each ISA is
 * bit-identical to the reference (Note [Bit-exact SIMD] in zx_kernels_internal.h).
 */
#ifndef ZX_QUANT_INTERNAL_H
#define ZX_QUANT_INTERNAL_H

#include "zx_kernels_internal.h"

/* Elements converted / encoded at a time in a stack buffer (4 KiB of fp32). */
#define ZX_QUANT_CHUNK 1024

/* Largest |x| of n fp32 values, as the bit pattern of |x| (sign cleared). Bit
 * patterns of non-negative floats order like their values, and NaN patterns lie
 * above +inf's 0x7f800000, so the maximum says "has a NaN/inf" without a branch. */
uint32_t zx_q_absmax_ref(size_t n, const float *x);
/* q[i] = clamp(round_to_nearest_even(x[i] / divisor), -qmax, qmax); when residual is
 * not NULL also residual[i] = x[i] - (float) q[i] * scale. x finite, divisor > 0. */
void zx_q_encode_ref(size_t n, const float *x, float divisor, float qmax, float scale,
                     int8_t *q, float *residual);
/* y[i] = (accumulate ? y[i] + : ) (float) q[i] * scale */
void zx_q_decode_ref(size_t n, const int8_t *q, float scale, float *y, int32_t accumulate);

#if ZX_HAVE_X86_SIMD
#define ZX_DECLARE_QUANT_KERNELS(sfx)                                                  \
    uint32_t zx_q_absmax_##sfx(size_t n, const float *x);                              \
    void zx_q_encode_##sfx(size_t n, const float *x, float divisor, float qmax,        \
                           float scale, int8_t *q, float *residual);                   \
    void zx_q_decode_##sfx(size_t n, const int8_t *q, float scale, float *y,           \
                           int32_t accumulate);
ZX_DECLARE_QUANT_KERNELS(avx2)
ZX_DECLARE_QUANT_KERNELS(avx512)
#undef ZX_DECLARE_QUANT_KERNELS
#endif

#endif /* ZX_QUANT_INTERNAL_H */
