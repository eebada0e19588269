// kernels.h — the engine's kernels for one device, chosen once at construction.
//
// Note [Kernel table]
//   Every arithmetic pass the engine makes over a bucket slice (optimizer
//   steps, gradient scan, scaling, casts, the local sum of an all-to-all
//   reduce-scatter, blockwise quantization) goes through one Kernels object, made by make_kernels()
//   for the parameters' device when the Engine is built. The engine itself
//   never asks which device it runs on:
//     CPU  (kernels_cpu.cpp):  the C core (csrc/core), on torch's intra-op
//                              threads (at::parallel_for), ISA chosen at run time;
//     CUDA (kernels_cuda.cpp): the csrc/cuda launchers on torch's current stream
//                              (built only when the extension is built with CUDA).
//   Pointers are device pointers of the table's device. Gradients arrive in
//   reduce_dtype; the table converts low-precision ones to fp32 on the way in.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <utility>

#include "core/zx_core.h"

namespace zx {

class Kernels {
public:
    virtual ~Kernels() = default;
    virtual const char *name() const = 0;   // "cpu-avx512", "cuda", ...

    // One Adam/AdamW (resp. SGD) step over n elements: fp32 param/state arrays,
    // grad (n elements of reduce_dtype, contiguous), optional low-precision copy.
    // ctl (may be null): the step control in the table's memory (Note [Step
    // control], csrc/core/zx_step_control.h): skip when ctl[ZX_CTL_SKIP] != 0,
    // ctl[ZX_CTL_MULT] replaces hp.grad_scale; step (may be null): the group's
    // step count there, after this step's increment, replacing hp.step /
    // hp.first_step. Neither is read by the host on a GPU.
    virtual void adam(int64_t n, float *param, const at::Tensor &grad, float *m, float *v, float *vmax,
                      void *lp, zx_dtype lp_dtype, const zx_adam_hparams &hp, const double *ctl,
                      const int64_t *step) = 0;
    // The same step with both states in bf16 (state_dtype="bf16"): m, v are n bf16
    // bit patterns, updated with counter-based stochastic rounding (zx_adam_step_bf16_states,
    // Note [Counter-based stochastic rounding] in core/zx_sr.h). The random bits of
    // element i are a hash of (seed + s, offset + i), s the step count (hp.step, or *step
    // when step is given, read on the device by the CUDA kernel): the result does not
    // depend on how the table splits [0, n) over threads or blocks. No amsgrad.
    virtual void adam_bf16_states(int64_t n, float *param, const at::Tensor &grad, uint16_t *m, uint16_t *v,
                                  void *lp, zx_dtype lp_dtype, const zx_adam_hparams &hp, uint64_t seed,
                                  uint64_t offset, const double *ctl, const int64_t *step) = 0;
    virtual void sgd(int64_t n, float *param, const at::Tensor &grad, float *buf, void *lp, zx_dtype lp_dtype,
                     const zx_sgd_hparams &hp, const double *ctl, const int64_t *step) = 0;
    // out2[0] += sum of squares of the finite elements of grad, out2[1] += count of
    // inf/nan ones: float[2] in the table's memory, nothing read back.
    virtual void grad_sumsq_into(const at::Tensor &grad, float *out2) = 0;
    // Sum of squares of grad*scale over the finite elements, and the count of
    // inf/nan elements; added into *sumsq / *nonfinite.
    virtual void grad_sumsq(const at::Tensor &grad, double scale, double *sumsq, int64_t *nonfinite) = 0;
    virtual void scale(int64_t n, float *x, float s) = 0;
    virtual void cast_from_f32(int64_t n, const float *src, void *dst, zx_dtype dst_dtype) = 0;
    // Note [Split master] (core/zx_master_split.c): out (n fp32) = the master kept as hi
    // (n bf16 bit patterns), rem (n int16) and ties (a bit per element, (n + 7) / 8 bytes);
    // split writes rem and ties from m and the hi that rounding m gave.
    virtual void master_join(int64_t n, const uint16_t *hi, const int16_t *rem, const uint8_t *ties, float *out) = 0;
    virtual void master_split(int64_t n, const float *m, const uint16_t *hi, int16_t *rem, uint8_t *ties) = 0;
    // adam() over the split master of `total` elements (hi, rem, ties as master_join's), in one
    // pass with no fp32 master (Note [Fused split-master step], cuda/zx_cuda_master_split.cu):
    // elements [lead, lead + n) step (grad, m, v, vmax indexed from the first), total <= lead
    // + n + 7. false: the table has no such kernel; the caller then joins, steps and splits
    // chunk by chunk.
    virtual bool adam_split(int64_t total, int64_t lead, int64_t n, uint16_t *hi, int16_t *rem, uint8_t *ties,
                            const at::Tensor &grad, float *m, float *v, float *vmax, const zx_adam_hparams &hp,
                            const double *ctl, const int64_t *step) {
        return false;
    }
    // The same for SGD (buf: momentum, indexed like grad) and for Adam with bf16 states
    // (element lead + j draws its random bits from counter offset + j, as adam_bf16_states).
    virtual bool sgd_split(int64_t total, int64_t lead, int64_t n, uint16_t *hi, int16_t *rem, uint8_t *ties,
                           const at::Tensor &grad, float *buf, const zx_sgd_hparams &hp, const double *ctl,
                           const int64_t *step) {
        return false;
    }
    virtual bool adam_bf16_states_split(int64_t total, int64_t lead, int64_t n, uint16_t *hi, int16_t *rem,
                                        uint8_t *ties, const at::Tensor &grad, uint16_t *m, uint16_t *v,
                                        const zx_adam_hparams &hp, uint64_t seed, uint64_t offset, const double *ctl,
                                        const int64_t *step) {
        return false;
    }
    // dst = (accumulate ? dst : 0) + sum_j src[j*slice_n + i], j ascending.
    virtual void sum_slices(int64_t slice_n, int32_t nslices, const float *src, float *dst, bool accumulate) = 0;
    // The same of 16-bit slices (src_dtype ZX_BF16/ZX_F16) widened exactly: bit for bit sum_slices of
    // the widened src. false: no such kernel here (Note [Narrow gradient wire] is CPU only).
    virtual bool sum_slices16(int64_t slice_n, int32_t nslices, const uint16_t *src, zx_dtype src_dtype, float *dst,
                              bool accumulate) {
        return false;
    }
    // Blockwise quantization (Note [Blockwise quantization], csrc/core/zx_quant.c): the
    // C core's formats and maths, bit-identical on every device. quantize: n elements
    // of src (src_dtype) -> q (zx_quant_bytes bytes) and scales (zx_quant_blocks
    // floats); residual null or n fp32 values of error feedback, updated.
    virtual void quantize(int32_t bits, int64_t block_numel, int64_t n, const void *src, zx_dtype src_dtype,
                          float *residual, void *q, float *scales) = 0;
    // dst (n elements of dst_dtype) = code * the scale of its block.
    virtual void dequantize(int32_t bits, int64_t block_numel, int64_t n, const void *q, const float *scales,
                            void *dst, zx_dtype dst_dtype) = 0;
    // dst (n fp32) = (accumulate ? dst : 0) + sum_j dequantized payload j, j ascending;
    // payload j's codes and scales start slice_blocks blocks after payload j-1's.
    virtual void dequantize_sum(int32_t bits, int64_t block_numel, int64_t n, int32_t nslices,
                                int64_t slice_blocks, const void *q, const float *scales, float *dst,
                                bool accumulate) = 0;
    // Set the byte size of a tensor's storage (stage 3 frees a released unit's
    // parameters this way, keeping the storage object that autograd aliases).
    virtual void resize_storage(const at::Tensor &t, int64_t bytes) = 0;
    // Bytes of working memory the table holds between calls (stats()'s buffer_bytes).
    virtual int64_t scratch_bytes() const { return 0; }
    // Note [Communication delay] (comm.cpp), CUDA only: a side stream waits for the
    // current one and sleeps ms, and is the current stream until comm_delay_end().
    virtual void comm_delay_begin(double ms) {}
    virtual void comm_delay_end() {}
};

// isa: the CPU ISA ("auto" already resolved); ignored for CUDA.
std::unique_ptr<Kernels> make_kernels(const at::Device &device, zx_isa isa, zx_dtype reduce_dtype);
std::unique_ptr<Kernels> make_cpu_kernels(zx_isa isa, zx_dtype reduce_dtype);

// An engine's kernel tables: its parameters' device's, and with offload from a device the
// host's, which step the master and states there.
struct KernelTables {
    zx_isa isa = ZX_ISA_SCALAR;        // the CPU kernels' ISA (reported by stats())
    std::unique_ptr<Kernels> device;   // the parameters' device's
    std::unique_ptr<Kernels> host;     // offload from a device: the CPU kernels, else null
    // What steps the master and the states: the host's with offload, else the device's.
    Kernels &step() { return host ? *host : *device; }
};
std::unique_ptr<Kernels> make_cuda_kernels(const at::Device &device, zx_dtype reduce_dtype);  // null without CUDA

}  // namespace zx
