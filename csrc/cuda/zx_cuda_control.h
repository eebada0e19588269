/* zx_cuda_control.h — the step's control scalars on the device (Note [Step
 * control] in ../core/zx_step_control.h; implemented in zx_cuda_control.cu):
 * zx_clip_control and zx_step_control run by one thread on the stream, so
 * that clipping, overflow skipping and loss-scale updates need no host
 * synchronization. Pointers are device pointers; scaler, out2 (step control)
 * and scale_out may be NULL. */
#ifndef ZX_CUDA_CONTROL_H
#define ZX_CUDA_CONTROL_H

#include <stddef.h>
#include <stdint.h>

#include "../core/zx_core.h"
#include "../core/zx_step_control.h"  /* defines: ZX_CTL_* */

#ifdef __cplusplus
extern "C" {
#endif

zx_status zx_cuda_clip_control(double *ctl, const float *out2, double divisor, const zx_loss_scaler *scaler,
                               double max_norm, float *norm_out, void *stream);

zx_status zx_cuda_step_control(double *ctl, const float *out2, double divisor, zx_loss_scaler *scaler,
                               float *scale_out, int64_t *steps, int32_t n_steps, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* ZX_CUDA_CONTROL_H */
