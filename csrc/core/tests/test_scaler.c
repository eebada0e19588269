/* test_scaler.c — the loss-scaling state machine against a transcript written
 * out by hand from its specification (zx_core.h), its argument checks, and the
 * step control built on it (zx_step_control.h).
 * Run: make -C csrc/core test (under AddressSanitizer + UBSan). */
#include "../zx_core.h"
#include "../zx_step_control.h"

#include <math.h>
#include <stdio.h>

#include "check.h"

static zx_loss_scaler make(double scale, int64_t interval, int64_t hysteresis, int dynamic) {
    zx_loss_scaler s = {0};
    s.scale = scale;
    s.growth_factor = 2.0;
    s.backoff_factor = 0.5;
    s.min_scale = 1.0;
    s.max_scale = 1 << 24;
    s.growth_interval = interval;
    s.hysteresis = hysteresis;
    s.dynamic = dynamic;
    return s;
}

/* overflow pattern -> expected (skip, scale after) per step */
static void transcript(void) {
    zx_loss_scaler s = make(1024.0, 3, 2, 1);
    CHECK(zx_scaler_init(&s) == ZX_OK, "init");
    const int overflow[] = {0, 0, 0, 1, 1, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0};
    const int skip_want[] = {0, 0, 0, 1, 1, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0};
    /* 3 good steps grow 1024 -> 2048; the first overflow is absorbed by
     * hysteresis, the second halves; a good step refills hysteresis; ... */
    const double scale_want[] = {1024, 1024, 2048, 2048, 1024, 1024, 1024, 1024, 1024, 512, 512, 256,
                                 256, 256, 512};
    for (int i = 0; i < 15; i++) {
        int32_t skip = -1;
        CHECK(zx_scaler_update(&s, overflow[i], &skip) == ZX_OK, "update %d", i);
        CHECK(skip == skip_want[i], "step %d: skip %d, want %d", i, skip, skip_want[i]);
        CHECK(s.scale == scale_want[i], "step %d: scale %g, want %g", i, s.scale, scale_want[i]);
    }
    CHECK(s.skipped == 7, "skipped %lld", (long long)s.skipped);
}

static void bounds(void) {
    zx_loss_scaler s = make(2.0, 1, 1, 1);
    CHECK(zx_scaler_init(&s) == ZX_OK, "init");
    int32_t skip;
    for (int i = 0; i < 5; i++) zx_scaler_update(&s, 1, &skip);
    CHECK(s.scale == 1.0, "min_scale floor: %g", s.scale);
    s.max_scale = 8.0;
    for (int i = 0; i < 10; i++) zx_scaler_update(&s, 0, &skip);
    CHECK(s.scale == 8.0, "max_scale cap: %g", s.scale);
    zx_loss_scaler st = make(128.0, 1, 1, 0);
    CHECK(zx_scaler_init(&st) == ZX_OK, "static init");
    zx_scaler_update(&st, 1, &skip);
    CHECK(skip == 1 && st.scale == 128.0, "static: skip %d scale %g", skip, st.scale);
    zx_scaler_update(&st, 0, &skip);
    CHECK(skip == 0 && st.scale == 128.0, "static: skip %d scale %g", skip, st.scale);
}

static void bad_args(void) {
    zx_loss_scaler s = make(0.0, 1, 1, 1);
    CHECK(zx_scaler_init(&s) == ZX_ERR_INVALID_ARG, "scale 0");
    s = make(16.0, 0, 1, 1);
    CHECK(zx_scaler_init(&s) == ZX_ERR_INVALID_ARG, "interval 0");
    s = make(16.0, 1, 0, 1);
    CHECK(zx_scaler_init(&s) == ZX_ERR_INVALID_ARG, "hysteresis 0");
    s = make(16.0, 1, 1, 1);
    s.backoff_factor = 1.0;
    CHECK(zx_scaler_init(&s) == ZX_ERR_INVALID_ARG, "backoff 1");
    s = make(16.0, 1, 1, 1);
    s.growth_factor = 1.0;
    CHECK(zx_scaler_init(&s) == ZX_ERR_INVALID_ARG, "growth 1");
    s = make(0.5, 1, 1, 1);
    CHECK(zx_scaler_init(&s) == ZX_ERR_INVALID_ARG, "below min_scale");
    int32_t skip;
    CHECK(zx_scaler_update(NULL, 0, &skip) == ZX_ERR_INVALID_ARG, "NULL scaler");
    CHECK(zx_scaler_init(NULL) == ZX_ERR_INVALID_ARG, "NULL init");
}

/* The step control (zx_step_control.h): clip factor, multiplier, verdict, counts. */
static void step_control(void) {
    zx_loss_scaler s = make(1024.0, 2, 1, 1);
    CHECK(zx_scaler_init(&s) == ZX_OK, "init");
    double ctl[ZX_CTL_SIZE] = {1.0, 0.0, 0.0, 0.0};
    int64_t steps[2] = {0, 0};
    float scale_out = 0.0f, norm = 0.0f;
    /* clip: sumsq 4 * 1024^2 * 3^2 over divisor 3 -> norm 2 (unscaled), max 1 -> coef ~0.5 */
    float out2[2] = {(float)(4.0 * 1024.0 * 1024.0 * 9.0), 0.0f};
    zx_clip_control(ctl, out2, 3.0, &s, 1.0, &norm);
    CHECK(norm == 2.0f, "norm %g", norm);
    CHECK(ctl[ZX_CTL_CLIP] == 1.0 / (2.0 + 1e-6) && ctl[ZX_CTL_FOUND] == 0.0, "clip %g found %g", ctl[ZX_CTL_CLIP],
          ctl[ZX_CTL_FOUND]);
    zx_step_control(ctl, NULL, 3.0, &s, &scale_out, steps, 2);
    CHECK(ctl[ZX_CTL_MULT] == (1.0 / (2.0 + 1e-6)) * (1.0 / (3.0 * 1024.0)), "mult %g", ctl[ZX_CTL_MULT]);
    CHECK(ctl[ZX_CTL_SKIP] == 0.0 && steps[0] == 1 && steps[1] == 1, "a good step counts");
    CHECK(ctl[ZX_CTL_CLIP] == 1.0 && ctl[ZX_CTL_FOUND] == 0.0, "reset for the next step");
    CHECK(scale_out == 1024.0f, "scale %g", scale_out);
    /* overflow found by the step's own scan: skipped, counts kept, scale halved */
    out2[0] = 1.0f;
    out2[1] = 3.0f;
    zx_step_control(ctl, out2, 3.0, &s, &scale_out, steps, 2);
    CHECK(ctl[ZX_CTL_SKIP] == 1.0 && steps[0] == 1 && s.skipped == 1, "overflow skips");
    CHECK(scale_out == 512.0f && s.scale == 512.0, "backoff %g", scale_out);
    /* clip_control saw the overflow: inf norm, the verdict carried to the step */
    zx_clip_control(ctl, out2, 3.0, &s, 1.0, &norm);
    /* as the host path and torch: max_norm / inf = 0 (the step is skipped anyway) */
    CHECK(isinf(norm) && ctl[ZX_CTL_FOUND] == 1.0 && ctl[ZX_CTL_CLIP] == 0.0, "inf norm, clip factor 0");
    zx_step_control(ctl, NULL, 3.0, &s, NULL, steps, 2);
    CHECK(ctl[ZX_CTL_SKIP] == 1.0 && steps[1] == 1, "verdict from clip_control");
    /* no scaler: never skips, multiplier 1/divisor */
    zx_step_control(ctl, NULL, 4.0, NULL, NULL, steps, 1);
    CHECK(ctl[ZX_CTL_SKIP] == 0.0 && ctl[ZX_CTL_MULT] == 0.25 && steps[0] == 2 && steps[1] == 1, "no scaler");
}

int main(void) {
    transcript();
    bounds();
    bad_args();
    step_control();
    printf("test_scaler: %ld checks passed, %ld failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
