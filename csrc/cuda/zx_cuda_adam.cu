/* zx_cuda_adam.cu — Adam/AdamW step on the GPU: fp32 master, m, v (and the
 * AMSGrad max) in one pass, with an optional bf16/fp16 copy of the updated
 * parameter written in the same pass.
 *
 * Three layers: zx_adam_element (per-element maths, torch.optim's
 * _single_tensor_adam order of operations), zx_adam_op (indexing: one element
 * or four with float4), zx_cuda_adam_step (checks, host-side scalars, grid).
 * Build: part of the CUDA extension (setup.py); alone:
 *   nvcc -c -arch=sm_90 -std=c++17 -I csrc/core csrc/cuda/zx_cuda_adam.cu
 */
#include <math.h>

#include "zx_cuda_adam.h"
#include "zx_cuda_common.cuh"  // defines: zx_span, zx_launch_elementwise, zx_store_lp*
#include "zx_cuda_control.h"  // defines: ZX_CTL_MULT, ZX_CTL_SKIP

/* Per-step scalars, computed once per call on the host (or once per thread
 * from a device step count, see zx_adam_op::prepare), rounded to fp32 where
 * torch.optim rounds its Python-double scalars (as zx_adam_consts in
 * csrc/core/zx_kernels_internal.h). */
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

/* Indexing: pointers + scalars; LP is the copy-out dtype or ZX_CUDA_LP_NONE. */
template <int LP>
struct zx_adam_op {
    float *param;
    const float *grad;
    float *exp_avg;
    float *exp_avg_sq;
    float *max_exp_avg_sq;        /* only read/written when s.amsgrad */
    void *param_lp;               /* only written when LP != ZX_CUDA_LP_NONE */
    const int64_t *device_step;   /* NULL: s already holds the bias corrections */
    const double *ctl;            /* NULL, or the step control (Note [Step control]) */
    double lr, beta1, beta2;      /* for the bias corrections from device_step */
    zx_adam_scalars s;

    __device__ bool prepare() {
        if (ctl != nullptr) {
            if (ctl[ZX_CTL_SKIP] != 0.0) return false;
            const float gs = (float)ctl[ZX_CTL_MULT];
            s.grad_scale = s.maximize ? -gs : gs;
        }
        if (device_step == nullptr) return true;
        double step = (double)*device_step;
        double bias_correction1 = 1.0 - pow(beta1, step);
        double bias_correction2 = 1.0 - pow(beta2, step);
        s.neg_step_size = (float)(-(lr / bias_correction1));
        s.bc2_sqrt = (float)sqrt(bias_correction2);
        return true;
    }

    __device__ void one(size_t i) {
        float m = exp_avg[i], v = exp_avg_sq[i];
        float vmax = s.amsgrad ? max_exp_avg_sq[i] : 0.0f;
        float p = zx_adam_element(param[i], grad[i], m, v, vmax, s);
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        if (s.amsgrad) max_exp_avg_sq[i] = vmax;
        if constexpr (LP != ZX_CUDA_LP_NONE) zx_store_lp1<LP>(param_lp, i, p);
    }

    __device__ void vec4(size_t i) {
        float4 p = zx_load4(param, i), g = zx_load4(grad, i);
        float4 m = zx_load4(exp_avg, i), v = zx_load4(exp_avg_sq, i);
        float4 vmax = s.amsgrad ? zx_load4(max_exp_avg_sq, i) : make_float4(0.f, 0.f, 0.f, 0.f);
        p.x = zx_adam_element(p.x, g.x, m.x, v.x, vmax.x, s);
        p.y = zx_adam_element(p.y, g.y, m.y, v.y, vmax.y, s);
        p.z = zx_adam_element(p.z, g.z, m.z, v.z, vmax.z, s);
        p.w = zx_adam_element(p.w, g.w, m.w, v.w, vmax.w, s);
        zx_store4(param, i, p);
        zx_store4(exp_avg, i, m);
        zx_store4(exp_avg_sq, i, v);
        if (s.amsgrad) zx_store4(max_exp_avg_sq, i, vmax);
        if constexpr (LP != ZX_CUDA_LP_NONE) zx_store_lp4<LP>(param_lp, i, p);
    }
};

template <int LP>
static zx_status zx_adam_launch(const zx_adam_op<LP> &op, size_t n, cudaStream_t stream) {
    const void *f32[5] = {op.param, op.grad, op.exp_avg, op.exp_avg_sq,
                          op.s.amsgrad ? op.max_exp_avg_sq : nullptr};
    zx_span span = zx_span_plan(n, f32, 5, LP == ZX_CUDA_LP_NONE ? nullptr : op.param_lp, 2);
    return zx_launch_elementwise(op, span, stream);
}

extern "C" zx_status zx_cuda_adam_step(size_t n, float *param, const float *grad, float *exp_avg,
                                       float *exp_avg_sq, float *max_exp_avg_sq, void *param_lp,
                                       zx_dtype lp_dtype, const zx_adam_hparams *hp,
                                       const int64_t *device_step, const double *ctl, void *stream) {
    if (hp == nullptr) return ZX_ERR_INVALID_ARG;
    if (device_step == nullptr && hp->step < 1) return ZX_ERR_INVALID_ARG;
    if (param_lp != nullptr && lp_dtype != ZX_BF16 && lp_dtype != ZX_F16) return ZX_ERR_INVALID_ARG;
    if (n == 0) return ZX_OK;
    if (param == nullptr || grad == nullptr || exp_avg == nullptr || exp_avg_sq == nullptr) {
        return ZX_ERR_INVALID_ARG;
    }
    if (hp->amsgrad && max_exp_avg_sq == nullptr) return ZX_ERR_INVALID_ARG;

    zx_adam_scalars s;
    float lerp_weight = (float)(1.0 - hp->beta1);
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
    if (device_step == nullptr) {                 /* bias corrections, once, in double */
        double step = (double)hp->step;
        double bias_correction1 = 1.0 - pow(hp->beta1, step);
        double bias_correction2 = 1.0 - pow(hp->beta2, step);
        s.neg_step_size = (float)(-(hp->lr / bias_correction1));
        s.bc2_sqrt = (float)sqrt(bias_correction2);
    }

    cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
    if (param_lp == nullptr) {
        zx_adam_op<ZX_CUDA_LP_NONE> op = {param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq,
                                          nullptr, device_step, ctl, hp->lr, hp->beta1, hp->beta2, s};
        return zx_adam_launch(op, n, cuda_stream);
    }
    if (lp_dtype == ZX_BF16) {
        zx_adam_op<ZX_BF16> op = {param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq,
                                  param_lp, device_step, ctl, hp->lr, hp->beta1, hp->beta2, s};
        return zx_adam_launch(op, n, cuda_stream);
    }
    zx_adam_op<ZX_F16> op = {param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq,
                             param_lp, device_step, ctl, hp->lr, hp->beta1, hp->beta2, s};
    return zx_adam_launch(op, n, cuda_stream);
}

static __global__ void zx_increment_step_kernel(int64_t *device_step) { *device_step += 1; }

extern "C" zx_status zx_cuda_increment_step(int64_t *device_step, void *stream) {
    if (device_step == nullptr) return ZX_ERR_INVALID_ARG;
    zx_increment_step_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(device_step);
    ZX_CUDA_CHECK_LAUNCH();
    return ZX_OK;
}
