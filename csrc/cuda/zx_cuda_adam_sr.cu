/* zx_cuda_adam_sr.cu — Adam/AdamW with bf16 states on the GPU: fp32 master and
 * gradient, exp_avg and exp_avg_sq stored as bf16 with stochastic rounding, an
 * optional bf16/fp16 copy of the updated parameter, in one pass.
 *
 * Bit-identical to the CPU oracle zx_adam_bf16s_ref (csrc/core/zx_kernels_ref.c):
 * the per-element maths is zx_adam_element's (zx_cuda_adam.cuh) with explicit __f*_rn
 * operations (Note [Floating point] in zx_cuda_common.cuh), and the random bits and
 * the rounding are the very functions of ../core/zx_sr.h (Note [Counter-based
 * stochastic rounding]), compiled for the device.
 * Build: part of the CUDA extension (setup.py); alone:
 *   nvcc -c -arch=sm_90 -std=c++17 -I csrc/core csrc/cuda/zx_cuda_adam_sr.cu
 */
#include "zx_cuda_adam_sr.h"
#include "zx_cuda_adam.cuh"    // defines: zx_adam_scalars(_of), zx_adam_when
#include "zx_cuda_common.cuh"  // defines: zx_span, zx_launch_elementwise, zx_store_lp*, zx_load*
#include "../core/zx_sr.h"     // defines: zx_sr_key, zx_sr_key_of, zx_sr_bits_in_block, zx_bf16_sr

/* One element: returns the new param; *m_bits, *v_bits are the bf16 states, read and
 * written. bits: the element's 32 random bits (low half exp_avg, high half exp_avg_sq). */
static __device__ __forceinline__ float zx_adam_sr_element(float p, float grad, unsigned short &m_bits,
                                                           unsigned short &v_bits, uint32_t bits,
                                                           const zx_adam_scalars &s) {
    float g = __fmul_rn(grad, s.grad_scale);                 /* grad (scaled; -grad if maximize) */
    if (s.decoupled) p = __fmul_rn(p, s.decay);              /* param.mul_(1 - lr*wd) */
    else if (s.l2) g = __fmaf_rn(s.weight_decay, p, g);      /* grad.add(param, alpha=wd) */
    float m = __uint_as_float((uint32_t)m_bits << 16);       /* bf16 -> fp32, exact */
    m = __fmaf_rn(s.lerp_coeff, __fsub_rn(g, m),             /* exp_avg.lerp_(g, 1 - beta1) */
                  s.lerp_from_grad ? g : m);
    float v = __fmul_rn(__uint_as_float((uint32_t)v_bits << 16), s.beta2); /* exp_avg_sq.mul_(beta2) */
    v = __fmaf_rn(__fmul_rn(s.one_minus_beta2, g), g, v);    /* .addcmul_(g, g, 1-beta2) */
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bc2_sqrt), s.eps); /* sqrt/bc2_sqrt + eps */
    m_bits = zx_bf16_sr(__float_as_uint(m), bits & 0xffffu);
    v_bits = zx_bf16_sr(__float_as_uint(v), bits >> 16);
    return __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom)); /* addcdiv_(m, denom, -ss) */
}

/* Indexing: pointers + scalars; LP is the copy-out dtype or ZX_CUDA_LP_NONE. */
template <int LP>
struct zx_adam_sr_op {
    float *param;
    const float *grad;
    unsigned short *exp_avg;
    unsigned short *exp_avg_sq;
    void *param_lp;               /* only written when LP != ZX_CUDA_LP_NONE */
    zx_adam_when when;            /* the step control and a device step count */
    uint64_t seed, offset;
    zx_sr_key key;                /* of seed + the step count (from the device when when.device_step) */
    zx_adam_scalars s;

    __device__ bool prepare() {
        if (!when.prepare(s)) return false;
        if (when.device_step != nullptr) key = zx_sr_key_of(seed + (uint64_t)*when.device_step);
        return true;
    }

    __device__ __forceinline__ uint32_t bits(size_t i) const {
        const uint64_t counter = offset + (uint64_t)i;
        return zx_sr_bits_in_block(key, zx_sr_block_key(key, (uint32_t)(counter >> 32)), (uint32_t)counter);
    }

    __device__ void one(size_t i) {
        unsigned short m = exp_avg[i], v = exp_avg_sq[i];
        float p = zx_adam_sr_element(param[i], grad[i], m, v, bits(i), s);
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        if constexpr (LP != ZX_CUDA_LP_NONE) zx_store_lp1<LP>(param_lp, i, p);
    }

    __device__ void vec4(size_t i) {
        float4 p = zx_load4(param, i), g = zx_load4(grad, i);
        uint2 mq = *reinterpret_cast<const uint2 *>(exp_avg + i);
        uint2 vq = *reinterpret_cast<const uint2 *>(exp_avg_sq + i);
        unsigned short m0 = (unsigned short)(mq.x & 0xffffu), m1 = (unsigned short)(mq.x >> 16);
        unsigned short m2 = (unsigned short)(mq.y & 0xffffu), m3 = (unsigned short)(mq.y >> 16);
        unsigned short v0 = (unsigned short)(vq.x & 0xffffu), v1 = (unsigned short)(vq.x >> 16);
        unsigned short v2 = (unsigned short)(vq.y & 0xffffu), v3 = (unsigned short)(vq.y >> 16);
        p.x = zx_adam_sr_element(p.x, g.x, m0, v0, bits(i), s);
        p.y = zx_adam_sr_element(p.y, g.y, m1, v1, bits(i + 1), s);
        p.z = zx_adam_sr_element(p.z, g.z, m2, v2, bits(i + 2), s);
        p.w = zx_adam_sr_element(p.w, g.w, m3, v3, bits(i + 3), s);
        zx_store4(param, i, p);
        *reinterpret_cast<uint2 *>(exp_avg + i) = make_uint2((unsigned)m0 | ((unsigned)m1 << 16),
                                                             (unsigned)m2 | ((unsigned)m3 << 16));
        *reinterpret_cast<uint2 *>(exp_avg_sq + i) = make_uint2((unsigned)v0 | ((unsigned)v1 << 16),
                                                                (unsigned)v2 | ((unsigned)v3 << 16));
        if constexpr (LP != ZX_CUDA_LP_NONE) zx_store_lp4<LP>(param_lp, i, p);
    }
};

/* zx_span_plan over the fp32 arrays and exp_avg; the body also needs exp_avg_sq and
 * the copy 8-byte aligned at the same element, else every element goes alone. */
static zx_span zx_adam_sr_span(size_t n, const float *param, const float *grad, const void *exp_avg,
                               const void *exp_avg_sq, const void *param_lp) {
    const void *f32[2] = {param, grad};
    zx_span span = zx_span_plan(n, f32, 2, exp_avg, 2);
    const void *others[2] = {exp_avg_sq, param_lp};
    for (int k = 0; k < 2; k++) {
        if (others[k] != nullptr && span.n_vec > 0 && ((uintptr_t)others[k] + 2 * span.head) % 8 != 0) {
            zx_span scalar_only = {0, 0, n};
            return scalar_only;
        }
    }
    return span;
}

template <int LP>
static zx_status zx_adam_sr_launch(const zx_adam_sr_op<LP> &op, size_t n, cudaStream_t stream) {
    zx_span span = zx_adam_sr_span(n, op.param, op.grad, op.exp_avg, op.exp_avg_sq,
                                   LP == ZX_CUDA_LP_NONE ? nullptr : op.param_lp);
    return zx_launch_elementwise(op, span, stream);
}

static bool zx_nonneg(double x) { return x >= 0.0; }   /* false for NaN */

extern "C" zx_status zx_cuda_adam_step_bf16_states(size_t n, float *param, const float *grad,
                                                   uint16_t *exp_avg, uint16_t *exp_avg_sq, void *param_lp,
                                                   zx_dtype lp_dtype, const zx_adam_hparams *hp,
                                                   uint64_t seed, uint64_t offset,
                                                   const int64_t *device_step, const double *ctl,
                                                   void *stream) {
    if (hp == nullptr) return ZX_ERR_INVALID_ARG;
    if (device_step == nullptr && hp->step < 1) return ZX_ERR_INVALID_ARG;
    if (!zx_nonneg(hp->lr) || !zx_nonneg(hp->eps) || !zx_nonneg(hp->weight_decay) ||
        !(hp->beta1 >= 0.0 && hp->beta1 < 1.0) || !(hp->beta2 >= 0.0 && hp->beta2 < 1.0)) {
        return ZX_ERR_INVALID_ARG;
    }
    if (hp->amsgrad) return ZX_ERR_UNSUPPORTED;   /* no bf16 max_exp_avg_sq */
    if (param_lp != nullptr && lp_dtype != ZX_BF16 && lp_dtype != ZX_F16) return ZX_ERR_INVALID_ARG;
    if (n == 0) return ZX_OK;
    if (param == nullptr || grad == nullptr || exp_avg == nullptr || exp_avg_sq == nullptr) {
        return ZX_ERR_INVALID_ARG;
    }

    const zx_adam_scalars s = zx_adam_scalars_of(hp, device_step == nullptr);
    const zx_adam_when when = zx_adam_when_of(hp, device_step, ctl);
    const zx_sr_key key = zx_sr_key_of(seed);   /* replaced in prepare() when device_step is given */

    cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
    unsigned short *m = reinterpret_cast<unsigned short *>(exp_avg);
    unsigned short *v = reinterpret_cast<unsigned short *>(exp_avg_sq);
    if (param_lp == nullptr) {
        zx_adam_sr_op<ZX_CUDA_LP_NONE> op = {param, grad, m, v, nullptr, when, seed, offset, key, s};
        return zx_adam_sr_launch(op, n, cuda_stream);
    }
    if (lp_dtype == ZX_BF16) {
        zx_adam_sr_op<ZX_BF16> op = {param, grad, m, v, param_lp, when, seed, offset, key, s};
        return zx_adam_sr_launch(op, n, cuda_stream);
    }
    zx_adam_sr_op<ZX_F16> op = {param, grad, m, v, param_lp, when, seed, offset, key, s};
    return zx_adam_sr_launch(op, n, cuda_stream);
}
