/* zx_cuda_adam.h — Adam/AdamW step on the GPU (implemented in zx_cuda_adam.cu). */
#ifndef ZX_CUDA_ADAM_H
#define ZX_CUDA_ADAM_H

#include <stddef.h>
#include <stdint.h>

#include "../core/zx_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One Adam/AdamW step over n elements of device arrays, the same maths as
 * zx_adam_step (zx_core.h), in one pass:
 *   param, exp_avg, exp_avg_sq        (n,) fp32, read and written
 *   grad                              (n,) fp32, read (times hp->grad_scale)
 *   max_exp_avg_sq                    (n,) fp32, required iff hp->amsgrad, else ignored
 *   param_lp                          (n,) lp_dtype (ZX_BF16/ZX_F16) or NULL: receives the
 *                                     updated param, round to nearest even
 *   device_step                       NULL: the step count is hp->step (host value; bias
 *                                     corrections computed here once). Non-NULL: a device
 *                                     int64 holding the step count after this step's
 *                                     increment, read by the kernel, which then computes the
 *                                     bias corrections itself; hp->step is ignored. Use with
 *                                     zx_cuda_increment_step so a whole step can be captured
 *                                     in a CUDA graph and replayed.
 *   ctl                               NULL, or the step control in device memory (Note
 *                                     [Step control], ../core/zx_step_control.h): the kernel
 *                                     changes nothing when ctl[ZX_CTL_SKIP] != 0 and
 *                                     multiplies gradients by ctl[ZX_CTL_MULT] in place of
 *                                     hp->grad_scale
 *   stream                            cudaStream_t as void*
 * Any alignment works (float4 body when the arrays allow it, see
 * Note [Vector and scalar paths] in zx_cuda_common.cuh). Arrays must not overlap.
 * Returns ZX_ERR_INVALID_ARG for NULL pointers (n > 0), a missing max_exp_avg_sq,
 * a bad lp_dtype or hp->step < 1 (host step); a CUDA launch error as a status. */
zx_status zx_cuda_adam_step(size_t n, float *param, const float *grad, float *exp_avg,
                            float *exp_avg_sq, float *max_exp_avg_sq, void *param_lp,
                            zx_dtype lp_dtype, const zx_adam_hparams *hp,
                            const int64_t *device_step, const double *ctl, void *stream);

/* *device_step += 1, on the stream (one thread). */
zx_status zx_cuda_increment_step(int64_t *device_step, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* ZX_CUDA_ADAM_H */
