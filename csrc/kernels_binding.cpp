// kernels_binding.cpp — torch-facing wrappers of the C core's CPU kernels.
//
// zx_bind_kernels(m) adds to the extension module (zero_ext._C):
//   isa_supported(name) -> bool          best_isa() -> str
//   adam_step, sgd_step                  one optimizer step on flat fp32 tensors
//   adam_step_bf16_states                Adam with bf16 exp_avg/exp_avg_sq, stochastic rounding
//   grad_sumsq(isa, grad, scale) -> (sumsq, nonfinite)
//   sum_slices, scale, cast_from_f32, cast_to_f32
//   quant_sizes, quantize, dequantize, dequantize_sum   blockwise int8/int4 (zx_quant*.c)
// Every function takes the isa by name ("scalar", "avx2", "avx512" or "auto") and
// contiguous CPU tensors (fp32; a copy-out param_lp is bf16 or fp16), checks them
// with messages that say what to fix, releases the GIL and splits the work over
// torch's intra-op threads (zx_parallel_for, parallel.h) — the threads come from
// torch.set_num_threads, not from OpenMP pragmas here.
//   parallel_threads_seen(numel) -> int  threads that entered such a loop (tests)
// Used by tests/test_kernels.py and benchmarks/bench_optimizer.py; the engine calls
// the C functions directly.
#include "kernels_binding.h"

#include <torch/extension.h>

#include "parallel.h"   // defines: zx_parallel_for, zx_parallel_blocks, zx_parallel_threads_seen

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

namespace py = pybind11;


// The Python spelling of a dtype, for error messages ("torch.float32").
std::string dtype_name(at::ScalarType t) {
    switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    default: return std::string("torch.") + c10::toString(t);
    }
}

// "auto" -> the best ISA; otherwise the named one, which this CPU must support.
zx_isa isa_arg(const std::string &name) {
    zx_isa isa = name == "auto" ? zx_cpu_best_isa() : parse_isa(name);
    TORCH_CHECK(zx_cpu_supports(isa), "zero_ext: this CPU cannot run isa='", name,
                "'; check isa_supported(name) first or pass isa='auto'");
    return isa;
}

// t is a contiguous CPU tensor of `dtype` with `numel` elements (numel < 0: any).
void check_cpu(const at::Tensor &t, const char *name, at::ScalarType dtype, int64_t numel) {
    TORCH_CHECK(t.device().is_cpu(), "zero_ext: ", name, " must be a CPU tensor (got ", t.device(),
                "); the cuda_* functions take CUDA tensors");
    TORCH_CHECK(t.scalar_type() == dtype, "zero_ext: ", name, " must be ", dtype_name(dtype), " (got ",
                dtype_name(t.scalar_type()), ")");
    TORCH_CHECK(t.is_contiguous(), "zero_ext: ", name,
                " must be contiguous (pass a flat shard or call .contiguous())");
    TORCH_CHECK(numel < 0 || t.numel() == numel, "zero_ext: ", name, " has ", t.numel(),
                " elements, expected ", numel, " (the same as param / dst)");
}

// The zx_dtype of a bf16/fp16 CPU tensor with `numel` elements.
zx_dtype check_lp(const at::Tensor &t, const char *name, int64_t numel) {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, "zero_ext: ", name,
                " must be torch.bfloat16 or torch.float16 (got ", dtype_name(t.scalar_type()), ")");
    check_cpu(t, name, t.scalar_type(), numel);
    return t.scalar_type() == at::kBFloat16 ? ZX_BF16 : ZX_F16;
}

// The zx_dtype of a bf16/fp16/fp32 CPU tensor with `numel` elements.
zx_dtype check_any(const at::Tensor &t, const char *name, int64_t numel) {
    if (t.scalar_type() == at::kFloat) {
        check_cpu(t, name, at::kFloat, numel);
        return ZX_F32;
    }
    return check_lp(t, name, numel);
}

// Run fn(lo, hi) -> zx_status over [0, n) on torch's intra-op threads without the
// GIL; throws for the first non-OK status once all tasks are done.
template <class F>
void parallel_status(int64_t n, const char *what, F &&fn) {
    std::atomic<int> status{ZX_OK};
    {
        py::gil_scoped_release no_gil;
        zx_parallel_for(n, [&](int64_t lo, int64_t hi) {
            zx_status s = fn(lo, hi);
            if (s != ZX_OK) status.store((int)s);
        });
    }
    zx_check((zx_status)status.load(), what);
}

uint16_t *lp_ptr(const std::optional<at::Tensor> &t) {
    return t ? static_cast<uint16_t *>(t->data_ptr()) : nullptr;
}

// Adam's fp32 states (n elements each, on the CPU); returns the AMSGrad maximum when
// amsgrad, else null. like: what the states are shaped like, for the message.
float *check_adam_states(int64_t n, const at::Tensor &grad, const at::Tensor &exp_avg, const at::Tensor &exp_avg_sq,
                         const std::optional<at::Tensor> &max_exp_avg_sq, bool amsgrad, const char *like) {
    check_cpu(grad, "grad", at::kFloat, n);
    check_cpu(exp_avg, "exp_avg", at::kFloat, n);
    check_cpu(exp_avg_sq, "exp_avg_sq", at::kFloat, n);
    TORCH_CHECK(!amsgrad || max_exp_avg_sq.has_value(),
                "zero_ext: amsgrad=True needs max_exp_avg_sq (a float32 tensor shaped like ", like, ")");
    if (!amsgrad) return nullptr;
    check_cpu(*max_exp_avg_sq, "max_exp_avg_sq", at::kFloat, n);
    return max_exp_avg_sq->data_ptr<float>();
}

void py_adam_step(const std::string &isa_name, at::Tensor param, at::Tensor grad, at::Tensor exp_avg,
                  at::Tensor exp_avg_sq, std::optional<at::Tensor> max_exp_avg_sq,
                  std::optional<at::Tensor> param_lp, double lr, double beta1, double beta2, double eps,
                  double weight_decay, int64_t step, bool decoupled, bool amsgrad, bool maximize,
                  double grad_scale) {
    const zx_isa isa = isa_arg(isa_name);
    const int64_t n = param.numel();
    check_cpu(param, "param", at::kFloat, n);
    float *v_max = check_adam_states(n, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, amsgrad, "param");
    zx_dtype lp_dtype = param_lp ? check_lp(*param_lp, "param_lp", n) : ZX_F32;
    const zx_adam_hparams hp = adam_hparams_of(lr, beta1, beta2, eps, weight_decay, step, decoupled, amsgrad,
                                               maximize, grad_scale);
    float *p = param.data_ptr<float>(), *m = exp_avg.data_ptr<float>(), *v = exp_avg_sq.data_ptr<float>();
    const float *g = grad.data_ptr<float>();
    uint16_t *lp = lp_ptr(param_lp);
    // n = 0 validates the hyperparameters even for an empty tensor
    zx_check(zx_adam_step(isa, 0, p, g, m, v, v_max, lp, lp_dtype, &hp),
             "adam_step (check lr >= 0, 0 <= betas < 1, eps >= 0, weight_decay >= 0, step >= 1)");
    parallel_status(n, "adam_step", [&](int64_t lo, int64_t hi) {
        return zx_adam_step(isa, (size_t)(hi - lo), p + lo, g + lo, m + lo, v + lo,
                            v_max ? v_max + lo : nullptr, lp ? lp + lo : nullptr, lp_dtype, &hp);
    });
}

// exp_avg / exp_avg_sq are torch.bfloat16; element i of the tensors draws its random
// bits from counter offset + i (Note [Counter-based stochastic rounding], core/zx_sr.h),
// so the threads' split of [0, n) does not change the result.
void py_adam_step_bf16_states(const std::string &isa_name, at::Tensor param, at::Tensor grad,
                              at::Tensor exp_avg, at::Tensor exp_avg_sq,
                              std::optional<at::Tensor> param_lp, double lr, double beta1, double beta2,
                              double eps, double weight_decay, int64_t step, bool decoupled, bool maximize,
                              double grad_scale, uint64_t seed, uint64_t offset) {
    const zx_isa isa = isa_arg(isa_name);
    const int64_t n = param.numel();
    check_cpu(param, "param", at::kFloat, n);
    check_cpu(grad, "grad", at::kFloat, n);
    check_cpu(exp_avg, "exp_avg", at::kBFloat16, n);
    check_cpu(exp_avg_sq, "exp_avg_sq", at::kBFloat16, n);
    zx_dtype lp_dtype = param_lp ? check_lp(*param_lp, "param_lp", n) : ZX_F32;
    const zx_adam_hparams hp = adam_hparams_of(lr, beta1, beta2, eps, weight_decay, step, decoupled, false,
                                               maximize, grad_scale);
    float *p = param.data_ptr<float>();
    const float *g = grad.data_ptr<float>();
    uint16_t *m = static_cast<uint16_t *>(exp_avg.data_ptr());
    uint16_t *v = static_cast<uint16_t *>(exp_avg_sq.data_ptr());
    uint16_t *lp = lp_ptr(param_lp);
    zx_check(zx_adam_step_bf16_states(isa, 0, p, g, m, v, lp, lp_dtype, &hp, seed, offset),
             "adam_step_bf16_states (check lr >= 0, 0 <= betas < 1, eps >= 0, weight_decay >= 0, "
             "step >= 1)");
    parallel_status(n, "adam_step_bf16_states", [&](int64_t lo, int64_t hi) {
        return zx_adam_step_bf16_states(isa, (size_t)(hi - lo), p + lo, g + lo, m + lo, v + lo,
                                        lp ? lp + lo : nullptr, lp_dtype, &hp, seed,
                                        offset + (uint64_t)lo);
    });
}

void py_sgd_step(const std::string &isa_name, at::Tensor param, at::Tensor grad,
                 std::optional<at::Tensor> momentum_buf, std::optional<at::Tensor> param_lp, double lr,
                 double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
                 bool first_step, double grad_scale) {
    const zx_isa isa = isa_arg(isa_name);
    const int64_t n = param.numel();
    check_cpu(param, "param", at::kFloat, n);
    check_cpu(grad, "grad", at::kFloat, n);
    TORCH_CHECK(momentum == 0.0 || momentum_buf.has_value(),
                "zero_ext: momentum != 0 needs momentum_buf (a float32 tensor shaped like param)");
    float *buf = nullptr;
    if (momentum != 0.0) {
        check_cpu(*momentum_buf, "momentum_buf", at::kFloat, n);
        buf = momentum_buf->data_ptr<float>();
    }
    zx_dtype lp_dtype = param_lp ? check_lp(*param_lp, "param_lp", n) : ZX_F32;
    const zx_sgd_hparams hp = sgd_hparams_of(lr, momentum, dampening, weight_decay, nesterov, maximize,
                                             first_step, grad_scale);
    float *p = param.data_ptr<float>();
    const float *g = grad.data_ptr<float>();
    uint16_t *lp = lp_ptr(param_lp);
    zx_check(zx_sgd_step(isa, 0, p, g, buf, lp, lp_dtype, &hp),
             "sgd_step (check lr >= 0, momentum >= 0, weight_decay >= 0; nesterov needs momentum > 0 "
             "and dampening 0)");
    parallel_status(n, "sgd_step", [&](int64_t lo, int64_t hi) {
        return zx_sgd_step(isa, (size_t)(hi - lo), p + lo, g + lo, buf ? buf + lo : nullptr,
                           lp ? lp + lo : nullptr, lp_dtype, &hp);
    });
}

// Chunks of kParallelGrainNumel are summed separately and their sums added in chunk
// order, so the result does not depend on the number of threads.
std::tuple<double, int64_t> py_grad_sumsq(const std::string &isa_name, at::Tensor grad, double scale) {
    const zx_isa isa = isa_arg(isa_name);
    check_cpu(grad, "grad", at::kFloat, -1);
    const int64_t n = grad.numel();
    const int64_t chunks = (n + kParallelGrainNumel - 1) / kParallelGrainNumel;
    std::vector<double> sums(chunks, 0.0);
    std::vector<int64_t> counts(chunks, 0);
    const float *g = grad.data_ptr<float>();
    std::atomic<int> status{ZX_OK};
    {
        py::gil_scoped_release no_gil;
        at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
            for (int64_t c = c0; c < c1; c++) {
                int64_t lo = c * kParallelGrainNumel, hi = std::min(n, lo + kParallelGrainNumel);
                zx_status s = zx_grad_sumsq(isa, (size_t)(hi - lo), g + lo, (float)scale, &sums[c],
                                            &counts[c]);
                if (s != ZX_OK) status.store((int)s);
            }
        });
    }
    zx_check((zx_status)status.load(), "grad_sumsq");
    double sumsq = 0.0;
    int64_t nonfinite = 0;
    for (int64_t c = 0; c < chunks; c++) {
        sumsq += sums[c];
        nonfinite += counts[c];
    }
    return {sumsq, nonfinite};
}

// One call on the whole slice: zx_sum_slices has no stride argument, so a
// sub-range of dst cannot be handed to another thread.
void py_sum_slices(const std::string &isa_name, at::Tensor src, int64_t nslices, at::Tensor dst,
                   bool accumulate, double scale) {
    const zx_isa isa = isa_arg(isa_name);
    TORCH_CHECK(nslices >= 1 && nslices <= INT32_MAX, "zero_ext: nslices must be >= 1, got ", nslices);
    check_cpu(dst, "dst", at::kFloat, -1);
    check_cpu(src, "src", at::kFloat, nslices * dst.numel());
    const float *s = src.data_ptr<float>();
    float *d = dst.data_ptr<float>();
    zx_status st;
    {
        py::gil_scoped_release no_gil;
        st = zx_sum_slices(isa, (size_t)dst.numel(), (int32_t)nslices, s, d, accumulate, (float)scale);
    }
    zx_check(st, "sum_slices (dst may overlap src only as its slice 0 with accumulate=False)");
}

void py_scale(const std::string &isa_name, at::Tensor x, double s) {
    const zx_isa isa = isa_arg(isa_name);
    check_cpu(x, "x", at::kFloat, -1);
    float *p = x.data_ptr<float>();
    parallel_status(x.numel(), "scale", [&](int64_t lo, int64_t hi) {
        return zx_scale(isa, (size_t)(hi - lo), p + lo, (float)s);
    });
}

void py_cast_from_f32(const std::string &isa_name, at::Tensor src, at::Tensor dst) {
    const zx_isa isa = isa_arg(isa_name);
    check_cpu(src, "src", at::kFloat, -1);
    const zx_dtype dt = check_any(dst, "dst", src.numel());
    const float *s = src.data_ptr<float>();
    char *d = static_cast<char *>(dst.data_ptr());
    const size_t elem_bytes = zx_dtype_size(dt);
    parallel_status(src.numel(), "cast_from_f32", [&](int64_t lo, int64_t hi) {
        return zx_cast_from_f32(isa, (size_t)(hi - lo), s + lo, d + (size_t)lo * elem_bytes, dt);
    });
}

void py_cast_to_f32(const std::string &isa_name, at::Tensor src, at::Tensor dst) {
    const zx_isa isa = isa_arg(isa_name);
    check_cpu(dst, "dst", at::kFloat, -1);
    const zx_dtype dt = check_any(src, "src", dst.numel());
    const char *s = static_cast<const char *>(src.data_ptr());
    float *d = dst.data_ptr<float>();
    const size_t elem_bytes = zx_dtype_size(dt);
    parallel_status(dst.numel(), "cast_to_f32", [&](int64_t lo, int64_t hi) {
        return zx_cast_to_f32(isa, (size_t)(hi - lo), s + (size_t)lo * elem_bytes, dt, d + lo);
    });
}

// ---- split master (Note [Split master], zx_master_split.c): hi is the bf16 parameter ----
// One call over the whole range (a tie byte holds 8 elements; the engine's own calls
// are split by MasterSplit, csrc/engine/master_split.h).

void check_split_master(const at::Tensor &hi, const at::Tensor &rem, const at::Tensor &ties) {
    check_cpu(hi, "hi", at::kBFloat16, -1);
    check_cpu(rem, "rem", at::kShort, hi.numel());
    check_cpu(ties, "ties", at::kByte, (hi.numel() + 7) / 8);
}

void py_master_join(const std::string &isa_name, at::Tensor hi, at::Tensor rem, at::Tensor ties, at::Tensor out) {
    const zx_isa isa = isa_arg(isa_name);
    check_split_master(hi, rem, ties);
    check_cpu(out, "out", at::kFloat, hi.numel());
    zx_check(zx_master_join(isa, (size_t)hi.numel(), reinterpret_cast<const uint16_t *>(hi.data_ptr()),
                            rem.data_ptr<int16_t>(), ties.data_ptr<uint8_t>(), out.data_ptr<float>()),
             "master_join");
}

void py_master_split(const std::string &isa_name, at::Tensor m, at::Tensor hi, at::Tensor rem, at::Tensor ties) {
    const zx_isa isa = isa_arg(isa_name);
    check_split_master(hi, rem, ties);
    check_cpu(m, "m", at::kFloat, hi.numel());
    zx_check(zx_master_split(isa, (size_t)hi.numel(), m.data_ptr<float>(),
                             reinterpret_cast<const uint16_t *>(hi.data_ptr()), rem.data_ptr<int16_t>(),
                             ties.data_ptr<uint8_t>()),
             "master_split");
}

// Note [Fused split-master step]: one Adam/AdamW step of the masters (hi, rem, ties), in one
// pass; elements [lead, lead + grad.numel()) step, the states indexed from the first of them.
// One call, on the calling thread (the engine's table splits it over tasks).
void py_adam_step_split(const std::string &isa_name, at::Tensor hi, at::Tensor rem, at::Tensor ties, at::Tensor grad,
                        at::Tensor exp_avg, at::Tensor exp_avg_sq, std::optional<at::Tensor> max_exp_avg_sq,
                        double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                        bool decoupled, bool amsgrad, bool maximize, double grad_scale, int64_t lead) {
    const zx_isa isa = isa_arg(isa_name);
    check_split_master(hi, rem, ties);
    const int64_t n = grad.numel(), total = hi.numel();
    TORCH_CHECK(lead >= 0 && lead + n <= total && total - lead - n < 8, "zero_ext: the stepped elements [lead, ",
                "lead + grad.numel()) must end less than 8 elements before hi does (one tie byte); got lead=", lead,
                ", grad.numel()=", n, ", hi.numel()=", total);
    float *v_max = check_adam_states(n, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, amsgrad, "grad");
    const zx_adam_hparams hp = adam_hparams_of(lr, beta1, beta2, eps, weight_decay, step, decoupled, amsgrad,
                                               maximize, grad_scale);
    zx_check(zx_adam_step_split(isa, (size_t)total, (size_t)lead, (size_t)n,
                                reinterpret_cast<uint16_t *>(hi.data_ptr()), rem.data_ptr<int16_t>(),
                                ties.data_ptr<uint8_t>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                                exp_avg_sq.data_ptr<float>(), v_max, &hp),
             "adam_step_split (check lr >= 0, 0 <= betas < 1, eps >= 0, weight_decay >= 0, step >= 1)");
}

// ---- blockwise quantization (zx_quant*.c) ----

// Bytes of codes and blocks of a payload of n elements; raises for a bad format.
std::tuple<int64_t, int64_t> quant_sizes(int64_t bits, int64_t block_numel, int64_t n) {
    TORCH_CHECK(bits == 8 || bits == 4, "zero_ext: bits must be 8 or 4, got ", bits);
    TORCH_CHECK(block_numel >= 1 && (bits == 8 || block_numel % 2 == 0), "zero_ext: block_numel must be ",
                bits == 4 ? "a positive even number for bits=4" : ">= 1", ", got ", block_numel);
    TORCH_CHECK(n >= 0, "zero_ext: n must be >= 0");
    size_t bytes = 0;
    zx_check(zx_quant_bytes((int32_t)bits, (size_t)block_numel, (size_t)n, &bytes), "quant_bytes");
    return {(int64_t)bytes, (int64_t)zx_quant_blocks((size_t)n, (size_t)block_numel)};
}

// fn(first block, lo, hi) over whole blocks of [0, n) (zx_parallel_blocks), without the GIL;
// the first failing status raises.
template <class F>
void parallel_blocks(int64_t n, int64_t block_numel, const char *what, F &&fn) {
    std::atomic<int> status{ZX_OK};
    {
        py::gil_scoped_release no_gil;
        zx_parallel_blocks(n, block_numel, [&](int64_t b0, int64_t lo, int64_t hi) {
            zx_status s = fn(b0, lo, hi);
            if (s != ZX_OK) status.store((int)s);
        });
    }
    zx_check((zx_status)status.load(), what);
}

void check_payload(const at::Tensor &q, const at::Tensor &scales, int64_t bytes, int64_t nblocks) {
    check_cpu(q, "q", at::kByte, bytes);
    check_cpu(scales, "scales", at::kFloat, nblocks);
}

void py_quantize(const std::string &isa_name, int64_t bits, int64_t block_numel, at::Tensor src,
                 at::Tensor q, at::Tensor scales, std::optional<at::Tensor> residual) {
    const zx_isa isa = isa_arg(isa_name);
    const int64_t n = src.numel();
    const zx_dtype dt = check_any(src, "src", n);
    auto [bytes, nblocks] = quant_sizes(bits, block_numel, n);
    check_payload(q, scales, bytes, nblocks);
    float *r = nullptr;
    if (residual) {
        check_cpu(*residual, "residual", at::kFloat, n);
        r = residual->data_ptr<float>();
    }
    const char *s = static_cast<const char *>(src.data_ptr());
    uint8_t *qp = q.data_ptr<uint8_t>();
    float *sp = scales.data_ptr<float>();
    const int64_t block_bytes = block_numel * bits / 8;
    const size_t esz = zx_dtype_size(dt);
    parallel_blocks(n, block_numel, "quantize", [&](int64_t b0, int64_t lo, int64_t hi) {
        return zx_quantize(isa, (int32_t)bits, (size_t)block_numel, (size_t)(hi - lo), s + (size_t)lo * esz,
                           dt, r ? r + lo : nullptr, qp + b0 * block_bytes, sp + b0);
    });
}

void py_dequantize(const std::string &isa_name, int64_t bits, int64_t block_numel, at::Tensor q,
                   at::Tensor scales, at::Tensor dst) {
    const zx_isa isa = isa_arg(isa_name);
    const int64_t n = dst.numel();
    const zx_dtype dt = check_any(dst, "dst", n);
    auto [bytes, nblocks] = quant_sizes(bits, block_numel, n);
    check_payload(q, scales, bytes, nblocks);
    char *d = static_cast<char *>(dst.data_ptr());
    const uint8_t *qp = q.data_ptr<uint8_t>();
    const float *sp = scales.data_ptr<float>();
    const int64_t block_bytes = block_numel * bits / 8;
    const size_t esz = zx_dtype_size(dt);
    parallel_blocks(n, block_numel, "dequantize", [&](int64_t b0, int64_t lo, int64_t hi) {
        return zx_dequantize(isa, (int32_t)bits, (size_t)block_numel, (size_t)(hi - lo), qp + b0 * block_bytes,
                             sp + b0, d + (size_t)lo * esz, dt);
    });
}

void py_dequantize_sum(const std::string &isa_name, int64_t bits, int64_t block_numel, at::Tensor q,
                       at::Tensor scales, int64_t nslices, at::Tensor dst, bool accumulate, double scale) {
    const zx_isa isa = isa_arg(isa_name);
    TORCH_CHECK(nslices >= 1 && nslices <= INT32_MAX, "zero_ext: nslices must be >= 1, got ", nslices);
    check_cpu(dst, "dst", at::kFloat, -1);
    const int64_t n = dst.numel();
    auto [bytes, nblocks] = quant_sizes(bits, block_numel, n);
    check_payload(q, scales, bytes * nslices, nblocks * nslices);
    float *d = dst.data_ptr<float>();
    const uint8_t *qp = q.data_ptr<uint8_t>();
    const float *sp = scales.data_ptr<float>();
    const int64_t block_bytes = block_numel * bits / 8;
    parallel_blocks(n, block_numel, "dequantize_sum", [&](int64_t b0, int64_t lo, int64_t hi) {
        return zx_dequantize_sum(isa, (int32_t)bits, (size_t)block_numel, (size_t)(hi - lo), (int32_t)nslices,
                                 (size_t)nblocks, qp + b0 * block_bytes, sp + b0, d + lo, accumulate,
                                 (float)scale);
    });
}

}  // namespace

void zx_bind_kernels(pybind11::module_ &m) {
    m.def("isa_supported", [](const std::string &name) { return zx_cpu_supports(parse_isa(name)) != 0; },
          "True when this CPU (and build) can run the named ISA: 'scalar', 'avx2', 'avx512'.",
          py::arg("name"));
    m.def("best_isa", []() { return std::string(zx_isa_name(zx_cpu_best_isa())); },
          "The widest ISA this CPU supports ('avx512', 'avx2' or 'scalar').");
    m.def("adam_step", &py_adam_step,
          "One Adam (decoupled=False) / AdamW (decoupled=True) step on flat CPU float32 tensors, "
          "torch.optim arithmetic; step counts this step (>= 1); optional bf16/fp16 copy-out to "
          "param_lp; max_exp_avg_sq is needed when amsgrad.",
          py::arg("isa"), py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
          py::arg("max_exp_avg_sq"), py::arg("param_lp"), py::arg("lr"), py::arg("beta1"),
          py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
          py::arg("decoupled"), py::arg("amsgrad"), py::arg("maximize"), py::arg("grad_scale"));
    m.def("adam_step_split", &py_adam_step_split,
          "One Adam/AdamW step of the split masters (hi: bf16, rem: int16, ties: uint8) in one pass: "
          "elements [lead, lead + grad.numel()) step; bit for bit master_join, adam_step into hi, "
          "master_split (Note [Fused split-master step]).",
          py::arg("isa"), py::arg("hi"), py::arg("rem"), py::arg("ties"), py::arg("grad"), py::arg("exp_avg"),
          py::arg("exp_avg_sq"), py::arg("max_exp_avg_sq"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
          py::arg("eps"), py::arg("weight_decay"), py::arg("step"), py::arg("decoupled"), py::arg("amsgrad"),
          py::arg("maximize"), py::arg("grad_scale"), py::kw_only(), py::arg("lead") = 0);
    m.def("adam_step_bf16_states", &py_adam_step_bf16_states,
          "One Adam (decoupled=False) / AdamW (decoupled=True) step on flat CPU tensors with the "
          "states exp_avg, exp_avg_sq in torch.bfloat16, updated in float32 and stored with "
          "stochastic rounding whose random bits for element i hash (seed, offset + i); param "
          "float32, optional bf16/fp16 copy-out to param_lp. No amsgrad.",
          py::arg("isa"), py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
          py::arg("param_lp"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("weight_decay"), py::arg("step"), py::arg("decoupled"), py::arg("maximize"),
          py::arg("grad_scale"), py::arg("seed"), py::arg("offset") = 0);
    m.def("sgd_step", &py_sgd_step,
          "One SGD step on flat CPU float32 tensors (momentum, dampening, Nesterov, weight decay, "
          "maximize); first_step initializes momentum_buf to the gradient like torch.",
          py::arg("isa"), py::arg("param"), py::arg("grad"), py::arg("momentum_buf"), py::arg("param_lp"),
          py::arg("lr"), py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"),
          py::arg("nesterov"), py::arg("maximize"), py::arg("first_step"), py::arg("grad_scale"));
    m.def("grad_sumsq", &py_grad_sumsq,
          "(sum over finite elements of (grad*scale)^2 in double, count of inf/nan elements).",
          py::arg("isa"), py::arg("grad"), py::arg("scale"));
    m.def("sum_slices", &py_sum_slices,
          "dst = (dst if accumulate else 0) + scale * sum_j src[j*len(dst):(j+1)*len(dst)], j increasing.",
          py::arg("isa"), py::arg("src"), py::arg("nslices"), py::arg("dst"), py::arg("accumulate"),
          py::arg("scale"));
    m.def("scale", &py_scale, "x *= s on a CPU float32 tensor.", py::arg("isa"), py::arg("x"),
          py::arg("s"));
    m.def("cast_from_f32", &py_cast_from_f32,
          "dst = src cast to dst.dtype (bf16/fp16: round to nearest even; fp32: copy).", py::arg("isa"),
          py::arg("src"), py::arg("dst"));
    m.def("parallel_threads_seen", [](int64_t numel) {
              py::gil_scoped_release no_gil;
              return zx_parallel_threads_seen(numel);
          },
          "How many distinct threads ran a task of the kernels' parallel loop over numel elements "
          "(at most torch.get_num_threads(); 1 means the loop ran serially).",
          py::arg("numel"));
    m.def("cast_to_f32", &py_cast_to_f32, "dst (float32) = src (bf16/fp16/fp32), exact.", py::arg("isa"),
          py::arg("src"), py::arg("dst"));
    m.def("master_join", &py_master_join,
          "out (fp32) = the split masters (hi: the bf16 parameter, rem: int16, ties: uint8, one bit per "
          "element), bit for bit (Note [Split master]).",
          py::arg("isa"), py::arg("hi"), py::arg("rem"), py::arg("ties"), py::arg("out"));
    m.def("master_split", &py_master_split,
          "rem and ties of the fp32 masters m whose bf16 rounding is hi (Note [Split master]).",
          py::arg("isa"), py::arg("m"), py::arg("hi"), py::arg("rem"), py::arg("ties"));
    m.def("quant_sizes", &quant_sizes,
          "(bytes of codes, number of scales) of a quantized payload of n elements: whole blocks of "
          "block_numel, int8 (bits=8) or two int4 codes per byte (bits=4, block_numel even).",
          py::arg("bits"), py::arg("block_numel"), py::arg("n"));
    m.def("quantize", &py_quantize,
          "Blockwise symmetric quantization of src (fp32/bf16/fp16) into q (uint8, quant_sizes bytes) and "
          "scales (fp32, one per block); with residual (fp32 like src) quantizes src + residual and "
          "stores the new residual (error feedback).",
          py::arg("isa"), py::arg("bits"), py::arg("block_numel"), py::arg("src"), py::arg("q"),
          py::arg("scales"), py::arg("residual") = py::none());
    m.def("dequantize", &py_dequantize,
          "dst (fp32/bf16/fp16) = code * scale of its block, rounded to dst.dtype.", py::arg("isa"),
          py::arg("bits"), py::arg("block_numel"), py::arg("q"), py::arg("scales"), py::arg("dst"));
    m.def("dequantize_sum", &py_dequantize_sum,
          "dst = (dst if accumulate else 0) + scale * sum_j dequantized slice j (fp32, j increasing); q and "
          "scales hold nslices payloads of len(dst) elements back to back.",
          py::arg("isa"), py::arg("bits"), py::arg("block_numel"), py::arg("q"), py::arg("scales"),
          py::arg("nslices"), py::arg("dst"), py::arg("accumulate"), py::arg("scale"));
}
