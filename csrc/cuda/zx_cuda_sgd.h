/* zx_cuda_sgd.h — SGD (momentum, dampening, Nesterov) step on the GPU
 * (implemented in zx_cuda_sgd.cu). */
#ifndef ZX_CUDA_SGD_H
#define ZX_CUDA_SGD_H

#include <stddef.h>

#include "../core/zx_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One SGD step over n elements of device arrays, the same maths as zx_sgd_step:
 *   param         (n,) fp32, read and written
 *   grad          (n,) fp32, read (times hp->grad_scale)
 *   momentum_buf  (n,) fp32, required iff hp->momentum != 0; written from d_p
 *                 when hp->first_step (torch's clone), else updated
 *   param_lp      (n,) lp_dtype (ZX_BF16/ZX_F16) or NULL: receives the updated param
 *   device_step   NULL, or the step count in device memory (after this step's
 *                 increment): the first step is *device_step == 1, not hp->first_step
 *   ctl           NULL, or the step control (Note [Step control], ../core/zx_step_control.h):
 *                 skip when ctl[ZX_CTL_SKIP] != 0, ctl[ZX_CTL_MULT] replaces hp->grad_scale
 *   stream        cudaStream_t as void*
 * Arrays must not overlap. Returns ZX_ERR_INVALID_ARG on NULL pointers (n > 0),
 * a missing momentum buffer or a bad lp_dtype; a CUDA launch error as a status. */
zx_status zx_cuda_sgd_step(size_t n, float *param, const float *grad, float *momentum_buf,
                           void *param_lp, zx_dtype lp_dtype, const zx_sgd_hparams *hp,
                           const int64_t *device_step, const double *ctl, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* ZX_CUDA_SGD_H */
