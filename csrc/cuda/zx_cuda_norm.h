/* zx_cuda_norm.h — gradient norm / inf-nan scan and in-place scaling on the GPU
 * (implemented in zx_cuda_norm.cu). */
#ifndef ZX_CUDA_NORM_H
#define ZX_CUDA_NORM_H

#include <stddef.h>

#include "../core/zx_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Fused gradient scan over n device floats, the GPU form of zx_grad_sumsq:
 *   out2[0] += sum of (grad[i]*scale)^2 over the finite grad[i] (squares in double)
 *   out2[1] += count of the non-finite (inf/nan) grad[i]
 * out2 is a device float[2] that the caller zeroes once and may accumulate
 * over several calls (one per bucket slice); it is then the 2-float buffer of
 * the fused all-reduce. Each block sums in double and adds its
 * partial with one float atomicAdd, so the last bit of out2[0] may differ
 * from run to run; out2[1] is exact up to 2^24. */
zx_status zx_cuda_grad_sumsq(size_t n, const float *grad, float scale, float *out2,
                             void *stream);

/* x[i] *= s over n device floats. */
zx_status zx_cuda_scale(size_t n, float *x, float s, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* ZX_CUDA_NORM_H */
