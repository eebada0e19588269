/* zx_scaler_step.h — one step of the loss-scaling state machine (zx_core.h,
 * "loss scaler"), as an inline function that both the C core (zx_scaler.c,
 * on the host) and the CUDA control kernel (csrc/cuda/zx_cuda_control.cu, in
 * device memory, so that a GPU step reads no verdict back to the host)
 * compile: one definition of the rules for both. Returns 1 when the step
 * must be skipped. */
#ifndef ZX_SCALER_STEP_H
#define ZX_SCALER_STEP_H

#include "zx_core.h"

#ifdef __CUDACC__
#define ZX_HOST_DEVICE __host__ __device__
#else
#define ZX_HOST_DEVICE
#endif

static inline ZX_HOST_DEVICE int32_t zx_scaler_step(zx_loss_scaler *s, int32_t found_nonfinite) {
    if (found_nonfinite) s->skipped++;
    if (!s->dynamic) return found_nonfinite ? 1 : 0;
    if (found_nonfinite) {
        s->good_steps = 0;
        if (s->hysteresis_left > 1) {
            s->hysteresis_left--;
        } else {
            double next = s->scale * s->backoff_factor;
            s->scale = next < s->min_scale ? s->min_scale : next;
            s->hysteresis_left = s->hysteresis;
        }
        return 1;
    }
    s->hysteresis_left = s->hysteresis;
    if (++s->good_steps >= s->growth_interval) {
        double next = s->scale * s->growth_factor;
        s->scale = next > s->max_scale ? s->max_scale : next;
        s->good_steps = 0;
    }
    return 0;
}

#endif /* ZX_SCALER_STEP_H */
