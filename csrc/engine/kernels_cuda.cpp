// kernels_cuda.cpp — the CUDA kernel table (Note [Kernel table]): the
// csrc/cuda launchers, enqueued on torch's current stream of the parameters'
// device. Built only with ZX_WITH_CUDA (setup.py, when torch has CUDA and nvcc
// is present); otherwise make_cuda_kernels returns null and the engine refuses
// CUDA parameters with a message saying why.
//
// grad_sumsq reads its two numbers back to the host (stats, the CPU-style
// path); a steady-state GPU step uses grad_sumsq_into and the step control
// (Note [Step control], csrc/core/zx_step_control.h) instead, reading nothing.
#include "engine/kernels.h"

#ifdef ZX_WITH_CUDA

#include <ATen/cuda/Sleep.h>           // at::cuda::sleep
#include <c10/cuda/CUDAException.h>    // C10_CUDA_CHECK
#include <cuda_runtime_api.h>          // events (ATen/cuda/CUDAEvent.h would need cuBLAS headers)
#include <ATen/native/cuda/Resize.h>   // at::native::resize_bytes_cuda
#include <optional>
#include <c10/cuda/CUDAGuard.h>    // c10::cuda::CUDAGuard
#include <c10/cuda/CUDAStream.h>   // c10::cuda::getCurrentCUDAStream

#include "cuda/zx_cuda.h"
#include "engine/check.h"          // defines: zx_check

namespace zx {

namespace {

class CudaKernels final : public Kernels {
public:
    CudaKernels(const at::Device &dev, zx_dtype rdt) : dev_(dev), rdt_(rdt) {}
    ~CudaKernels() override {
        if (ready_ != nullptr) cudaEventDestroy(ready_);   // no throw from a destructor
    }
    const char *name() const override { return "cuda"; }

    void adam(int64_t n, float *p, const at::Tensor &grad, float *m, float *v, float *vmax, void *lp,
              zx_dtype lp_dtype, const zx_adam_hparams &hp, const double *ctl, const int64_t *step) override {
        if (n <= 0) return;
        c10::cuda::CUDAGuard guard(dev_);
        zx_check(zx_cuda_adam_step((size_t)n, p, f32(grad), m, v, vmax, lp, lp_dtype, &hp, step, ctl, stream()),
                 "CUDA Adam step");
    }

    void adam_bf16_states(int64_t n, float *p, const at::Tensor &grad, uint16_t *m, uint16_t *v, void *lp,
                          zx_dtype lp_dtype, const zx_adam_hparams &hp, uint64_t seed, uint64_t offset,
                          const double *ctl, const int64_t *step) override {
        if (n <= 0) return;
        c10::cuda::CUDAGuard guard(dev_);
        // With a device step the kernel hashes with seed + *step itself; without, the host adds hp.step.
        const uint64_t s = step != nullptr ? seed : seed + (uint64_t)hp.step;
        zx_check(zx_cuda_adam_step_bf16_states((size_t)n, p, f32(grad), m, v, lp, lp_dtype, &hp, s, offset, step,
                                               ctl, stream()),
                 "CUDA Adam step (bf16 states)");
    }

    void sgd(int64_t n, float *p, const at::Tensor &grad, float *buf, void *lp, zx_dtype lp_dtype,
             const zx_sgd_hparams &hp, const double *ctl, const int64_t *step) override {
        if (n <= 0) return;
        c10::cuda::CUDAGuard guard(dev_);
        zx_check(zx_cuda_sgd_step((size_t)n, p, f32(grad), buf, lp, lp_dtype, &hp, step, ctl, stream()),
                 "CUDA SGD step");
    }

    void grad_sumsq(const at::Tensor &grad, double scale, double *sumsq, int64_t *nonfinite) override {
        if (grad.numel() == 0) return;
        c10::cuda::CUDAGuard guard(dev_);
        if (!out2_.defined()) out2_ = at::zeros({2}, at::TensorOptions().dtype(at::kFloat).device(dev_));
        out2_.zero_();
        zx_check(zx_cuda_grad_sumsq((size_t)grad.numel(), f32(grad), (float)scale, out2_.data_ptr<float>(),
                                    stream()),
                 "CUDA gradient norm");
        at::Tensor host = out2_.cpu();   // a host synchronization (see the file's header)
        *sumsq += host[0].item<float>();
        *nonfinite += (int64_t)host[1].item<float>();
    }

    void grad_sumsq_into(const at::Tensor &grad, float *out2) override {
        if (grad.numel() == 0) return;
        c10::cuda::CUDAGuard guard(dev_);
        zx_check(zx_cuda_grad_sumsq((size_t)grad.numel(), f32(grad), 1.0f, out2, stream()), "CUDA gradient norm");
    }

    void scale(int64_t n, float *x, float s) override {
        if (n <= 0) return;
        c10::cuda::CUDAGuard guard(dev_);
        zx_check(zx_cuda_scale((size_t)n, x, s, stream()), "CUDA gradient scaling");
    }

    void cast_from_f32(int64_t n, const float *src, void *dst, zx_dtype dt) override {
        if (n <= 0) return;
        c10::cuda::CUDAGuard guard(dev_);
        zx_check(zx_cuda_cast_from_f32((size_t)n, src, dst, dt, stream()), "CUDA cast");
    }

    void master_join(int64_t n, const uint16_t *hi, const int16_t *rem, const uint8_t *ties, float *out) override {
        if (n <= 0) return;
        c10::cuda::CUDAGuard guard(dev_);
        zx_check(zx_cuda_master_join((size_t)n, hi, rem, ties, out, stream()), "CUDA master join");
    }

    void master_split(int64_t n, const float *m, const uint16_t *hi, int16_t *rem, uint8_t *ties) override {
        if (n <= 0) return;
        c10::cuda::CUDAGuard guard(dev_);
        zx_check(zx_cuda_master_split((size_t)n, m, hi, rem, ties, stream()), "CUDA master split");
    }

    bool adam_split(int64_t total, int64_t lead, int64_t n, uint16_t *hi, int16_t *rem, uint8_t *ties,
                    const at::Tensor &grad, float *m, float *v, float *vmax, const zx_adam_hparams &hp,
                    const double *ctl, const int64_t *step) override {
        if (n <= 0) return true;
        c10::cuda::CUDAGuard guard(dev_);
        zx_check(zx_cuda_adam_step_split((size_t)total, (size_t)lead, (size_t)n, hi, rem, ties, f32(grad), m, v, vmax,
                                         &hp, step, ctl, stream()),
                 "CUDA Adam step of the split master");
        return true;
    }

    void sum_slices(int64_t sn, int32_t np, const float *src, float *dst, bool accumulate) override {
        if (sn <= 0) return;
        c10::cuda::CUDAGuard guard(dev_);
        zx_check(zx_cuda_sum_slices((size_t)sn, np, src, dst, accumulate ? 1 : 0, 1.0f, stream()),
                 "CUDA slice sum");
    }

    void quantize(int32_t bits, int64_t bn, int64_t n, const void *src, zx_dtype dt, float *residual, void *q,
                  float *scales) override {
        zx_check(zx_cuda_quantize(bits, (size_t)bn, (size_t)n, src, dt, residual, q, scales, stream()),
                 "CUDA quantization");
    }
    void dequantize(int32_t bits, int64_t bn, int64_t n, const void *q, const float *scales, void *dst,
                    zx_dtype dt) override {
        zx_check(zx_cuda_dequantize(bits, (size_t)bn, (size_t)n, q, scales, dst, dt, stream()),
                 "CUDA dequantization");
    }
    void dequantize_sum(int32_t bits, int64_t bn, int64_t n, int32_t nslices, int64_t slice_blocks, const void *q,
                        const float *scales, float *dst, bool accumulate) override {
        zx_check(zx_cuda_dequantize_sum(bits, (size_t)bn, (size_t)n, nslices, (size_t)slice_blocks, q, scales, dst,
                                        accumulate ? 1 : 0, 1.0f, stream()),
                 "CUDA sum of quantized slices");
    }
    void resize_storage(const at::Tensor &t, int64_t bytes) override {
        c10::cuda::CUDAGuard guard(dev_);
        at::native::resize_bytes_cuda(t.storage().unsafeGetStorageImpl(), (size_t)bytes);
    }

    int64_t scratch_bytes() const override {
        return (scratch_.defined() ? scratch_.nbytes() : 0) + (out2_.defined() ? out2_.nbytes() : 0);
    }

    // Note [Communication delay] (comm.cpp): the side stream waits for the current one,
    // spins ms there and is current while the collective is launched.
    void comm_delay_begin(double ms) override {
        c10::cuda::CUDAGuard guard(dev_);
        const c10::cuda::CUDAStream cur = c10::cuda::getCurrentCUDAStream(dev_.index());
        if (!delay_stream_.has_value()) delay_stream_ = c10::cuda::getStreamFromPool(false, dev_.index());
        if (ready_ == nullptr) C10_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
        C10_CUDA_CHECK(cudaEventRecord(ready_, cur.stream()));
        C10_CUDA_CHECK(cudaStreamWaitEvent(delay_stream_->stream(), ready_, 0));
        if (cycles_per_ms_ <= 0) cycles_per_ms_ = measure_cycles_per_ms(*delay_stream_);
        prev_stream_ = cur;
        c10::cuda::setCurrentCUDAStream(*delay_stream_);
        at::cuda::sleep((int64_t)(ms * cycles_per_ms_));
    }
    void comm_delay_end() override {
        if (prev_stream_.has_value()) c10::cuda::setCurrentCUDAStream(*prev_stream_);
        prev_stream_.reset();
    }

private:
    // Clock cycles of the spin kernel per millisecond, timed once on stream s.
    static double measure_cycles_per_ms(const c10::cuda::CUDAStream &s) {
        constexpr int64_t kCycles = 10000000;
        c10::cuda::CUDAStreamGuard on(s);
        cudaEvent_t start = nullptr, end = nullptr;
        C10_CUDA_CHECK(cudaEventCreate(&start));
        C10_CUDA_CHECK(cudaEventCreate(&end));
        at::cuda::sleep(kCycles / 100);   // warm-up: the kernel's first launch loads it
        C10_CUDA_CHECK(cudaEventRecord(start, s.stream()));
        at::cuda::sleep(kCycles);
        C10_CUDA_CHECK(cudaEventRecord(end, s.stream()));
        C10_CUDA_CHECK(cudaEventSynchronize(end));
        float ms = 0;
        C10_CUDA_CHECK(cudaEventElapsedTime(&ms, start, end));
        C10_CUDA_CHECK(cudaEventDestroy(start));
        C10_CUDA_CHECK(cudaEventDestroy(end));
        return ms > 0 ? (double)kCycles / ms : 1.0e6;
    }

    void *stream() const { return (void *)c10::cuda::getCurrentCUDAStream(dev_.index()).stream(); }

    // fp32 view of a gradient slice: low-precision ones are converted into a
    // persistent scratch buffer (grown, never shrunk: no allocation per step).
    const float *f32(const at::Tensor &grad) {
        if (rdt_ == ZX_F32) return grad.data_ptr<float>();
        if (!scratch_.defined() || scratch_.numel() < grad.numel())
            scratch_ = at::empty({grad.numel()}, at::TensorOptions().dtype(at::kFloat).device(dev_));
        zx_check(zx_cuda_cast_to_f32((size_t)grad.numel(), grad.data_ptr(), rdt_, scratch_.data_ptr<float>(),
                                     stream()),
                 "CUDA gradient conversion");
        return scratch_.data_ptr<float>();
    }

    at::Device dev_;
    zx_dtype rdt_;
    at::Tensor scratch_, out2_;
    std::optional<c10::cuda::CUDAStream> delay_stream_, prev_stream_;
    cudaEvent_t ready_ = nullptr;   // the current stream's point the delay starts from
    double cycles_per_ms_ = 0;
};

}  // namespace

std::unique_ptr<Kernels> make_cuda_kernels(const at::Device &device, zx_dtype rdt) {
    return std::make_unique<CudaKernels>(device, rdt);
}

}  // namespace zx

#else  // !ZX_WITH_CUDA

namespace zx {
std::unique_ptr<Kernels> make_cuda_kernels(const at::Device &, zx_dtype) { return nullptr; }
}  // namespace zx

#endif
