/* zx_step_control.h — a step's control scalars, computed where the gradients
 * live: inline functions that the CUDA control kernels
 * (csrc/cuda/zx_cuda_control.cu, one thread) and the CPU kernel table both
 * call, so that a GPU step reads no number back to the host and the CPU runs
 * the very same rules.
 *
 * Note [Step control]
 *   ctl is a double[ZX_CTL_SIZE] in the gradients' memory, owned by the optimizer:
 *     ctl[ZX_CTL_CLIP]   clip factor pending for the next step (1: none);
 *                        clip_grad_norm_ multiplies it by min(1, max/(norm+1e-6))
 *     ctl[ZX_CTL_FOUND]  1 when this step's gradients hold an inf/nan
 *     ctl[ZX_CTL_MULT]   what the step kernels multiply gradients by:
 *                        clip / (N * loss scale), the loss scale before its update
 *     ctl[ZX_CTL_SKIP]   1: the step kernels change nothing (an overflow under
 *                        loss scaling), as torch's fused optimizers do with found_inf
 *   The loss scaler's state is a zx_loss_scaler in that memory too, advanced
 *   by zx_scaler_step (zx_scaler_step.h): the host's rules, run there.
 *   out2 = [sum of squares, inf/nan count] of the reduced gradients as stored
 *   (summed over ranks, loss-scaled), so the true norm is
 *   sqrt(out2[0]) / (divisor * loss scale).
 *   A step: [zx_clip_control] -> zx_step_control -> the optimizer kernels with
 *   ctl and the step counts. */
#ifndef ZX_STEP_CONTROL_H
#define ZX_STEP_CONTROL_H

#include <math.h>

#include "zx_scaler_step.h"  /* defines: zx_scaler_step, ZX_HOST_DEVICE */

#define ZX_CTL_CLIP 0
#define ZX_CTL_FOUND 1
#define ZX_CTL_MULT 2
#define ZX_CTL_SKIP 3
#define ZX_CTL_SIZE 4

/* After clip_grad_norm_'s scan: the norm (+inf when any element is not finite)
 * into *norm_out, ctl[CLIP] *= min(1, max_norm / (norm + 1e-6)), ctl[FOUND].
 * scaler may be NULL (loss scale 1). */
static inline ZX_HOST_DEVICE void zx_clip_control(double *ctl, const float *out2, double divisor,
                                                  const zx_loss_scaler *scaler, double max_norm, float *norm_out) {
    const int found = out2[1] > 0.0f;
    const double loss_scale = scaler != 0 ? scaler->scale : 1.0;
    const double norm = found ? (double)INFINITY : sqrt((double)out2[0]) * (1.0 / (divisor * loss_scale));
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0) ctl[ZX_CTL_CLIP] *= coef;
    ctl[ZX_CTL_FOUND] = found ? 1.0 : 0.0;
    *norm_out = (float)norm;
}

/* At step(): when out2 is not NULL (no clip ran this step) ctl[FOUND] = out2[1] > 0
 * first. ctl[MULT] = ctl[CLIP] / (divisor * loss scale); with a scaler one
 * zx_scaler_step and *scale_out (may be NULL) = the new scale; ctl[SKIP] = the
 * verdict (0 without a scaler); steps[0..n_steps) += 1 unless skipped; then
 * ctl[CLIP] = 1 and ctl[FOUND] = 0 for the next step. */
static inline ZX_HOST_DEVICE void zx_step_control(double *ctl, const float *out2, double divisor,
                                                  zx_loss_scaler *scaler, float *scale_out, int64_t *steps,
                                                  int32_t n_steps) {
    if (out2 != 0) ctl[ZX_CTL_FOUND] = out2[1] > 0.0f ? 1.0 : 0.0;
    const double loss_scale = scaler != 0 ? scaler->scale : 1.0;
    ctl[ZX_CTL_MULT] = ctl[ZX_CTL_CLIP] * (1.0 / (divisor * loss_scale));
    int32_t skip = 0;
    if (scaler != 0) {
        skip = zx_scaler_step(scaler, ctl[ZX_CTL_FOUND] != 0.0 ? 1 : 0);
        if (scale_out != 0) *scale_out = (float)scaler->scale;
    }
    ctl[ZX_CTL_SKIP] = skip ? 1.0 : 0.0;
    if (!skip) {
        for (int32_t i = 0; i < n_steps; i++) steps[i] += 1;
    }
    ctl[ZX_CTL_CLIP] = 1.0;
    ctl[ZX_CTL_FOUND] = 0.0;
}

#endif /* ZX_STEP_CONTROL_H */
