/* zx_cuda_quant.h — blockwise int8/int4 quantization on the GPU
 * (implemented in zx_cuda_quant.cu). The same formats and the same maths as the CPU
 * entry points of ../core/zx_core.h (zx_quantize, zx_dequantize, zx_dequantize_sum;
 * Note [Blockwise quantization] in ../core/zx_quant.c): codes, scales, residuals and
 * outputs are bit-identical to the CPU scalar reference. Pointers are device
 * pointers; stream is a cudaStream_t as void* (NULL: the legacy default stream). */
#ifndef ZX_CUDA_QUANT_H
#define ZX_CUDA_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "../core/zx_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* zx_quantize on the GPU: n elements of src (F32/BF16/F16) -> q
 * (zx_quant_bytes bytes) and scales (zx_quant_blocks floats); residual NULL or n
 * fp32 values of error feedback. */
zx_status zx_cuda_quantize(int32_t bits, size_t block_numel, size_t n, const void *src,
                           zx_dtype src_dtype, float *residual, void *q, float *scales,
                           void *stream);

/* zx_dequantize on the GPU: dst (F32/BF16/F16, n elements) = code * scale. */
zx_status zx_cuda_dequantize(int32_t bits, size_t block_numel, size_t n, const void *q,
                             const float *scales, void *dst, zx_dtype dst_dtype, void *stream);

/* zx_dequantize_sum on the GPU: dst (n fp32) = (accumulate ? dst : 0) + scale *
 * sum_j dequantized slice j, slice j's payload starting slice_blocks blocks after
 * slice j-1's. */
zx_status zx_cuda_dequantize_sum(int32_t bits, size_t block_numel, size_t n, int32_t nslices,
                                 size_t slice_blocks, const void *q, const float *scales,
                                 float *dst, int32_t accumulate, float scale, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* ZX_CUDA_QUANT_H */
