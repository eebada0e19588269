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
#include "zx_cuda_adam.h"
#include "zx_cuda_adam.cuh"    // defines: zx_adam_scalars(_of), zx_adam_when, zx_adam_element
#include "zx_cuda_common.cuh"  // defines: zx_span, zx_launch_elementwise, zx_store_lp*

/* Indexing: pointers + scalars; LP is the copy-out dtype or ZX_CUDA_LP_NONE. */
template <int LP>
struct zx_adam_op {
    float *param;
    const float *grad;
    float *exp_avg;
    float *exp_avg_sq;
    float *max_exp_avg_sq;        /* only read/written when s.amsgrad */
    void *param_lp;               /* only written when LP != ZX_CUDA_LP_NONE */
    zx_adam_when when;            /* the step control and a device step count */
    zx_adam_scalars s;

    __device__ bool prepare() { return when.prepare(s); }

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

    const zx_adam_scalars s = zx_adam_scalars_of(hp, device_step == nullptr);
    const zx_adam_when when = zx_adam_when_of(hp, device_step, ctl);

    cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
    if (param_lp == nullptr) {
        zx_adam_op<ZX_CUDA_LP_NONE> op = {param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq,
                                          nullptr, when, s};
        return zx_adam_launch(op, n, cuda_stream);
    }
    if (lp_dtype == ZX_BF16) {
        zx_adam_op<ZX_BF16> op = {param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq,
                                  param_lp, when, s};
        return zx_adam_launch(op, n, cuda_stream);
    }
    zx_adam_op<ZX_F16> op = {param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq,
                             param_lp, when, s};
    return zx_adam_launch(op, n, cuda_stream);
}

static __global__ void zx_increment_step_kernel(int64_t *device_step) { *device_step += 1; }

extern "C" zx_status zx_cuda_increment_step(int64_t *device_step, void *stream) {
    if (device_step == nullptr) return ZX_ERR_INVALID_ARG;
    zx_increment_step_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(device_step);
    ZX_CUDA_CHECK_LAUNCH();
    return ZX_OK;
}
