// cuda_binding.cpp — torch-facing wrappers of the CUDA kernels (csrc/cuda/zx_cuda.h).
//
// zx_bind_cuda(m) adds cuda_adam_step, cuda_adam_step_bf16_states, cuda_sgd_step, cuda_grad_sumsq,
// cuda_grad_sumsq_into, cuda_scale, cuda_sum_slices, cuda_cast_from_f32,
// cuda_cast_to_f32, cuda_master_join, cuda_master_split, cuda_adam_step_split, cuda_increment_step and cuda_quantize, cuda_dequantize,
// cuda_dequantize_sum to the extension module. They take
// CUDA tensors, check them (contiguous, one device, dtype, length), and enqueue
// the kernel on the current CUDA stream (at::cuda::getCurrentCUDAStream()) of the
// tensors' device; nothing
// synchronizes except cuda_grad_sumsq, which returns host numbers.
// Signatures are those of the CPU functions (adam_step, sgd_step, grad_sumsq, ...)
// without the leading `isa` argument.
//
// Built by setup.py only in the CUDA extension, with -DZX_WITH_CUDA and the .cu
// files of csrc/cuda; without ZX_WITH_CUDA zx_bind_cuda adds nothing, so the
// CPU-only build stays complete and the Python side tests for
// hasattr(zero_ext._C, "cuda_adam_step").
#include <torch/csrc/utils/pybind.h>   // pybind11 and its at::Tensor casters: a tenth of torch/extension.h's
#include <ATen/core/Tensor.h>          // parse time (tests/test_cuda_compile.py checks this file alone)
#include <ATen/ops/zeros.h>

void zx_bind_cuda(pybind11::module_ &m);

#ifdef ZX_WITH_CUDA

#include <c10/cuda/CUDAGuard.h>   // c10::cuda::CUDAGuard
#include <c10/cuda/CUDAStream.h>  // c10::cuda::getCurrentCUDAStream (= at::cuda::getCurrentCUDAStream,
                                  // without ATen/cuda/CUDAContext.h's cuBLAS/cuSPARSE headers)

#include <optional>
#include <tuple>

#include "cuda/zx_cuda.h"
#include "kernels_binding.h"   // defines: adam_hparams_of, sgd_hparams_of

namespace {

// Turn a non-OK status into a Python RuntimeError naming the call.
void zx_check_status(zx_status st, const char *what) {
    TORCH_CHECK(st == ZX_OK, what, " failed: ", zx_status_string(st),
                " (a CUDA launch error reads as 'unsupported': check that the extension was built "
                "for this GPU's architecture, see setup.py's -gencode list)");
}

// t is a contiguous CUDA tensor of dtype `dtype` on `device` with `numel` elements.
void zx_check_tensor(const at::Tensor &t, const char *name, at::ScalarType dtype,
                     const at::Device &device, int64_t numel) {
    TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor (got ", t.device(), ")");
    TORCH_CHECK(t.device() == device, name, " is on ", t.device(), " but the parameter is on ", device,
                "; move all step tensors to one device");
    TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, " (got ", t.scalar_type(), ")");
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (call .contiguous() or use a flat shard)");
    TORCH_CHECK(numel < 0 || t.numel() == numel, name, " has ", t.numel(), " elements, expected ", numel);
}

// The zx_dtype of a low-precision copy-out tensor (bf16 or fp16 only).
zx_dtype zx_lp_dtype(const at::Tensor &t, const char *name) {
    if (t.scalar_type() == at::kBFloat16) return ZX_BF16;
    if (t.scalar_type() == at::kHalf) return ZX_F16;
    TORCH_CHECK(false, name, " must be bfloat16 or float16 (got ", t.scalar_type(), ")");
    return ZX_F32;
}

zx_dtype zx_any_dtype(const at::Tensor &t, const char *name) {
    if (t.scalar_type() == at::kFloat) return ZX_F32;
    return zx_lp_dtype(t, name);
}

// The current stream of the current device (set by the CUDAGuard before each call).
void *zx_current_stream() { return static_cast<void *>(c10::cuda::getCurrentCUDAStream().stream()); }

// The AMSGrad maximum (n fp32 on device) when amsgrad, else null.
float *zx_vmax_ptr(bool amsgrad, const std::optional<at::Tensor> &max_exp_avg_sq, const at::Device &device,
                   int64_t n) {
    if (!amsgrad) return nullptr;
    TORCH_CHECK(max_exp_avg_sq.has_value(), "amsgrad=True needs max_exp_avg_sq");
    zx_check_tensor(*max_exp_avg_sq, "max_exp_avg_sq", at::kFloat, device, n);
    return max_exp_avg_sq->data_ptr<float>();
}

// The step count in device memory (step_tensor, CUDA graphs), else null after checking the host step.
const int64_t *zx_device_step_ptr(const std::optional<at::Tensor> &step_tensor, int64_t step,
                                  const at::Device &device) {
    if (step_tensor.has_value()) {
        zx_check_tensor(*step_tensor, "step_tensor", at::kLong, device, 1);
        return step_tensor->data_ptr<int64_t>();
    }
    TORCH_CHECK(step >= 1, "step must be >= 1 (the count after this step's increment), got ", step);
    return nullptr;
}

void zx_py_cuda_adam_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                          std::optional<at::Tensor> max_exp_avg_sq, std::optional<at::Tensor> param_lp,
                          double lr, double beta1, double beta2, double eps, double weight_decay,
                          int64_t step, bool decoupled, bool amsgrad, bool maximize, double grad_scale,
                          std::optional<at::Tensor> step_tensor) {
    TORCH_CHECK(param.is_cuda(), "param must be a CUDA tensor (use adam_step for CPU tensors)");
    const at::Device device = param.device();
    const int64_t n = param.numel();
    zx_check_tensor(param, "param", at::kFloat, device, n);
    zx_check_tensor(grad, "grad", at::kFloat, device, n);
    zx_check_tensor(exp_avg, "exp_avg", at::kFloat, device, n);
    zx_check_tensor(exp_avg_sq, "exp_avg_sq", at::kFloat, device, n);
    float *max_ptr = zx_vmax_ptr(amsgrad, max_exp_avg_sq, device, n);
    void *lp_ptr = nullptr;
    zx_dtype lp_dtype = ZX_BF16;
    if (param_lp.has_value()) {
        lp_dtype = zx_lp_dtype(*param_lp, "param_lp");
        zx_check_tensor(*param_lp, "param_lp", param_lp->scalar_type(), device, n);
        lp_ptr = param_lp->data_ptr();
    }
    const int64_t *step_ptr = zx_device_step_ptr(step_tensor, step, device);
    const zx_adam_hparams hp = adam_hparams_of(lr, beta1, beta2, eps, weight_decay, step, decoupled, amsgrad,
                                               maximize, grad_scale);
    c10::cuda::CUDAGuard guard(device);
    zx_check_status(zx_cuda_adam_step((size_t)n, param.data_ptr<float>(), grad.data_ptr<float>(),
                                      exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), max_ptr,
                                      lp_ptr, lp_dtype, &hp, step_ptr, nullptr, zx_current_stream()),
                    "cuda_adam_step");
}

// exp_avg / exp_avg_sq are bfloat16; element i draws its random bits from counter
// offset + i (Note [Counter-based stochastic rounding], core/zx_sr.h). With step_tensor
// the kernel reads the step on the device and hashes with seed + step.
void zx_py_cuda_adam_step_bf16_states(at::Tensor param, at::Tensor grad, at::Tensor exp_avg,
                                      at::Tensor exp_avg_sq, std::optional<at::Tensor> param_lp, double lr,
                                      double beta1, double beta2, double eps, double weight_decay,
                                      int64_t step, bool decoupled, bool maximize, double grad_scale,
                                      uint64_t seed, uint64_t offset, std::optional<at::Tensor> step_tensor) {
    TORCH_CHECK(param.is_cuda(), "param must be a CUDA tensor (use adam_step_bf16_states for CPU tensors)");
    const at::Device device = param.device();
    const int64_t n = param.numel();
    zx_check_tensor(param, "param", at::kFloat, device, n);
    zx_check_tensor(grad, "grad", at::kFloat, device, n);
    zx_check_tensor(exp_avg, "exp_avg", at::kBFloat16, device, n);
    zx_check_tensor(exp_avg_sq, "exp_avg_sq", at::kBFloat16, device, n);
    void *lp_ptr = nullptr;
    zx_dtype lp_dtype = ZX_BF16;
    if (param_lp.has_value()) {
        lp_dtype = zx_lp_dtype(*param_lp, "param_lp");
        zx_check_tensor(*param_lp, "param_lp", param_lp->scalar_type(), device, n);
        lp_ptr = param_lp->data_ptr();
    }
    const int64_t *step_ptr = zx_device_step_ptr(step_tensor, step, device);
    const zx_adam_hparams hp = adam_hparams_of(lr, beta1, beta2, eps, weight_decay, step, decoupled, false,
                                               maximize, grad_scale);
    c10::cuda::CUDAGuard guard(device);
    zx_check_status(zx_cuda_adam_step_bf16_states(
                        (size_t)n, param.data_ptr<float>(), grad.data_ptr<float>(),
                        static_cast<uint16_t *>(exp_avg.data_ptr()), static_cast<uint16_t *>(exp_avg_sq.data_ptr()),
                        lp_ptr, lp_dtype, &hp, seed, offset, step_ptr, nullptr, zx_current_stream()),
                    "cuda_adam_step_bf16_states");
}

void zx_py_cuda_increment_step(at::Tensor step_tensor) {
    TORCH_CHECK(step_tensor.is_cuda(), "step_tensor must be a CUDA int64 tensor of one element");
    zx_check_tensor(step_tensor, "step_tensor", at::kLong, step_tensor.device(), 1);
    c10::cuda::CUDAGuard guard(step_tensor.device());
    zx_check_status(zx_cuda_increment_step(step_tensor.data_ptr<int64_t>(), zx_current_stream()),
                    "cuda_increment_step");
}

void zx_py_cuda_sgd_step(at::Tensor param, at::Tensor grad, std::optional<at::Tensor> momentum_buf,
                         std::optional<at::Tensor> param_lp, double lr, double momentum, double dampening,
                         double weight_decay, bool nesterov, bool maximize, bool first_step,
                         double grad_scale) {
    TORCH_CHECK(param.is_cuda(), "param must be a CUDA tensor (use sgd_step for CPU tensors)");
    const at::Device device = param.device();
    const int64_t n = param.numel();
    zx_check_tensor(param, "param", at::kFloat, device, n);
    zx_check_tensor(grad, "grad", at::kFloat, device, n);
    float *buf_ptr = nullptr;
    if (momentum != 0.0) {
        TORCH_CHECK(momentum_buf.has_value(), "momentum != 0 needs momentum_buf");
        zx_check_tensor(*momentum_buf, "momentum_buf", at::kFloat, device, n);
        buf_ptr = momentum_buf->data_ptr<float>();
    }
    void *lp_ptr = nullptr;
    zx_dtype lp_dtype = ZX_BF16;
    if (param_lp.has_value()) {
        lp_dtype = zx_lp_dtype(*param_lp, "param_lp");
        zx_check_tensor(*param_lp, "param_lp", param_lp->scalar_type(), device, n);
        lp_ptr = param_lp->data_ptr();
    }
    const zx_sgd_hparams hp = sgd_hparams_of(lr, momentum, dampening, weight_decay, nesterov, maximize,
                                             first_step, grad_scale);
    c10::cuda::CUDAGuard guard(device);
    zx_check_status(zx_cuda_sgd_step((size_t)n, param.data_ptr<float>(), grad.data_ptr<float>(), buf_ptr,
                                     lp_ptr, lp_dtype, &hp, nullptr, nullptr, zx_current_stream()),
                    "cuda_sgd_step");
}

// Accumulate into a device float[2] (no synchronization): out2 += [sumsq, nonfinite].
void zx_py_cuda_grad_sumsq_into(at::Tensor grad, double scale, at::Tensor out2) {
    TORCH_CHECK(grad.is_cuda(), "grad must be a CUDA tensor (use grad_sumsq for CPU tensors)");
    zx_check_tensor(grad, "grad", at::kFloat, grad.device(), -1);
    zx_check_tensor(out2, "out2", at::kFloat, grad.device(), 2);
    c10::cuda::CUDAGuard guard(grad.device());
    zx_check_status(zx_cuda_grad_sumsq((size_t)grad.numel(), grad.data_ptr<float>(), (float)scale,
                                       out2.data_ptr<float>(), zx_current_stream()),
                    "cuda_grad_sumsq");
}

// (sumsq, nonfinite) as host numbers: waits for the stream.
std::tuple<double, int64_t> zx_py_cuda_grad_sumsq(at::Tensor grad, double scale) {
    TORCH_CHECK(grad.is_cuda(), "grad must be a CUDA tensor (use grad_sumsq for CPU tensors)");
    at::Tensor out2 = at::zeros({2}, grad.options().dtype(at::kFloat));
    zx_py_cuda_grad_sumsq_into(grad, scale, out2);
    at::Tensor host = out2.cpu();
    const float *h = host.data_ptr<float>();
    return std::make_tuple((double)h[0], (int64_t)h[1]);
}

// The step control kernels (Note [Step control] in csrc/core/zx_step_control.h; kernels in csrc/cuda/zx_cuda_control.h).
// scaler: the uint8 CUDA tensor holding a zx_loss_scaler (LossScaler.to_bytes()), or None.
zx_loss_scaler *zx_scaler_ptr(const std::optional<at::Tensor> &scaler, const at::Device &device) {
    if (!scaler.has_value()) return nullptr;
    zx_check_tensor(*scaler, "scaler", at::kByte, device, (int64_t)sizeof(zx_loss_scaler));
    return reinterpret_cast<zx_loss_scaler *>(scaler->data_ptr());
}

void zx_py_cuda_clip_control(at::Tensor ctl, at::Tensor out2, double divisor, std::optional<at::Tensor> scaler,
                             double max_norm, at::Tensor norm_out) {
    TORCH_CHECK(ctl.is_cuda(), "ctl must be a CUDA float64 tensor of ", ZX_CTL_SIZE, " elements");
    zx_check_tensor(ctl, "ctl", at::kDouble, ctl.device(), ZX_CTL_SIZE);
    zx_check_tensor(out2, "out2", at::kFloat, ctl.device(), 2);
    zx_check_tensor(norm_out, "norm_out", at::kFloat, ctl.device(), 1);
    c10::cuda::CUDAGuard guard(ctl.device());
    zx_check_status(zx_cuda_clip_control(ctl.data_ptr<double>(), out2.data_ptr<float>(), divisor,
                                         zx_scaler_ptr(scaler, ctl.device()), max_norm, norm_out.data_ptr<float>(),
                                         zx_current_stream()),
                    "cuda_clip_control");
}

void zx_py_cuda_step_control(at::Tensor ctl, std::optional<at::Tensor> out2, double divisor,
                             std::optional<at::Tensor> scaler, std::optional<at::Tensor> scale_out,
                             at::Tensor steps) {
    TORCH_CHECK(ctl.is_cuda(), "ctl must be a CUDA float64 tensor of ", ZX_CTL_SIZE, " elements");
    const at::Device device = ctl.device();
    zx_check_tensor(ctl, "ctl", at::kDouble, device, ZX_CTL_SIZE);
    if (out2.has_value()) zx_check_tensor(*out2, "out2", at::kFloat, device, 2);
    if (scale_out.has_value()) zx_check_tensor(*scale_out, "scale_out", at::kFloat, device, 1);
    zx_check_tensor(steps, "steps", at::kLong, device, -1);
    c10::cuda::CUDAGuard guard(device);
    zx_check_status(zx_cuda_step_control(ctl.data_ptr<double>(), out2 ? out2->data_ptr<float>() : nullptr, divisor,
                                         zx_scaler_ptr(scaler, device),
                                         scale_out ? scale_out->data_ptr<float>() : nullptr,
                                         steps.data_ptr<int64_t>(), (int32_t)steps.numel(), zx_current_stream()),
                    "cuda_step_control");
}

void zx_py_cuda_scale(at::Tensor x, double s) {
    TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor (use scale for CPU tensors)");
    zx_check_tensor(x, "x", at::kFloat, x.device(), -1);
    c10::cuda::CUDAGuard guard(x.device());
    zx_check_status(zx_cuda_scale((size_t)x.numel(), x.data_ptr<float>(), (float)s, zx_current_stream()),
                    "cuda_scale");
}

// dst (slice_n,) = (accumulate ? dst : 0) + scale * sum of the nslices slices of src (nslices*slice_n,).
void zx_py_cuda_sum_slices(at::Tensor src, at::Tensor dst, int64_t nslices, bool accumulate, double scale) {
    TORCH_CHECK(dst.is_cuda(), "dst must be a CUDA tensor (use sum_slices for CPU tensors)");
    TORCH_CHECK(nslices >= 1 && nslices <= INT32_MAX, "nslices must be in [1, 2^31), got ", nslices);
    const int64_t slice_n = dst.numel();
    zx_check_tensor(dst, "dst", at::kFloat, dst.device(), slice_n);
    zx_check_tensor(src, "src", at::kFloat, dst.device(), nslices * slice_n);
    c10::cuda::CUDAGuard guard(dst.device());
    zx_check_status(zx_cuda_sum_slices((size_t)slice_n, (int32_t)nslices, src.data_ptr<float>(),
                                       dst.data_ptr<float>(), accumulate ? 1 : 0, (float)scale,
                                       zx_current_stream()),
                    "cuda_sum_slices (dst may alias src's slice 0 only with accumulate=False)");
}

// dst = src.to(dst.dtype), round to nearest even; dst bf16/fp16/fp32.
void zx_py_cuda_cast_from_f32(at::Tensor src, at::Tensor dst) {
    TORCH_CHECK(src.is_cuda(), "src must be a CUDA tensor (use cast_from_f32 for CPU tensors)");
    zx_check_tensor(src, "src", at::kFloat, src.device(), -1);
    zx_dtype dst_dtype = zx_any_dtype(dst, "dst");
    zx_check_tensor(dst, "dst", dst.scalar_type(), src.device(), src.numel());
    c10::cuda::CUDAGuard guard(src.device());
    zx_check_status(zx_cuda_cast_from_f32((size_t)src.numel(), src.data_ptr<float>(), dst.data_ptr(),
                                          dst_dtype, zx_current_stream()),
                    "cuda_cast_from_f32");
}

// dst (fp32) = src (bf16/fp16/fp32), exact.
void zx_py_cuda_cast_to_f32(at::Tensor src, at::Tensor dst) {
    TORCH_CHECK(dst.is_cuda(), "dst must be a CUDA tensor (use cast_to_f32 for CPU tensors)");
    zx_check_tensor(dst, "dst", at::kFloat, dst.device(), -1);
    zx_dtype src_dtype = zx_any_dtype(src, "src");
    zx_check_tensor(src, "src", src.scalar_type(), dst.device(), dst.numel());
    c10::cuda::CUDAGuard guard(dst.device());
    zx_check_status(zx_cuda_cast_to_f32((size_t)dst.numel(), src.data_ptr(), src_dtype,
                                        dst.data_ptr<float>(), zx_current_stream()),
                    "cuda_cast_to_f32");
}

// ---- split master (Note [Split master], zx_master_split.c): hi is the bf16 parameter ----

void zx_check_split_master(const at::Tensor &hi, const at::Tensor &rem, const at::Tensor &ties) {
    TORCH_CHECK(hi.is_cuda(), "hi must be a CUDA tensor");
    zx_check_tensor(hi, "hi", at::kBFloat16, hi.device(), -1);
    zx_check_tensor(rem, "rem", at::kShort, hi.device(), hi.numel());
    zx_check_tensor(ties, "ties", at::kByte, hi.device(), (hi.numel() + 7) / 8);
}

// out (fp32) = the masters of (hi, rem, ties), bit for bit.
void zx_py_cuda_master_join(at::Tensor hi, at::Tensor rem, at::Tensor ties, at::Tensor out) {
    zx_check_split_master(hi, rem, ties);
    zx_check_tensor(out, "out", at::kFloat, hi.device(), hi.numel());
    c10::cuda::CUDAGuard guard(hi.device());
    zx_check_status(zx_cuda_master_join((size_t)hi.numel(), reinterpret_cast<const uint16_t *>(hi.data_ptr()),
                                        rem.data_ptr<int16_t>(), ties.data_ptr<uint8_t>(), out.data_ptr<float>(),
                                        zx_current_stream()),
                    "cuda_master_join");
}

// rem and ties of the masters m (fp32), whose bf16 rounding is hi.
void zx_py_cuda_master_split(at::Tensor m, at::Tensor hi, at::Tensor rem, at::Tensor ties) {
    zx_check_split_master(hi, rem, ties);
    zx_check_tensor(m, "m", at::kFloat, hi.device(), hi.numel());
    c10::cuda::CUDAGuard guard(hi.device());
    zx_check_status(zx_cuda_master_split((size_t)hi.numel(), m.data_ptr<float>(),
                                         reinterpret_cast<const uint16_t *>(hi.data_ptr()),
                                         rem.data_ptr<int16_t>(), ties.data_ptr<uint8_t>(), zx_current_stream()),
                    "cuda_master_split");
}

// One Adam/AdamW step of the split masters (hi, rem, ties) in one pass (Note [Fused
// split-master step], zx_cuda_master_split.cu): elements [lead, lead + grad.numel()) of
// hi step, with grad, exp_avg, exp_avg_sq (fp32) indexed from the first of them.
void zx_py_cuda_adam_step_split(at::Tensor hi, at::Tensor rem, at::Tensor ties, at::Tensor grad,
                                at::Tensor exp_avg, at::Tensor exp_avg_sq, std::optional<at::Tensor> max_exp_avg_sq,
                                double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                                bool decoupled, bool amsgrad, bool maximize, double grad_scale, int64_t lead,
                                std::optional<at::Tensor> step_tensor) {
    zx_check_split_master(hi, rem, ties);
    const int64_t n = grad.numel(), total = hi.numel();
    TORCH_CHECK(lead >= 0 && lead + n <= total && total - lead - n < 8, "the stepped elements [lead, lead + ",
                "grad.numel()) must end less than 8 elements before hi does (one tie byte); got lead=", lead,
                ", grad.numel()=", n, ", hi.numel()=", total);
    for (const auto &[t, name] : {std::pair<const at::Tensor &, const char *>{grad, "grad"}, {exp_avg, "exp_avg"},
                                  {exp_avg_sq, "exp_avg_sq"}})
        zx_check_tensor(t, name, at::kFloat, hi.device(), n);
    float *max_ptr = zx_vmax_ptr(amsgrad, max_exp_avg_sq, hi.device(), n);
    const int64_t *step_ptr = zx_device_step_ptr(step_tensor, step, hi.device());
    const zx_adam_hparams hp = adam_hparams_of(lr, beta1, beta2, eps, weight_decay, step, decoupled, amsgrad,
                                               maximize, grad_scale);
    c10::cuda::CUDAGuard guard(hi.device());
    zx_check_status(zx_cuda_adam_step_split((size_t)total, (size_t)lead, (size_t)n,
                                            reinterpret_cast<uint16_t *>(hi.data_ptr()), rem.data_ptr<int16_t>(),
                                            ties.data_ptr<uint8_t>(), grad.data_ptr<float>(),
                                            exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), max_ptr, &hp,
                                            step_ptr, nullptr, zx_current_stream()),
                    "cuda_adam_step_split");
}

// ---- blockwise quantization (zx_cuda_quant.cu); formats as quant_sizes / quantize on the CPU ----

// (bytes of codes, blocks) of a payload of n elements; raises for a bad format.
std::tuple<int64_t, int64_t> zx_cuda_quant_sizes(int64_t bits, int64_t block_numel, int64_t n) {
    TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
    TORCH_CHECK(block_numel >= 1 && (bits == 8 || block_numel % 2 == 0), "block_numel must be ",
                bits == 4 ? "a positive even number for bits=4" : ">= 1", ", got ", block_numel);
    size_t bytes = 0;
    zx_check_status(zx_quant_bytes((int32_t)bits, (size_t)block_numel, (size_t)n, &bytes), "quant_bytes");
    return {(int64_t)bytes, (int64_t)zx_quant_blocks((size_t)n, (size_t)block_numel)};
}

void zx_py_cuda_quantize(int64_t bits, int64_t block_numel, at::Tensor src, at::Tensor q, at::Tensor scales,
                         std::optional<at::Tensor> residual) {
    TORCH_CHECK(src.is_cuda(), "src must be a CUDA tensor (use quantize for CPU tensors)");
    const at::Device device = src.device();
    const int64_t n = src.numel();
    zx_dtype dt = zx_any_dtype(src, "src");
    zx_check_tensor(src, "src", src.scalar_type(), device, n);
    auto [bytes, nblocks] = zx_cuda_quant_sizes(bits, block_numel, n);
    zx_check_tensor(q, "q", at::kByte, device, bytes);
    zx_check_tensor(scales, "scales", at::kFloat, device, nblocks);
    float *r = nullptr;
    if (residual) {
        zx_check_tensor(*residual, "residual", at::kFloat, device, n);
        r = residual->data_ptr<float>();
    }
    c10::cuda::CUDAGuard guard(device);
    zx_check_status(zx_cuda_quantize((int32_t)bits, (size_t)block_numel, (size_t)n, src.data_ptr(), dt, r,
                                     q.data_ptr(), scales.data_ptr<float>(), zx_current_stream()),
                    "cuda_quantize");
}

void zx_py_cuda_dequantize(int64_t bits, int64_t block_numel, at::Tensor q, at::Tensor scales, at::Tensor dst) {
    TORCH_CHECK(dst.is_cuda(), "dst must be a CUDA tensor (use dequantize for CPU tensors)");
    const at::Device device = dst.device();
    const int64_t n = dst.numel();
    zx_dtype dt = zx_any_dtype(dst, "dst");
    zx_check_tensor(dst, "dst", dst.scalar_type(), device, n);
    auto [bytes, nblocks] = zx_cuda_quant_sizes(bits, block_numel, n);
    zx_check_tensor(q, "q", at::kByte, device, bytes);
    zx_check_tensor(scales, "scales", at::kFloat, device, nblocks);
    c10::cuda::CUDAGuard guard(device);
    zx_check_status(zx_cuda_dequantize((int32_t)bits, (size_t)block_numel, (size_t)n, q.data_ptr(),
                                       scales.data_ptr<float>(), dst.data_ptr(), dt, zx_current_stream()),
                    "cuda_dequantize");
}

void zx_py_cuda_dequantize_sum(int64_t bits, int64_t block_numel, at::Tensor q, at::Tensor scales,
                               int64_t nslices, at::Tensor dst, bool accumulate, double scale) {
    TORCH_CHECK(dst.is_cuda(), "dst must be a CUDA tensor (use dequantize_sum for CPU tensors)");
    TORCH_CHECK(nslices >= 1 && nslices <= INT32_MAX, "nslices must be in [1, 2^31), got ", nslices);
    const at::Device device = dst.device();
    const int64_t n = dst.numel();
    zx_check_tensor(dst, "dst", at::kFloat, device, n);
    auto [bytes, nblocks] = zx_cuda_quant_sizes(bits, block_numel, n);
    zx_check_tensor(q, "q", at::kByte, device, bytes * nslices);
    zx_check_tensor(scales, "scales", at::kFloat, device, nblocks * nslices);
    c10::cuda::CUDAGuard guard(device);
    zx_check_status(zx_cuda_dequantize_sum((int32_t)bits, (size_t)block_numel, (size_t)n, (int32_t)nslices,
                                           (size_t)nblocks, q.data_ptr(), scales.data_ptr<float>(),
                                           dst.data_ptr<float>(), accumulate ? 1 : 0, (float)scale,
                                           zx_current_stream()),
                    "cuda_dequantize_sum");
}

}  // namespace

void zx_bind_cuda(pybind11::module_ &m) {
    namespace py = pybind11;
    m.def("cuda_adam_step", &zx_py_cuda_adam_step,
          "One Adam/AdamW step on CUDA tensors (fp32 state, optional bf16/fp16 copy-out). "
          "step_tensor: optional CUDA int64 (1,) read on the device instead of `step` (CUDA graphs).",
          py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
          py::arg("max_exp_avg_sq"), py::arg("param_lp"), py::arg("lr"), py::arg("beta1"),
          py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
          py::arg("decoupled"), py::arg("amsgrad"), py::arg("maximize"), py::arg("grad_scale"),
          py::kw_only(), py::arg("step_tensor") = py::none());
    m.def("cuda_adam_step_bf16_states", &zx_py_cuda_adam_step_bf16_states,
          "adam_step_bf16_states on CUDA tensors (bf16 exp_avg/exp_avg_sq, stochastic rounding from "
          "(seed, offset + i), bit-identical to the CPU kernel). step_tensor: optional CUDA int64 (1,) "
          "read on the device instead of `step`; the hash then uses seed + step.",
          py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("param_lp"),
          py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
          py::arg("step"), py::arg("decoupled"), py::arg("maximize"), py::arg("grad_scale"), py::arg("seed"),
          py::arg("offset") = 0, py::kw_only(), py::arg("step_tensor") = py::none());
    m.def("cuda_increment_step", &zx_py_cuda_increment_step,
          "step_tensor += 1 on the current stream (pairs with cuda_adam_step(step_tensor=...)).",
          py::arg("step_tensor"));
    m.def("cuda_sgd_step", &zx_py_cuda_sgd_step,
          "One SGD step on CUDA tensors (momentum, dampening, Nesterov; optional copy-out).",
          py::arg("param"), py::arg("grad"), py::arg("momentum_buf"), py::arg("param_lp"), py::arg("lr"),
          py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"),
          py::arg("maximize"), py::arg("first_step"), py::arg("grad_scale"));
    m.def("cuda_grad_sumsq", &zx_py_cuda_grad_sumsq,
          "(sum of (grad*scale)^2 over finite elements, count of inf/nan) of a CUDA tensor; synchronizes.",
          py::arg("grad"), py::arg("scale"));
    m.def("cuda_grad_sumsq_into", &zx_py_cuda_grad_sumsq_into,
          "out2 (CUDA float32 (2,)) += [sumsq, nonfinite] without synchronizing.",
          py::arg("grad"), py::arg("scale"), py::arg("out2"));
    m.def("cuda_clip_control", &zx_py_cuda_clip_control,
          "After a gradient scan into out2: the norm into norm_out, the clip factor and overflow flag into ctl.",
          py::arg("ctl"), py::arg("out2"), py::arg("divisor"), py::arg("scaler"), py::arg("max_norm"),
          py::arg("norm_out"));
    m.def("cuda_step_control", &zx_py_cuda_step_control,
          "At step(): the gradient multiplier, the skip verdict, the loss-scale update and the step counts, "
          "on the device.",
          py::arg("ctl"), py::arg("out2"), py::arg("divisor"), py::arg("scaler"), py::arg("scale_out"),
          py::arg("steps"));
    m.def("cuda_scale", &zx_py_cuda_scale, "x *= s on a CUDA float32 tensor.", py::arg("x"), py::arg("s"));
    m.def("cuda_sum_slices", &zx_py_cuda_sum_slices,
          "dst = (accumulate ? dst : 0) + scale * sum_j src[j*len(dst):(j+1)*len(dst)], j increasing.",
          py::arg("src"), py::arg("dst"), py::arg("nslices"), py::arg("accumulate"), py::arg("scale"));
    m.def("cuda_cast_from_f32", &zx_py_cuda_cast_from_f32,
          "dst = src cast to dst.dtype (bf16/fp16 round to nearest even; fp32 copy).",
          py::arg("src"), py::arg("dst"));
    m.def("cuda_cast_to_f32", &zx_py_cuda_cast_to_f32, "dst (fp32) = src (bf16/fp16/fp32).",
          py::arg("src"), py::arg("dst"));
    m.def("cuda_master_join", &zx_py_cuda_master_join,
          "out (fp32) = the split masters (hi: the bf16 parameter, rem: int16, ties: uint8, one bit per "
          "element), bit for bit (Note [Split master]).",
          py::arg("hi"), py::arg("rem"), py::arg("ties"), py::arg("out"));
    m.def("cuda_master_split", &zx_py_cuda_master_split,
          "rem and ties of the fp32 masters m whose bf16 rounding is hi (Note [Split master]).",
          py::arg("m"), py::arg("hi"), py::arg("rem"), py::arg("ties"));
    m.def("cuda_adam_step_split", &zx_py_cuda_adam_step_split,
          "One Adam/AdamW step of the split masters (hi, rem, ties) in one pass: elements [lead, lead + "
          "grad.numel()) step; bit for bit cuda_master_join, cuda_adam_step into hi, cuda_master_split "
          "(Note [Fused split-master step]).",
          py::arg("hi"), py::arg("rem"), py::arg("ties"), py::arg("grad"), py::arg("exp_avg"),
          py::arg("exp_avg_sq"), py::arg("max_exp_avg_sq"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
          py::arg("eps"), py::arg("weight_decay"), py::arg("step"), py::arg("decoupled"), py::arg("amsgrad"),
          py::arg("maximize"), py::arg("grad_scale"), py::kw_only(), py::arg("lead") = 0,
          py::arg("step_tensor") = py::none());
    m.def("cuda_quantize", &zx_py_cuda_quantize,
          "quantize() on CUDA tensors: src (fp32/bf16/fp16) -> q (uint8) and scales (fp32), optional "
          "error-feedback residual; bit-identical to the CPU.",
          py::arg("bits"), py::arg("block_numel"), py::arg("src"), py::arg("q"), py::arg("scales"),
          py::arg("residual") = py::none());
    m.def("cuda_dequantize", &zx_py_cuda_dequantize, "dequantize() on CUDA tensors.", py::arg("bits"),
          py::arg("block_numel"), py::arg("q"), py::arg("scales"), py::arg("dst"));
    m.def("cuda_dequantize_sum", &zx_py_cuda_dequantize_sum, "dequantize_sum() on CUDA tensors.",
          py::arg("bits"), py::arg("block_numel"), py::arg("q"), py::arg("scales"), py::arg("nslices"),
          py::arg("dst"), py::arg("accumulate"), py::arg("scale"));
}

#else  // !ZX_WITH_CUDA

void zx_bind_cuda(pybind11::module_ &m) { (void)m; }

#endif  // ZX_WITH_CUDA
