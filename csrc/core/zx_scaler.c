/* zx_scaler.c — the dynamic loss-scaling state machine (see zx_core.h). */
#include <math.h>

#include "zx_core.h"
#include "zx_scaler_step.h"   /* defines: zx_scaler_step */

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
    *skip = zx_scaler_step(s, found_nonfinite ? 1 : 0);
    return ZX_OK;
}
