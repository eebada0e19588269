// kernels_binding.h — the C++ side's bridge to the C core's kernels.
//
//   zx_bind_kernels(m)   adds the CPU kernel functions to the extension module
//                        (kernels_binding.cpp; called from binding.cpp)
//   zx_check(s, what)    throws a c10::Error (Python RuntimeError) for a non-OK zx_status
//   parse_isa(name)      "scalar" / "avx2" / "avx512" -> zx_isa (throws otherwise)
#pragma once

#include <torch/extension.h>

#include <string>

#include "core/zx_core.h"

void zx_bind_kernels(pybind11::module_ &m);

// Turn a non-OK status from the C core into an exception naming the call.
inline void zx_check(zx_status s, const char *what) {
    TORCH_CHECK(s == ZX_OK, "zero_ext: ", what, " failed: ", zx_status_string(s));
}

// The Adam/AdamW hyperparameters of the kernel bindings (CPU and CUDA, fp32 and bf16 states).
inline zx_adam_hparams adam_hparams_of(double lr, double beta1, double beta2, double eps, double weight_decay,
                                       int64_t step, bool decoupled, bool amsgrad, bool maximize,
                                       double grad_scale) {
    zx_adam_hparams hp{};
    hp.lr = lr;
    hp.beta1 = beta1;
    hp.beta2 = beta2;
    hp.eps = eps;
    hp.weight_decay = weight_decay;
    hp.step = step;
    hp.decoupled = decoupled ? 1 : 0;
    hp.amsgrad = amsgrad ? 1 : 0;
    hp.maximize = maximize ? 1 : 0;
    hp.grad_scale = (float)grad_scale;
    return hp;
}

// An ISA name as zx_isa_name() spells it. ("auto" is the caller's to resolve,
// with zx_cpu_best_isa().)
inline zx_isa parse_isa(const std::string &name) {
    if (name == "scalar") return ZX_ISA_SCALAR;
    if (name == "avx2") return ZX_ISA_AVX2;
    if (name == "avx512") return ZX_ISA_AVX512;
    TORCH_CHECK(false, "zero_ext: unknown isa '", name,
                "'; use 'scalar', 'avx2', 'avx512' (or 'auto' where accepted)");
    return ZX_ISA_SCALAR;  // not reached
}
