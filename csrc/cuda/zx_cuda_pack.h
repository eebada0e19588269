/* zx_cuda_pack.h — slice reduction and dtype casts on the GPU
 * (implemented in zx_cuda_pack.cu). */
#ifndef ZX_CUDA_PACK_H
#define ZX_CUDA_PACK_H

#include <stddef.h>
#include <stdint.h>

#include "../core/zx_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The GPU form of zx_sum_slices: src is nslices*slice_n device floats (slice j
 * at src + j*slice_n), dst slice_n device floats:
 *   dst[i] = (accumulate ? dst[i] : 0) + scale * sum_j src[j*slice_n + i]
 * summing j in increasing order. dst may alias slice 0 of src only when
 * accumulate is 0. nslices >= 1. */
zx_status zx_cuda_sum_slices(size_t slice_n, int32_t nslices, const float *src, float *dst,
                             int32_t accumulate, float scale, void *stream);

/* dst[i] = (dst_dtype) src[i], round to nearest even; dst_dtype BF16 or F16
 * (F32 is a plain copy). */
zx_status zx_cuda_cast_from_f32(size_t n, const float *src, void *dst, zx_dtype dst_dtype,
                                void *stream);

/* dst[i] = (float) src[i] for a BF16/F16/F32 source. */
zx_status zx_cuda_cast_to_f32(size_t n, const void *src, zx_dtype src_dtype, float *dst,
                              void *stream);

#ifdef __cplusplus
}
#endif
#endif /* ZX_CUDA_PACK_H */
