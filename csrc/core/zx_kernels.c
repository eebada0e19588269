/* zx_kernels.c — the public CPU kernel entry points of zx_core.h.
 *
 * Each entry point (1) validates its arguments and returns a zx_status (never
 * exits), (2) turns the double hyperparameters into the fp32 scalars torch.optim
 * would use, once per call (zx_*_consts), and (3) dispatches on the caller's isa
 * to the reference (zx_kernels_ref.c) or a SIMD kernel (zx_kernels_avx2.c,
 * zx_kernels_avx512.c). n == 0 is a valid no-op; pointers may then be NULL.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "zx_kernels_internal.h"

/* ------------------------------------------------------------------ dispatch */

static zx_status check_isa(zx_isa isa) {
    return zx_cpu_supports(isa) ? ZX_OK : ZX_ERR_UNSUPPORTED;
}

static void adam_isa(zx_isa isa, size_t n, float *param, const float *grad, float *m,
                     float *v, float *v_max, const zx_adam_consts *c) {
    switch (isa) {
#if ZX_HAVE_X86_SIMD
    case ZX_ISA_AVX512: zx_adam_avx512(n, param, grad, m, v, v_max, c); return;
    case ZX_ISA_AVX2: zx_adam_avx2(n, param, grad, m, v, v_max, c); return;
#endif
    default: zx_adam_ref(n, param, grad, m, v, v_max, c); return;
    }
}

static void sgd_isa(zx_isa isa, size_t n, float *param, const float *grad, float *buf,
                    const zx_sgd_consts *c) {
    switch (isa) {
#if ZX_HAVE_X86_SIMD
    case ZX_ISA_AVX512: zx_sgd_avx512(n, param, grad, buf, c); return;
    case ZX_ISA_AVX2: zx_sgd_avx2(n, param, grad, buf, c); return;
#endif
    default: zx_sgd_ref(n, param, grad, buf, c); return;
    }
}

/* dtype is ZX_BF16 or ZX_F16; stream: Note [Streaming copy-out] (zx_kernels_avx512.c) */
static void cast_from_f32_isa(zx_isa isa, size_t n, const float *src, void *dst,
                              zx_dtype dtype, int stream) {
    switch (isa) {
#if ZX_HAVE_X86_SIMD
    case ZX_ISA_AVX512: zx_cast_from_f32_avx512(n, src, dst, dtype, stream); return;
    case ZX_ISA_AVX2: zx_cast_from_f32_avx2(n, src, dst, dtype, stream); return;
#endif
    default: zx_cast_from_f32_ref(n, src, dst, dtype); return;
    }
}

static int is_lp_dtype(zx_dtype d) { return d == ZX_BF16 || d == ZX_F16; }

/* x >= 0, false for NaN */
static int nonneg(double x) { return x >= 0.0; }

/* ------------------------------------------------------------------ Adam */

static zx_adam_consts adam_consts(const zx_adam_hparams *hp) {
    zx_adam_consts c;
    memset(&c, 0, sizeof c);
    /* grad = grad * grad_scale, negated for maximize (sign flips are exact) */
    c.grad_scale = hp->maximize ? -hp->grad_scale : hp->grad_scale;
    /* torch applies weight decay only when weight_decay != 0 */
    c.decoupled = hp->weight_decay != 0.0 && hp->decoupled;
    c.l2 = hp->weight_decay != 0.0 && !hp->decoupled;
    c.weight_decay = (float)hp->weight_decay;
    c.decay_factor = (float)(1.0 - hp->lr * hp->weight_decay);
    /* exp_avg.lerp_(grad, 1 - beta1): ATen picks its formula by the weight */
    float w = (float)(1.0 - hp->beta1);
    c.lerp_from_grad = !(w < 0.5f);
    c.lerp_coeff = w < 0.5f ? w : w - 1.0f;
    c.beta2 = (float)hp->beta2;
    c.one_minus_beta2 = (float)(1.0 - hp->beta2);
    /* bias corrections in double, as Python computes them */
    double step = (double)hp->step;
    double bias_correction1 = 1.0 - pow(hp->beta1, step);
    double bias_correction2 = 1.0 - pow(hp->beta2, step);
    double step_size = hp->lr / bias_correction1;
    c.bc2_sqrt = (float)pow(bias_correction2, 0.5);
    c.eps = (float)hp->eps;
    c.neg_step_size = (float)(-step_size);
    c.amsgrad = hp->amsgrad != 0;
    return c;
}

zx_status zx_adam_step(zx_isa isa, size_t n, float *param, const float *grad,
                       float *exp_avg, float *exp_avg_sq, float *max_exp_avg_sq,
                       void *param_lp, zx_dtype lp_dtype, const zx_adam_hparams *hp) {
    if (!hp) return ZX_ERR_INVALID_ARG;
    if (hp->step < 1 || !nonneg(hp->lr) || !nonneg(hp->eps) || !nonneg(hp->weight_decay) ||
        !(hp->beta1 >= 0.0 && hp->beta1 < 1.0) || !(hp->beta2 >= 0.0 && hp->beta2 < 1.0))
        return ZX_ERR_INVALID_ARG;
    if (param_lp && !is_lp_dtype(lp_dtype)) return ZX_ERR_INVALID_ARG;
    zx_status s = check_isa(isa);
    if (s != ZX_OK) return s;
    if (n == 0) return ZX_OK;
    if (!param || !grad || !exp_avg || !exp_avg_sq) return ZX_ERR_INVALID_ARG;
    if (hp->amsgrad && !max_exp_avg_sq) return ZX_ERR_INVALID_ARG;

    zx_adam_consts c = adam_consts(hp);
    float *v_max = c.amsgrad ? max_exp_avg_sq : NULL;
    if (!param_lp) {
        adam_isa(isa, n, param, grad, exp_avg, exp_avg_sq, v_max, &c);
        return ZX_OK;
    }
    uint16_t *lp = (uint16_t *)param_lp;
#if ZX_HAVE_X86_SIMD
    /* The SIMD bodies write the copy from registers (zx_adam_lp_*): one pass. */
    if (isa == ZX_ISA_AVX512) {
        zx_adam_lp_avx512(n, param, grad, exp_avg, exp_avg_sq, v_max, &c, lp, lp_dtype);
        return ZX_OK;
    }
    if (isa == ZX_ISA_AVX2) {
        zx_adam_lp_avx2(n, param, grad, exp_avg, exp_avg_sq, v_max, &c, lp, lp_dtype);
        return ZX_OK;
    }
#endif
    /* Note [Low-precision copy-out in blocks] */
    for (size_t off = 0; off < n; off += ZX_LP_BLOCK_NUMEL) {
        size_t len = n - off < ZX_LP_BLOCK_NUMEL ? n - off : ZX_LP_BLOCK_NUMEL;
        adam_isa(isa, len, param + off, grad + off, exp_avg + off, exp_avg_sq + off,
                 v_max ? v_max + off : NULL, &c);
        cast_from_f32_isa(isa, len, param + off, lp + off, lp_dtype, 1);
    }
    return ZX_OK;
}

/* A split-master call's stepped run [lead, lead + n) lies in [0, total) and ends in its last
 * tie byte (Note [Fused split-master step]). */
static int split_run_ok(size_t total, size_t lead, size_t n) {
    return lead <= total && n <= total - lead && total - lead - n < 8;
}

/* Bytes [from, to) of a split-master call (to: at most the call's total), through an
 * 8-element buffer: join, the reference step on the elements of [lead, end) among them,
 * their bf16 rounding into hi, split. */
static void adam_split_ref(size_t from, size_t to, size_t lead, size_t end, uint16_t *hi, int16_t *rem,
                           uint8_t *ties, const float *grad, float *exp_avg, float *exp_avg_sq,
                           float *max_exp_avg_sq, const zx_adam_consts *c) {
    float buf[8];
    for (size_t a = from; a < to; a += 8) {
        const size_t len = to - a < 8 ? to - a : 8;
        const size_t s = a > lead ? a : lead, e = a + len < end ? a + len : end;
        zx_master_join(ZX_ISA_SCALAR, len, hi + a, rem + a, ties + a / 8, buf);
        if (e > s) {
            const size_t j = s - lead;
            zx_adam_ref(e - s, buf + (s - a), grad + j, exp_avg + j, exp_avg_sq + j,
                        c->amsgrad ? max_exp_avg_sq + j : NULL, c);
            for (size_t i = s; i < e; i++) hi[i] = zx_f32_to_bf16_ref(buf[i - a]);
        }
        zx_master_split(ZX_ISA_SCALAR, len, buf, hi + a, rem + a, ties + a / 8);
    }
}

/* Note [Fused split-master step]: the bytes that [lead, lead + n) covers in part go through
 * the buffer, the whole vectors between them through the ISA's body. */
zx_status zx_adam_step_split(zx_isa isa, size_t total, size_t lead, size_t n, uint16_t *hi, int16_t *rem,
                             uint8_t *ties, const float *grad, float *exp_avg, float *exp_avg_sq,
                             float *max_exp_avg_sq, const zx_adam_hparams *hp) {
    zx_status s = zx_adam_step(isa, 0, NULL, NULL, NULL, NULL, NULL, NULL, ZX_BF16, hp);   /* hp and isa checks */
    if (s != ZX_OK) return s;
    if (!split_run_ok(total, lead, n)) return ZX_ERR_INVALID_ARG;
    if (n == 0) return ZX_OK;
    if (!hi || !rem || !ties || !grad || !exp_avg || !exp_avg_sq) return ZX_ERR_INVALID_ARG;
    if (hp->amsgrad && !max_exp_avg_sq) return ZX_ERR_INVALID_ARG;

    const zx_adam_consts c = adam_consts(hp);
    float *v_max = c.amsgrad ? max_exp_avg_sq : NULL;
    const size_t end = lead + n;
    const size_t up = (lead + 7) & ~(size_t)7, body = up < total ? up : total;   /* the first byte stepped whole */
    adam_split_ref(0, body, lead, end, hi, rem, ties, grad, exp_avg, exp_avg_sq, v_max, &c);
    size_t done = body;
#if ZX_HAVE_X86_SIMD
    if (body < end) {
        const size_t j = body - lead, len = end - body;
        if (isa == ZX_ISA_AVX512)
            done += zx_adam_split_avx512(len, hi + body, rem + body, ties + body / 8, grad + j, exp_avg + j,
                                         exp_avg_sq + j, v_max ? v_max + j : NULL, &c);
        else if (isa == ZX_ISA_AVX2)
            done += zx_adam_split_avx2(len, hi + body, rem + body, ties + body / 8, grad + j, exp_avg + j,
                                       exp_avg_sq + j, v_max ? v_max + j : NULL, &c);
    }
#endif
    adam_split_ref(done, total, lead, end, hi, rem, ties, grad, exp_avg, exp_avg_sq, v_max, &c);
    return ZX_OK;
}

/* Note [Counter-based stochastic rounding] (zx_sr.h); the maths is zx_adam_step's. */
zx_status zx_adam_step_bf16_states(zx_isa isa, size_t n, float *param, const float *grad,
                                   uint16_t *exp_avg, uint16_t *exp_avg_sq,
                                   void *param_lp, zx_dtype lp_dtype,
                                   const zx_adam_hparams *hp, uint64_t seed, uint64_t offset) {
    if (!hp) return ZX_ERR_INVALID_ARG;
    if (hp->step < 1 || !nonneg(hp->lr) || !nonneg(hp->eps) || !nonneg(hp->weight_decay) ||
        !(hp->beta1 >= 0.0 && hp->beta1 < 1.0) || !(hp->beta2 >= 0.0 && hp->beta2 < 1.0))
        return ZX_ERR_INVALID_ARG;
    if (hp->amsgrad) return ZX_ERR_UNSUPPORTED;   /* no bf16 max_exp_avg_sq */
    if (param_lp && !is_lp_dtype(lp_dtype)) return ZX_ERR_INVALID_ARG;
    zx_status s = check_isa(isa);
    if (s != ZX_OK) return s;
    if (n == 0) return ZX_OK;
    if (!param || !grad || !exp_avg || !exp_avg_sq) return ZX_ERR_INVALID_ARG;

    zx_adam_consts c = adam_consts(hp);
    zx_sr_key key = zx_sr_key_of(seed);
    uint16_t *lp = (uint16_t *)param_lp;
    switch (isa) {
#if ZX_HAVE_X86_SIMD
    case ZX_ISA_AVX512:
        zx_adam_bf16s_avx512(n, param, grad, exp_avg, exp_avg_sq, &c, key, offset, lp, lp_dtype);
        break;
    case ZX_ISA_AVX2:
        zx_adam_bf16s_avx2(n, param, grad, exp_avg, exp_avg_sq, &c, key, offset, lp, lp_dtype);
        break;
#endif
    default:
        zx_adam_bf16s_ref(n, param, grad, exp_avg, exp_avg_sq, &c, key, offset, lp, lp_dtype);
        break;
    }
    return ZX_OK;
}

/* ------------------------------------------------------------------ SGD */

static zx_sgd_consts sgd_consts(const zx_sgd_hparams *hp) {
    zx_sgd_consts c;
    memset(&c, 0, sizeof c);
    c.grad_scale = hp->maximize ? -hp->grad_scale : hp->grad_scale;
    c.l2 = hp->weight_decay != 0.0;
    c.weight_decay = (float)hp->weight_decay;
    c.use_momentum = hp->momentum != 0.0;
    c.first_step = hp->first_step != 0;
    c.momentum = (float)hp->momentum;
    c.one_minus_dampening = (float)(1.0 - hp->dampening);
    c.nesterov = hp->nesterov != 0;
    c.neg_lr = (float)(-hp->lr);
    return c;
}

zx_status zx_sgd_step(zx_isa isa, size_t n, float *param, const float *grad,
                      float *momentum_buf, void *param_lp, zx_dtype lp_dtype,
                      const zx_sgd_hparams *hp) {
    if (!hp) return ZX_ERR_INVALID_ARG;
    if (!nonneg(hp->lr) || !nonneg(hp->momentum) || !nonneg(hp->weight_decay) ||
        !isfinite(hp->dampening))
        return ZX_ERR_INVALID_ARG;
    /* torch: "Nesterov momentum requires a momentum and zero dampening" */
    if (hp->nesterov && (hp->momentum <= 0.0 || hp->dampening != 0.0))
        return ZX_ERR_INVALID_ARG;
    if (param_lp && !is_lp_dtype(lp_dtype)) return ZX_ERR_INVALID_ARG;
    zx_status s = check_isa(isa);
    if (s != ZX_OK) return s;
    if (n == 0) return ZX_OK;
    if (!param || !grad) return ZX_ERR_INVALID_ARG;
    if (hp->momentum != 0.0 && !momentum_buf) return ZX_ERR_INVALID_ARG;

    zx_sgd_consts c = sgd_consts(hp);
    float *buf = c.use_momentum ? momentum_buf : NULL;
    if (!param_lp) {
        sgd_isa(isa, n, param, grad, buf, &c);
        return ZX_OK;
    }
    /* Note [Low-precision copy-out in blocks] */
    uint16_t *lp = (uint16_t *)param_lp;
    for (size_t off = 0; off < n; off += ZX_LP_BLOCK_NUMEL) {
        size_t len = n - off < ZX_LP_BLOCK_NUMEL ? n - off : ZX_LP_BLOCK_NUMEL;
        sgd_isa(isa, len, param + off, grad + off, buf ? buf + off : NULL, &c);
        cast_from_f32_isa(isa, len, param + off, lp + off, lp_dtype, 1);
    }
    return ZX_OK;
}

/* ------------------------------------------------------------------ scans, reductions, casts */

zx_status zx_grad_sumsq(zx_isa isa, size_t n, const float *grad, float scale,
                        double *sumsq, int64_t *nonfinite) {
    if (!sumsq || !nonfinite) return ZX_ERR_INVALID_ARG;
    zx_status s = check_isa(isa);
    if (s != ZX_OK) return s;
    if (n == 0) return ZX_OK;
    if (!grad) return ZX_ERR_INVALID_ARG;
    switch (isa) {
#if ZX_HAVE_X86_SIMD
    case ZX_ISA_AVX512: zx_grad_sumsq_avx512(n, grad, scale, sumsq, nonfinite); break;
    case ZX_ISA_AVX2: zx_grad_sumsq_avx2(n, grad, scale, sumsq, nonfinite); break;
#endif
    default: zx_grad_sumsq_ref(n, grad, scale, sumsq, nonfinite); break;
    }
    return ZX_OK;
}

/* The arguments zx_sum_slices and zx_sum_slices16 share (src's elements elem bytes each);
   *run = 0: nothing to sum. dst may be src's slice 0 only where in_place allows it. */
static zx_status check_slices(zx_isa isa, size_t slice_n, int32_t nslices, const void *src, size_t elem,
                              const float *dst, int in_place, int *run) {
    *run = 0;
    if (nslices < 1) return ZX_ERR_INVALID_ARG;
    zx_status s = check_isa(isa);
    if (s != ZX_OK) return s;
    if (slice_n == 0) return ZX_OK;
    if (!src || !dst) return ZX_ERR_INVALID_ARG;
    if (slice_n > SIZE_MAX / sizeof(float) / (size_t)nslices) return ZX_ERR_OVERFLOW;
    uintptr_t s0 = (uintptr_t)src, s1 = s0 + slice_n * (size_t)nslices * elem;
    uintptr_t d0 = (uintptr_t)dst, d1 = (uintptr_t)(dst + slice_n);
    if (d0 < s1 && s0 < d1 && !(in_place && d0 == s0)) return ZX_ERR_INVALID_ARG;
    *run = 1;
    return ZX_OK;
}

zx_status zx_sum_slices(zx_isa isa, size_t slice_n, int32_t nslices, const float *src,
                        float *dst, int32_t accumulate, float scale) {
    int run;   /* dst may be src's slice 0 (accumulate 0); any other overlap is an error */
    zx_status s = check_slices(isa, slice_n, nslices, src, sizeof(float), dst, !accumulate, &run);
    if (s != ZX_OK || !run) return s;
    switch (isa) {
#if ZX_HAVE_X86_SIMD
    case ZX_ISA_AVX512:
        zx_sum_slices_avx512(slice_n, slice_n, nslices, src, dst, accumulate, scale);
        break;
    case ZX_ISA_AVX2:
        zx_sum_slices_avx2(slice_n, slice_n, nslices, src, dst, accumulate, scale);
        break;
#endif
    default: zx_sum_slices_ref(slice_n, slice_n, nslices, src, dst, accumulate, scale); break;
    }
    return ZX_OK;
}

zx_status zx_sum_slices16(zx_isa isa, size_t slice_n, int32_t nslices, const uint16_t *src,
                          zx_dtype src_dtype, float *dst, int32_t accumulate, float scale) {
    if (nslices < 1 || !is_lp_dtype(src_dtype)) return ZX_ERR_INVALID_ARG;
    int run;   /* a widening sum cannot run in place */
    zx_status s = check_slices(isa, slice_n, nslices, src, sizeof(uint16_t), dst, 0, &run);
    if (s != ZX_OK || !run) return s;
    switch (isa) {
#if ZX_HAVE_X86_SIMD
    case ZX_ISA_AVX512:
        zx_sum_slices16_avx512(slice_n, slice_n, nslices, src, src_dtype, dst, accumulate, scale);
        break;
    case ZX_ISA_AVX2:
        zx_sum_slices16_avx2(slice_n, slice_n, nslices, src, src_dtype, dst, accumulate, scale);
        break;
#endif
    default: zx_sum_slices16_ref(slice_n, slice_n, nslices, src, src_dtype, dst, accumulate, scale); break;
    }
    return ZX_OK;
}

zx_status zx_scale(zx_isa isa, size_t n, float *x, float s) {
    zx_status st = check_isa(isa);
    if (st != ZX_OK) return st;
    if (n == 0) return ZX_OK;
    if (!x) return ZX_ERR_INVALID_ARG;
    switch (isa) {
#if ZX_HAVE_X86_SIMD
    case ZX_ISA_AVX512: zx_scale_avx512(n, x, s); break;
    case ZX_ISA_AVX2: zx_scale_avx2(n, x, s); break;
#endif
    default: zx_scale_ref(n, x, s); break;
    }
    return ZX_OK;
}

zx_status zx_cast_from_f32(zx_isa isa, size_t n, const float *src, void *dst,
                           zx_dtype dst_dtype) {
    if (dst_dtype != ZX_F32 && !is_lp_dtype(dst_dtype)) return ZX_ERR_INVALID_ARG;
    zx_status s = check_isa(isa);
    if (s != ZX_OK) return s;
    if (n == 0) return ZX_OK;
    if (!src || !dst) return ZX_ERR_INVALID_ARG;
    if (dst_dtype == ZX_F32)
        memmove(dst, src, n * sizeof(float));
    else
        cast_from_f32_isa(isa, n, src, dst, dst_dtype, 0);
    return ZX_OK;
}

zx_status zx_cast_to_f32(zx_isa isa, size_t n, const void *src, zx_dtype src_dtype,
                         float *dst) {
    if (src_dtype != ZX_F32 && !is_lp_dtype(src_dtype)) return ZX_ERR_INVALID_ARG;
    zx_status s = check_isa(isa);
    if (s != ZX_OK) return s;
    if (n == 0) return ZX_OK;
    if (!src || !dst) return ZX_ERR_INVALID_ARG;
    if (src_dtype == ZX_F32) {
        memmove(dst, src, n * sizeof(float));
        return ZX_OK;
    }
    switch (isa) {
#if ZX_HAVE_X86_SIMD
    case ZX_ISA_AVX512: zx_cast_to_f32_avx512(n, src, src_dtype, dst); break;
    case ZX_ISA_AVX2: zx_cast_to_f32_avx2(n, src, src_dtype, dst); break;
#endif
    default: zx_cast_to_f32_ref(n, src, src_dtype, dst); break;
    }
    return ZX_OK;
}

/* ------------------------------------------------------------------ split master, blocked */

/* Note [Fused split-master step] for the kernels without a one-pass vector body (SGD, Adam
 * with bf16 states): blocks of ZX_LP_BLOCK_NUMEL elements (whole tie bytes; 8 KiB of fp32,
 * in L1) are joined into a buffer, stepped by the kernel, rounded into hi and split, in one
 * call, so the masters make one trip through memory. step(ctx, k, p, j, h): k elements at
 * p, the stepped run's elements j.. (grad, states, counters), their bf16 copy h. */
typedef void (*zx_split_step_fn)(void *ctx, size_t k, float *p, size_t j, uint16_t *h);

static zx_status split_blocks(zx_isa isa, size_t total, size_t lead, size_t n, uint16_t *hi, int16_t *rem,
                              uint8_t *ties, zx_split_step_fn step, void *ctx) {
    if (!split_run_ok(total, lead, n)) return ZX_ERR_INVALID_ARG;
    if (n == 0) return ZX_OK;
    if (!hi || !rem || !ties) return ZX_ERR_INVALID_ARG;
    float buf[ZX_LP_BLOCK_NUMEL];
    const size_t end = lead + n;
    for (size_t a = lead & ~(size_t)7; a < total; a += ZX_LP_BLOCK_NUMEL) {
        const size_t len = total - a < ZX_LP_BLOCK_NUMEL ? total - a : ZX_LP_BLOCK_NUMEL;
        zx_master_join(isa, len, hi + a, rem + a, ties + a / 8, buf);
        const size_t s = a > lead ? a : lead, e = a + len < end ? a + len : end;
        if (e > s) step(ctx, e - s, buf + (s - a), s - lead, hi + s);
        zx_master_split(isa, len, buf, hi + a, rem + a, ties + a / 8);
    }
    return ZX_OK;
}

typedef struct {
    zx_isa isa;
    const float *grad;
    float *buf;
    zx_sgd_consts c;
} sgd_split_ctx;

static void sgd_split_step(void *ctx, size_t k, float *p, size_t j, uint16_t *h) {
    const sgd_split_ctx *x = (const sgd_split_ctx *)ctx;
    sgd_isa(x->isa, k, p, x->grad + j, x->buf ? x->buf + j : NULL, &x->c);
    cast_from_f32_isa(x->isa, k, p, h, ZX_BF16, 0);
}

zx_status zx_sgd_step_split(zx_isa isa, size_t total, size_t lead, size_t n, uint16_t *hi, int16_t *rem,
                            uint8_t *ties, const float *grad, float *momentum_buf, const zx_sgd_hparams *hp) {
    zx_status s = zx_sgd_step(isa, 0, NULL, NULL, NULL, NULL, ZX_BF16, hp);   /* hp and isa checks */
    if (s != ZX_OK) return s;
    if (n > 0 && (!grad || (hp->momentum != 0.0 && !momentum_buf))) return ZX_ERR_INVALID_ARG;
    sgd_split_ctx x = {isa, grad, NULL, sgd_consts(hp)};
    x.buf = x.c.use_momentum ? momentum_buf : NULL;
    return split_blocks(isa, total, lead, n, hi, rem, ties, sgd_split_step, &x);
}

typedef struct {
    zx_isa isa;
    const float *grad;
    uint16_t *m, *v;
    zx_adam_consts c;
    zx_sr_key key;
    uint64_t offset;
} bf16s_split_ctx;

/* The kernel writes no copy here: its copy-out streams past the cache when aligned, and the
 * split reads hi right after; the cast from the L1 buffer is the same rounding. */
static void bf16s_split_step(void *ctx, size_t k, float *p, size_t j, uint16_t *h) {
    const bf16s_split_ctx *x = (const bf16s_split_ctx *)ctx;
    const uint64_t off = x->offset + j;
    switch (x->isa) {
#if ZX_HAVE_X86_SIMD
    case ZX_ISA_AVX512:
        zx_adam_bf16s_avx512(k, p, x->grad + j, x->m + j, x->v + j, &x->c, x->key, off, NULL, ZX_BF16);
        break;
    case ZX_ISA_AVX2:
        zx_adam_bf16s_avx2(k, p, x->grad + j, x->m + j, x->v + j, &x->c, x->key, off, NULL, ZX_BF16);
        break;
#endif
    default:
        zx_adam_bf16s_ref(k, p, x->grad + j, x->m + j, x->v + j, &x->c, x->key, off, NULL, ZX_BF16);
        break;
    }
    cast_from_f32_isa(x->isa, k, p, h, ZX_BF16, 0);
}

zx_status zx_adam_step_bf16_states_split(zx_isa isa, size_t total, size_t lead, size_t n, uint16_t *hi,
                                         int16_t *rem, uint8_t *ties, const float *grad, uint16_t *exp_avg,
                                         uint16_t *exp_avg_sq, const zx_adam_hparams *hp, uint64_t seed,
                                         uint64_t offset) {
    zx_status s = zx_adam_step_bf16_states(isa, 0, NULL, NULL, NULL, NULL, NULL, ZX_BF16, hp, seed, offset);
    if (s != ZX_OK) return s;   /* hp (no amsgrad) and isa checks */
    if (n > 0 && (!grad || !exp_avg || !exp_avg_sq)) return ZX_ERR_INVALID_ARG;
    bf16s_split_ctx x = {isa, grad, exp_avg, exp_avg_sq, adam_consts(hp), zx_sr_key_of(seed), offset};
    return split_blocks(isa, total, lead, n, hi, rem, ties, bf16s_split_step, &x);
}
