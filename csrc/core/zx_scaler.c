/* zx_scaler.c — the dynamic loss-scaling state machine (see zx_core.h). */
#include <math.h>

#include "zx_core.h"

zx_status zx_scaler_init(zx_loss_scaler *s) {
    if (!s) return ZX_ERR_INVALID_ARG;
    if (!(s->scale > 0.0) || !isfinite(s->scale)) return ZX_ERR_INVALID_ARG;
    if (!(s->min_scale > 0.0) || !(s->max_scale >= s->min_scale)) return ZX_ERR_INVALID_ARG;
    if (s->scale < s->min_scale || s->scale > s->max_scale) return ZX_ERR_INVALID_ARG;
    if (s->dynamic) {
        if (!(s->growth_factor > 1.0) || !isfinite(s->growth_factor)) return ZX_ERR_INVALID_ARG;
        if (!(s->backoff_factor > 0.0 && s->backoff_factor < 1.0)) return ZX_ERR_INVALID_ARG;
        if (s->growth_interval < 1 || s->hysteresis < 1) return ZX_ERR_INVALID_ARG;
    }
    s->good_steps = 0;
    s->hysteresis_left = s->hysteresis > 0 ? s->hysteresis : 1;
    s->skipped = 0;
    return ZX_OK;
}

zx_status zx_scaler_update(zx_loss_scaler *s, int32_t found_nonfinite, int32_t *skip) {
    if (!s || !skip) return ZX_ERR_INVALID_ARG;
    *skip = found_nonfinite ? 1 : 0;
    if (found_nonfinite) s->skipped++;
    if (!s->dynamic) return ZX_OK;
    if (found_nonfinite) {
        s->good_steps = 0;
        if (s->hysteresis_left > 1) {
            s->hysteresis_left--;
        } else {
            double next = s->scale * s->backoff_factor;
            s->scale = next < s->min_scale ? s->min_scale : next;
            s->hysteresis_left = s->hysteresis;
        }
        return ZX_OK;
    }
    s->hysteresis_left = s->hysteresis;
    if (++s->good_steps >= s->growth_interval) {
        double next = s->scale * s->growth_factor;
        s->scale = next > s->max_scale ? s->max_scale : next;
        s->good_steps = 0;
    }
    return ZX_OK;
}
