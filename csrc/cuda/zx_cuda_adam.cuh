/* zx_cuda_adam.cuh — the Adam/AdamW maths shared by the GPU kernels that step with
 * it (internal; included by .cu files of csrc/cuda only): zx_cuda_adam.cu (fp32
 * states), zx_cuda_adam_sr.cu (bf16 states) and zx_cuda_master_split.cu (the step
 * fused with the split master).
 *
 *   zx_adam_scalars        per-step scalars, rounded to fp32 where torch.optim rounds
 *                          its Python doubles (as zx_adam_consts in
 *                          csrc/core/zx_kernels_internal.h)
 *   zx_adam_scalars_of     them, from the hyperparameters, on the host
 *   zx_adam_when           what the device may override: the step control (Note [Step
 *                          control]) and a step count held in device memory
 *   zx_adam_element        one element of one step (fp32 states)
 */
#ifndef ZX_CUDA_ADAM_CUH
#define ZX_CUDA_ADAM_CUH

#include <math.h>

#include "zx_cuda_common.cuh"  // defines: Note [Floating point]
#include "zx_cuda_control.h"   // defines: ZX_CTL_MULT, ZX_CTL_SKIP

struct zx_adam_scalars {
    float grad_scale;       /* multiplies grad on load; negated when maximize */
    float decay;            /* AdamW: param *= 1 - lr*weight_decay */
    float weight_decay;     /* Adam: grad = fma(weight_decay, param, grad) */
    float lerp_coeff;       /* w = 1 - beta1 when w < 0.5, else w - 1 */
    float beta2;
    float one_minus_beta2;
    float eps;
    float neg_step_size;    /* -lr / (1 - beta1^step) */
    float bc2_sqrt;         /* sqrt(1 - beta2^step) */
    int l2;                 /* Adam with weight_decay != 0 */
    int decoupled;          /* AdamW with weight_decay != 0 */
    int lerp_from_grad;     /* torch's lerp(m, g, w): base m when w < 0.5, else base g */
    int amsgrad;
    int maximize;           /* negate a grad_scale read from the device */
};

/* The bias corrections of step `step`, in double, as torch.optim. */
static __host__ __device__ __forceinline__ void zx_adam_bias(zx_adam_scalars &s, double lr, double beta1,
                                                             double beta2, double step) {
    const double bias_correction1 = 1.0 - pow(beta1, step);
    const double bias_correction2 = 1.0 - pow(beta2, step);
    s.neg_step_size = (float)(-(lr / bias_correction1));
    s.bc2_sqrt = (float)sqrt(bias_correction2);
}

/* host_step: the bias corrections from hp->step (else left for zx_adam_when::prepare). */
static inline zx_adam_scalars zx_adam_scalars_of(const zx_adam_hparams *hp, bool host_step) {
    zx_adam_scalars s;
    const float lerp_weight = (float)(1.0 - hp->beta1);
    s.grad_scale = hp->maximize ? -hp->grad_scale : hp->grad_scale;
    s.decay = (float)(1.0 - hp->lr * hp->weight_decay);
    s.weight_decay = (float)hp->weight_decay;
    s.lerp_from_grad = !(lerp_weight < 0.5f);
    s.lerp_coeff = s.lerp_from_grad ? lerp_weight - 1.0f : lerp_weight;
    s.beta2 = (float)hp->beta2;
    s.one_minus_beta2 = (float)(1.0 - hp->beta2);
    s.eps = (float)hp->eps;
    s.l2 = !hp->decoupled && hp->weight_decay != 0.0;
    s.decoupled = hp->decoupled && hp->weight_decay != 0.0;
    s.amsgrad = hp->amsgrad != 0;
    s.maximize = hp->maximize != 0;
    s.neg_step_size = 0.0f;
    s.bc2_sqrt = 1.0f;
    if (host_step) zx_adam_bias(s, hp->lr, hp->beta1, hp->beta2, (double)hp->step);
    return s;
}

struct zx_adam_when {
    const int64_t *device_step;   /* NULL: the scalars already hold the bias corrections */
    const double *ctl;            /* NULL, or the step control (Note [Step control]) */
    double lr, beta1, beta2;      /* for the bias corrections from device_step */

    /* false: skip the step (change nothing); else s is this step's. */
    __device__ bool prepare(zx_adam_scalars &s) const {
        if (ctl != nullptr) {
            if (ctl[ZX_CTL_SKIP] != 0.0) return false;
            const float gs = (float)ctl[ZX_CTL_MULT];
            s.grad_scale = s.maximize ? -gs : gs;
        }
        if (device_step != nullptr) zx_adam_bias(s, lr, beta1, beta2, (double)*device_step);
        return true;
    }
};

static inline zx_adam_when zx_adam_when_of(const zx_adam_hparams *hp, const int64_t *device_step,
                                           const double *ctl) {
    zx_adam_when w = {device_step, ctl, hp->lr, hp->beta1, hp->beta2};
    return w;
}

/* One element of one Adam step; returns the new param, updates m, v, vmax in
 * place (vmax only when s.amsgrad). Each line is the torch op it mirrors, with
 * the rounding of csrc/core/zx_kernels_ref.c (the oracle), so results are
 * bit-identical to the CPU kernels; see Note [Floating point] in
 * zx_cuda_common.cuh for why every operation is an explicit __f*_rn. */
static __device__ __forceinline__ float zx_adam_element(float p, float grad, float &m, float &v,
                                                        float &vmax, const zx_adam_scalars &s) {
    float g = __fmul_rn(grad, s.grad_scale);                 /* grad (scaled; -grad if maximize) */
    if (s.decoupled) p = __fmul_rn(p, s.decay);              /* param.mul_(1 - lr*wd) */
    else if (s.l2) g = __fmaf_rn(s.weight_decay, p, g);      /* grad.add(param, alpha=wd) */
    m = __fmaf_rn(s.lerp_coeff, __fsub_rn(g, m),             /* exp_avg.lerp_(g, 1 - beta1) */
                  s.lerp_from_grad ? g : m);
    float v_decayed = __fmul_rn(v, s.beta2);                 /* exp_avg_sq.mul_(beta2) */
    v = __fmaf_rn(__fmul_rn(s.one_minus_beta2, g), g, v_decayed); /* .addcmul_(g, g, 1-beta2) */
    float v_hat = v;
    if (s.amsgrad) {                                         /* torch.maximum: NaN wins */
        vmax = (isnan(vmax) || isnan(v)) ? __fadd_rn(vmax, v) : (vmax > v ? vmax : v);
        v_hat = vmax;
    }
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v_hat), s.bc2_sqrt), s.eps); /* sqrt/bc2_sqrt + eps */
    return __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom)); /* addcdiv_(m, denom, -ss) */
}

#endif /* ZX_CUDA_ADAM_CUH */
