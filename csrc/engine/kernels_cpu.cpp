// kernels_cpu.cpp — the CPU kernel table (Note [Kernel table]): the C core's
// kernels over bucket slices, split into tasks on torch's intra-op threads.
#include <ATen/native/Resize.h>

#include <algorithm>
#include <vector>

#include "engine/kernels.h"

#include "core/zx_step_control.h"   // defines: ZX_CTL_*
#include "engine/check.h"      // defines: zx_check
#include "parallel.h"          // defines: zx_parallel_for, zx_parallel_blocks, kParallelGrainNumel

namespace zx {

namespace {

class CpuKernels final : public Kernels {
public:
    CpuKernels(zx_isa isa, zx_dtype rdt) : isa_(isa), rdt_(rdt) {
        snprintf(name_, sizeof name_, "cpu-%s", zx_isa_name(isa));
    }
    const char *name() const override { return name_; }

    void adam(int64_t n, float *p, const at::Tensor &grad, float *m, float *v, float *vmax, void *lp,
              zx_dtype lp_dtype, const zx_adam_hparams &hp_in, const double *ctl, const int64_t *step) override {
        zx_adam_hparams hp = hp_in;
        if (!controlled(hp, ctl, step)) return;
        char *lpc = (char *)lp;
        parallel(n, [&](int64_t lo, int64_t hi) {
            with_f32_grads(grad, lo, hi, [&](const float *g, int64_t a, int64_t b) {
                zx_check(zx_adam_step(isa_, (size_t)(b - a), p + a, g, m + a, v + a, vmax ? vmax + a : nullptr,
                                      lpc ? lpc + a * 2 : nullptr, lp_dtype, &hp),
                         "Adam step");
            });
        });
    }

    void adam_bf16_states(int64_t n, float *p, const at::Tensor &grad, uint16_t *m, uint16_t *v, void *lp,
                          zx_dtype lp_dtype, const zx_adam_hparams &hp_in, uint64_t seed, uint64_t offset,
                          const double *ctl, const int64_t *step) override {
        zx_adam_hparams hp = hp_in;
        if (!controlled(hp, ctl, step)) return;
        const uint64_t s = seed + (uint64_t)hp.step;   // as the CUDA kernel with a device step
        char *lpc = (char *)lp;
        parallel(n, [&](int64_t lo, int64_t hi) {
            with_f32_grads(grad, lo, hi, [&](const float *g, int64_t a, int64_t b) {
                // each range passes its elements' own counters: the bits do not depend on the split
                zx_check(zx_adam_step_bf16_states(isa_, (size_t)(b - a), p + a, g, m + a, v + a,
                                                  lpc ? lpc + a * 2 : nullptr, lp_dtype, &hp, s,
                                                  offset + (uint64_t)a),
                         "Adam step (bf16 states)");
            });
        });
    }

    void sgd(int64_t n, float *p, const at::Tensor &grad, float *buf, void *lp, zx_dtype lp_dtype,
             const zx_sgd_hparams &hp_in, const double *ctl, const int64_t *step) override {
        zx_sgd_hparams hp = hp_in;
        if (!controlled(hp, ctl, step)) return;
        char *lpc = (char *)lp;
        parallel(n, [&](int64_t lo, int64_t hi) {
            with_f32_grads(grad, lo, hi, [&](const float *g, int64_t a, int64_t b) {
                zx_check(zx_sgd_step(isa_, (size_t)(b - a), p + a, g, buf ? buf + a : nullptr,
                                     lpc ? lpc + a * 2 : nullptr, lp_dtype, &hp),
                         "SGD step");
            });
        });
    }

    // Fixed kParallelGrainNumel chunks summed in chunk order: the norm's bits do not
    // depend on the number of threads or on which finishes first.
    void grad_sumsq_into(const at::Tensor &grad, float *out2) override {
        double sumsq = 0.0;
        int64_t nonfinite = 0;
        grad_sumsq(grad, 1.0, &sumsq, &nonfinite);
        out2[0] += (float)sumsq;
        out2[1] += (float)nonfinite;
    }

    void grad_sumsq(const at::Tensor &grad, double scale, double *sumsq, int64_t *nonfinite) override {
        const int64_t n = grad.numel(), chunks = (n + kParallelGrainNumel - 1) / kParallelGrainNumel;
        std::vector<double> s(chunks, 0.0);
        std::vector<int64_t> nf(chunks, 0);
        at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
            for (int64_t c = c0; c < c1; c++)
                with_f32_grads(grad, c * kParallelGrainNumel, std::min(n, (c + 1) * kParallelGrainNumel),
                               [&](const float *g, int64_t a, int64_t b) {
                                   zx_check(zx_grad_sumsq(isa_, (size_t)(b - a), g, (float)scale, &s[c], &nf[c]),
                                            "gradient norm");
                               });
        });
        for (int64_t c = 0; c < chunks; c++) {
            *sumsq += s[c];
            *nonfinite += nf[c];
        }
    }

    void scale(int64_t n, float *x, float s) override {
        parallel(n, [&](int64_t lo, int64_t hi) {
            zx_check(zx_scale(isa_, (size_t)(hi - lo), x + lo, s), "scaling gradients");
        });
    }

    void cast_from_f32(int64_t n, const float *src, void *dst, zx_dtype dt) override {
        char *d = (char *)dst;
        parallel(n, [&](int64_t lo, int64_t hi) {
            zx_check(zx_cast_from_f32(isa_, (size_t)(hi - lo), src + lo, d + lo * 2, dt), "casting parameters");
        });
    }

    // Tasks over whole tie bytes (blocks of 8 elements), so no two write the same byte.
    void master_join(int64_t n, const uint16_t *hi, const int16_t *rem, const uint8_t *ties, float *out) override {
        zx_parallel_blocks(n, 8, [&](int64_t b0, int64_t a, int64_t b) {
            zx_check(zx_master_join(isa_, (size_t)(b - a), hi + a, rem + a, ties + b0, out + a), "joining the master");
        });
    }

    void master_split(int64_t n, const float *m, const uint16_t *hi, int16_t *rem, uint8_t *ties) override {
        zx_parallel_blocks(n, 8, [&](int64_t b0, int64_t a, int64_t b) {
            zx_check(zx_master_split(isa_, (size_t)(b - a), m + a, hi + a, rem + a, ties + b0), "splitting the master");
        });
    }

    // Note [Fused split-master step]: each kernel's one-pass call over the split master, on
    // tasks of whole tie bytes (split_tasks below).
    bool adam_split(int64_t total, int64_t lead, int64_t n, uint16_t *hi, int16_t *rem, uint8_t *ties,
                    const at::Tensor &grad, float *m, float *v, float *vmax, const zx_adam_hparams &hp_in,
                    const double *ctl, const int64_t *step) override {
        zx_adam_hparams hp = hp_in;
        if (n <= 0 || !controlled(hp, ctl, step)) return true;
        split_tasks(total, lead, n, grad, [&](int64_t a, int64_t b, int64_t s, int64_t k, int64_t j, const float *g) {
            return zx_adam_step_split(isa_, (size_t)(b - a), (size_t)(s - a), (size_t)k, hi + a, rem + a, ties + a / 8,
                                      g, m + j, v + j, vmax ? vmax + j : nullptr, &hp);
        });
        return true;
    }

    bool sgd_split(int64_t total, int64_t lead, int64_t n, uint16_t *hi, int16_t *rem, uint8_t *ties,
                   const at::Tensor &grad, float *buf, const zx_sgd_hparams &hp_in, const double *ctl,
                   const int64_t *step) override {
        zx_sgd_hparams hp = hp_in;
        if (n <= 0 || !controlled(hp, ctl, step)) return true;
        split_tasks(total, lead, n, grad, [&](int64_t a, int64_t b, int64_t s, int64_t k, int64_t j, const float *g) {
            return zx_sgd_step_split(isa_, (size_t)(b - a), (size_t)(s - a), (size_t)k, hi + a, rem + a, ties + a / 8,
                                     g, buf ? buf + j : nullptr, &hp);
        });
        return true;
    }

    bool adam_bf16_states_split(int64_t total, int64_t lead, int64_t n, uint16_t *hi, int16_t *rem, uint8_t *ties,
                                const at::Tensor &grad, uint16_t *m, uint16_t *v, const zx_adam_hparams &hp_in,
                                uint64_t seed, uint64_t offset, const double *ctl, const int64_t *step) override {
        zx_adam_hparams hp = hp_in;
        if (n <= 0 || !controlled(hp, ctl, step)) return true;
        const uint64_t sd = seed + (uint64_t)hp.step;   // as adam_bf16_states
        split_tasks(total, lead, n, grad, [&](int64_t a, int64_t b, int64_t s, int64_t k, int64_t j, const float *g) {
            return zx_adam_step_bf16_states_split(isa_, (size_t)(b - a), (size_t)(s - a), (size_t)k, hi + a, rem + a,
                                                  ties + a / 8, g, m + j, v + j, &hp, sd, offset + (uint64_t)j);
        });
        return true;
    }

    void sum_slices(int64_t sn, int32_t np, const float *src, float *dst, bool accumulate) override {
        parallel(sn, [&](int64_t lo, int64_t hi) {
            if (hi - lo == sn) {   // one task: one pass over all slices
                zx_check(zx_sum_slices(isa_, (size_t)sn, np, src, dst, accumulate ? 1 : 0, 1.0f),
                         "summing reduce-scatter slices");
                return;
            }
            // Several tasks: each adds columns [lo, hi) of the N slices.
            for (int32_t j = 0; j < np; j++)
                zx_check(zx_sum_slices(isa_, (size_t)(hi - lo), 1, src + j * sn + lo, dst + lo,
                                       (accumulate || j > 0) ? 1 : 0, 1.0f),
                         "summing reduce-scatter slices");
        });
    }

    // sum_slices' split into tasks, so the same additions in the same order
    bool sum_slices16(int64_t sn, int32_t np, const uint16_t *src, zx_dtype dt, float *dst, bool accumulate) override {
        parallel(sn, [&](int64_t lo, int64_t hi) {
            if (hi - lo == sn) {
                zx_check(zx_sum_slices16(isa_, (size_t)sn, np, src, dt, dst, accumulate ? 1 : 0, 1.0f),
                         "summing 16-bit reduce-scatter slices");
                return;
            }
            for (int32_t j = 0; j < np; j++)
                zx_check(zx_sum_slices16(isa_, (size_t)(hi - lo), 1, src + j * sn + lo, dt, dst + lo,
                                         (accumulate || j > 0) ? 1 : 0, 1.0f),
                         "summing 16-bit reduce-scatter slices");
        });
        return true;
    }

    void quantize(int32_t bits, int64_t bn, int64_t n, const void *src, zx_dtype dt, float *residual, void *q,
                  float *scales) override {
        const char *s = (const char *)src;
        const int64_t es = dt == ZX_F32 ? 4 : 2, bb = bn * bits / 8;
        zx_parallel_blocks(n, bn, [&](int64_t b0, int64_t lo, int64_t hi) {
            zx_check(zx_quantize(isa_, bits, (size_t)bn, (size_t)(hi - lo), s + lo * es, dt,
                                 residual ? residual + lo : nullptr, (uint8_t *)q + b0 * bb, scales + b0),
                     "quantizing");
        });
    }

    void dequantize(int32_t bits, int64_t bn, int64_t n, const void *q, const float *scales, void *dst,
                    zx_dtype dt) override {
        char *d = (char *)dst;
        const int64_t es = dt == ZX_F32 ? 4 : 2, bb = bn * bits / 8;
        zx_parallel_blocks(n, bn, [&](int64_t b0, int64_t lo, int64_t hi) {
            zx_check(zx_dequantize(isa_, bits, (size_t)bn, (size_t)(hi - lo), (const uint8_t *)q + b0 * bb,
                                   scales + b0, d + lo * es, dt),
                     "dequantizing");
        });
    }

    void dequantize_sum(int32_t bits, int64_t bn, int64_t n, int32_t nslices, int64_t slice_blocks, const void *q,
                        const float *scales, float *dst, bool accumulate) override {
        const int64_t bb = bn * bits / 8;
        zx_parallel_blocks(n, bn, [&](int64_t b0, int64_t lo, int64_t hi) {
            zx_check(zx_dequantize_sum(isa_, bits, (size_t)bn, (size_t)(hi - lo), nslices, (size_t)slice_blocks,
                                       (const uint8_t *)q + b0 * bb, scales + b0, dst + lo, accumulate ? 1 : 0,
                                       1.0f),
                     "summing quantized slices");
        });
    }

    void resize_storage(const at::Tensor &t, int64_t bytes) override {
        at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), (size_t)bytes);
    }

private:
    template <class F>
    void parallel(int64_t n, F &&fn) const {
        zx_parallel_for(n, fn);
    }

    // Kernels read fp32 gradients: a low-precision one is converted in small
    // cache-resident chunks (Note [Mixed precision]).
    // The step control (Note [Step control]) and a step count, both in host memory here, folded
    // into hp; false: this step is skipped.
    static bool controlled(zx_adam_hparams &hp, const double *ctl, const int64_t *step) {
        if (ctl != nullptr && ctl[ZX_CTL_SKIP] != 0.0) return false;
        if (ctl != nullptr) hp.grad_scale = (float)ctl[ZX_CTL_MULT];
        if (step != nullptr) hp.step = *step;
        return true;
    }
    static bool controlled(zx_sgd_hparams &hp, const double *ctl, const int64_t *step) {
        if (ctl != nullptr && ctl[ZX_CTL_SKIP] != 0.0) return false;
        if (ctl != nullptr) hp.grad_scale = (float)ctl[ZX_CTL_MULT];
        if (step != nullptr) hp.first_step = *step == 1;
        return true;
    }

    // [0, total) in tasks of whole tie bytes, each cut into pieces (2048 elements when the
    // gradients need converting, as with_f32_grads); call(a, b, s, k, j, g) steps piece [a, b),
    // whose elements [s, s + k) are the stepped run's j.., with g their fp32 gradients.
    template <class F>
    void split_tasks(int64_t total, int64_t lead, int64_t n, const at::Tensor &grad, F &&call) const {
        const int64_t end = lead + n;
        zx_parallel_blocks(total, 8, [&](int64_t, int64_t ta, int64_t tb) {
            const int64_t piece = rdt_ == ZX_F32 ? tb - ta : 2048;
            float buf[2048];
            for (int64_t a = ta; a < tb; a += piece) {
                const int64_t b = std::min(tb, a + piece), s = std::max(a, lead), e = std::min(b, end);
                if (e <= s) continue;   // no stepped element: its bits stay
                const int64_t k = e - s, j = s - lead;
                const float *g = buf;
                if (rdt_ == ZX_F32)
                    g = grad.data_ptr<float>() + j;
                else
                    zx_check(zx_cast_to_f32(isa_, (size_t)k, (const char *)grad.data_ptr() + j * grad.element_size(),
                                            rdt_, buf), "converting gradients");
                zx_check(call(a, b, s, k, j, g), "a step of the split master");
            }
        });
    }

    template <class F>
    void with_f32_grads(const at::Tensor &grad, int64_t lo, int64_t hi, F &&fn) const {
        if (rdt_ == ZX_F32) {
            fn(grad.data_ptr<float>() + lo, lo, hi);
            return;
        }
        constexpr int64_t kChunk = 2048;   // 8 KiB: stays in L1 between the cast and the kernel
        float buf[kChunk];
        const char *base = (const char *)grad.data_ptr();
        const int64_t es = grad.element_size();
        for (int64_t a = lo; a < hi; a += kChunk) {
            const int64_t b = std::min(hi, a + kChunk);
            zx_check(zx_cast_to_f32(isa_, (size_t)(b - a), base + a * es, rdt_, buf), "converting gradients");
            fn(buf, a, b);
        }
    }

    zx_isa isa_;
    zx_dtype rdt_;
    char name_[32];
};

}  // namespace

std::unique_ptr<Kernels> make_cpu_kernels(zx_isa isa, zx_dtype rdt) { return std::make_unique<CpuKernels>(isa, rdt); }

std::unique_ptr<Kernels> make_kernels(const at::Device &device, zx_isa isa, zx_dtype rdt) {
    if (device.is_cpu()) return make_cpu_kernels(isa, rdt);
    if (device.is_cuda()) {
        auto k = make_cuda_kernels(device, rdt);
        TORCH_CHECK(k, "zero_ext: the parameters are on ", device, " but this build of zero_ext has no CUDA "
                    "kernels (torch without CUDA, or nvcc missing at build time); rebuild on a machine with "
                    "both, or move the model to the CPU");
        return k;
    }
    TORCH_CHECK(false, "zero_ext: parameters on ", device, " are not supported; move the model to the CPU or a "
                "CUDA device (model.to('cpu'), model.to('cuda')) before zeroify");
    return nullptr;
}

}  // namespace zx
