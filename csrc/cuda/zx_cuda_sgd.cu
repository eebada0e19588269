/* zx_cuda_sgd.cu — SGD step (momentum, dampening, Nesterov, weight decay,
 * maximize) on the GPU, with an optional bf16/fp16 copy-out in the same pass.
 *
 * Three layers: zx_sgd_element (per-element maths, torch.optim's
 * _single_tensor_sgd order of operations), zx_sgd_op (indexing),
 * zx_cuda_sgd_step (checks, host-side scalars, grid).
 * Build: part of the CUDA extension (setup.py); alone:
 *   nvcc -c -arch=sm_90 -std=c++17 -I csrc/core csrc/cuda/zx_cuda_sgd.cu
 */
#include "zx_cuda_sgd.h"
#include "zx_cuda_common.cuh"  // defines: zx_span, zx_launch_elementwise, zx_store_lp*
#include "zx_cuda_control.h"  // defines: ZX_CTL_MULT, ZX_CTL_SKIP

/* Per-call scalars, converted to float once on the host as torch does. */
struct zx_sgd_scalars {
    float grad_scale;          /* multiplies grad on load; negated when maximize */
    float neg_lr;              /* param.add_(d_p, alpha=-lr) */
    float weight_decay;        /* d_p = grad.add(param, alpha=wd) */
    float momentum;
    float one_minus_dampening; /* buf.mul_(momentum).add_(d_p, alpha=1 - dampening) */
    int has_weight_decay;
    int has_momentum;
    int nesterov;
    int first_step;            /* buf = d_p.clone() */
    int maximize;              /* negate a grad_scale read from the device */
};

/* One element of one SGD step; returns the new param, updates buf in place
 * (when s.has_momentum). The rounding is that of csrc/core/zx_kernels_ref.c
 * (bit-identical results); see Note [Floating point] in zx_cuda_common.cuh. */
static __device__ __forceinline__ float zx_sgd_element(float p, float grad, float &buf,
                                                       const zx_sgd_scalars &s) {
    float d = __fmul_rn(grad, s.grad_scale);                     /* grad (scaled; -grad if maximize) */
    if (s.has_weight_decay) d = __fmaf_rn(s.weight_decay, p, d); /* grad.add(param, alpha=wd) */
    if (s.has_momentum) {
        if (s.first_step) buf = d;                               /* buf = clone(d_p) */
        else buf = __fmaf_rn(s.one_minus_dampening, d,
                             __fmul_rn(buf, s.momentum));        /* buf.mul_(mom).add_(d_p, 1-damp) */
        d = s.nesterov ? __fmaf_rn(s.momentum, buf, d) : buf;    /* d_p.add(buf, alpha=mom) | buf */
    }
    return __fmaf_rn(s.neg_lr, d, p);                            /* param.add_(d_p, alpha=-lr) */
}

template <int LP>
struct zx_sgd_op {
    float *param;
    const float *grad;
    float *momentum_buf;       /* only read/written when s.has_momentum */
    void *param_lp;            /* only written when LP != ZX_CUDA_LP_NONE */
    const int64_t *device_step; /* NULL: s.first_step is the host's; else first = (*device_step == 1) */
    const double *ctl;          /* NULL, or the step control (Note [Step control]) */
    zx_sgd_scalars s;

    __device__ bool prepare() {
        if (ctl != nullptr) {
            if (ctl[ZX_CTL_SKIP] != 0.0) return false;
            const float gs = (float)ctl[ZX_CTL_MULT];
            s.grad_scale = s.maximize ? -gs : gs;
        }
        if (device_step != nullptr) s.first_step = *device_step == 1;
        return true;
    }

    __device__ void one(size_t i) {
        float buf = (s.has_momentum && !s.first_step) ? momentum_buf[i] : 0.0f;
        float p = zx_sgd_element(param[i], grad[i], buf, s);
        param[i] = p;
        if (s.has_momentum) momentum_buf[i] = buf;
        if constexpr (LP != ZX_CUDA_LP_NONE) zx_store_lp1<LP>(param_lp, i, p);
    }

    __device__ void vec4(size_t i) {
        float4 p = zx_load4(param, i), g = zx_load4(grad, i);
        float4 buf = (s.has_momentum && !s.first_step) ? zx_load4(momentum_buf, i)
                                                       : make_float4(0.f, 0.f, 0.f, 0.f);
        p.x = zx_sgd_element(p.x, g.x, buf.x, s);
        p.y = zx_sgd_element(p.y, g.y, buf.y, s);
        p.z = zx_sgd_element(p.z, g.z, buf.z, s);
        p.w = zx_sgd_element(p.w, g.w, buf.w, s);
        zx_store4(param, i, p);
        if (s.has_momentum) zx_store4(momentum_buf, i, buf);
        if constexpr (LP != ZX_CUDA_LP_NONE) zx_store_lp4<LP>(param_lp, i, p);
    }
};

template <int LP>
static zx_status zx_sgd_launch(const zx_sgd_op<LP> &op, size_t n, cudaStream_t stream) {
    const void *f32[3] = {op.param, op.grad, op.s.has_momentum ? op.momentum_buf : nullptr};
    zx_span span = zx_span_plan(n, f32, 3, LP == ZX_CUDA_LP_NONE ? nullptr : op.param_lp, 2);
    return zx_launch_elementwise(op, span, stream);
}

extern "C" zx_status zx_cuda_sgd_step(size_t n, float *param, const float *grad, float *momentum_buf,
                                      void *param_lp, zx_dtype lp_dtype, const zx_sgd_hparams *hp,
                                      const int64_t *device_step, const double *ctl, void *stream) {
    if (hp == nullptr) return ZX_ERR_INVALID_ARG;
    if (param_lp != nullptr && lp_dtype != ZX_BF16 && lp_dtype != ZX_F16) return ZX_ERR_INVALID_ARG;
    if (n == 0) return ZX_OK;
    if (param == nullptr || grad == nullptr) return ZX_ERR_INVALID_ARG;
    if (hp->momentum != 0.0 && momentum_buf == nullptr) return ZX_ERR_INVALID_ARG;

    zx_sgd_scalars s;
    s.grad_scale = hp->maximize ? -hp->grad_scale : hp->grad_scale;
    s.neg_lr = (float)(-hp->lr);
    s.weight_decay = (float)hp->weight_decay;
    s.momentum = (float)hp->momentum;
    s.one_minus_dampening = (float)(1.0 - hp->dampening);
    s.has_weight_decay = hp->weight_decay != 0.0;
    s.has_momentum = hp->momentum != 0.0;
    s.nesterov = hp->nesterov != 0;
    s.first_step = hp->first_step != 0;
    s.maximize = hp->maximize != 0;

    cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
    if (param_lp == nullptr) {
        zx_sgd_op<ZX_CUDA_LP_NONE> op = {param, grad, momentum_buf, nullptr, device_step, ctl, s};
        return zx_sgd_launch(op, n, cuda_stream);
    }
    if (lp_dtype == ZX_BF16) {
        zx_sgd_op<ZX_BF16> op = {param, grad, momentum_buf, param_lp, device_step, ctl, s};
        return zx_sgd_launch(op, n, cuda_stream);
    }
    zx_sgd_op<ZX_F16> op = {param, grad, momentum_buf, param_lp, device_step, ctl, s};
    return zx_sgd_launch(op, n, cuda_stream);
}
