// kernels_binding.h — the C++ side's bridge to the C core's kernels.
//
//   zx_bind_kernels(m)   adds the CPU kernel functions to the extension module
//                        (kernels_binding.cpp; called from binding.cpp)
//   adam_hparams_of, sgd_hparams_of, adam_from_groups, sgd_from_groups
//                        the fused steps' hyperparameters (Note [Hyperparameters] below)
//   zx_check, parse_isa  from engine/check.h (the engine's, without Python)
#pragma once

#include <torch/csrc/utils/pybind.h>   // pybind11 and its at::Tensor casters: a tenth of torch/extension.h's
#include <ATen/core/Tensor.h>          // parse time (tests/test_cuda_compile.py checks this file alone)

#include <string>

#include "core/zx_core.h"
#include "engine/check.h"   // defines: zx_check, parse_isa

void zx_bind_kernels(pybind11::module_ &m);

// Note [Hyperparameters]
//   The fused kernels take zx_adam_hparams / zx_sgd_hparams (core/zx_core.h). They are
//   filled in exactly two ways: from keyword arguments (the raw kernel bindings,
//   adam_hparams_of / sgd_hparams_of) and from the torch param groups the user's
//   optimizer keeps (the engine's steps, adam_from_groups / sgd_from_groups, built on
//   the keyword forms). The engine reads the param groups themselves, once per step:
//   no per-step dicts are built in Python, and an LR scheduler's edits are seen as
//   torch's own step sees them. A group another wrapped optimizer steps gets inert
//   hyperparameters (the engine skips its buckets).
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

inline zx_sgd_hparams sgd_hparams_of(double lr, double momentum, double dampening, double weight_decay,
                                     bool nesterov, bool maximize, bool first_step, double grad_scale) {
    zx_sgd_hparams hp{};
    hp.lr = lr;
    hp.momentum = momentum;
    hp.dampening = dampening;
    hp.weight_decay = weight_decay;
    hp.nesterov = nesterov ? 1 : 0;
    hp.maximize = maximize ? 1 : 0;
    hp.first_step = first_step ? 1 : 0;
    hp.grad_scale = (float)grad_scale;
    return hp;
}

namespace zx_groups {
// group[key] as T (a tensor lr converts as float() does); a missing key is an internal error
template <class T>
T at(const pybind11::dict &g, const char *key) {
    TORCH_CHECK(g.contains(key), "zero_ext: internal error: the param group has no '", key, "'");
    return g[key].cast<T>();
}
template <class T>
T get(const pybind11::dict &g, const char *key, T dflt) {
    return g.contains(key) ? g[key].cast<T>() : dflt;
}
// per param group: true when `groups` (indices) lists it
inline std::vector<char> mask(size_t n, const std::vector<int64_t> &groups) {
    std::vector<char> m(n, 0);
    for (int64_t gi : groups) {
        TORCH_CHECK(gi >= 0 && (size_t)gi < n, "zero_ext: internal error: param group ", gi, " out of range");
        m[gi] = 1;
    }
    return m;
}
}  // namespace zx_groups

// Note [Hyperparameters]: one zx_adam_hparams per param group; those not in `groups` inert.
// adamw: the default of decoupled_weight_decay (torch.optim.AdamW's class).
inline std::vector<zx_adam_hparams> adam_from_groups(const pybind11::list &param_groups,
                                                     const std::vector<int64_t> &groups,
                                                     const std::vector<int64_t> &steps, double scale,
                                                     bool adamw) {
    const size_t n = param_groups.size();
    TORCH_CHECK(steps.size() == n, "zero_ext: internal error: ", steps.size(), " step counts for ", n, " groups");
    const std::vector<char> mine = zx_groups::mask(n, groups);
    std::vector<zx_adam_hparams> out(n, adam_hparams_of(0.0, 0.9, 0.999, 1e-8, 0.0, 1, false, false, false, 1.0));
    for (size_t gi = 0; gi < n; gi++) {
        if (!mine[gi]) continue;
        pybind11::dict g = param_groups[gi].cast<pybind11::dict>();
        pybind11::sequence betas = zx_groups::at<pybind11::sequence>(g, "betas");
        out[gi] = adam_hparams_of(
            zx_groups::at<double>(g, "lr"), betas[0].cast<double>(), betas[1].cast<double>(),
            zx_groups::at<double>(g, "eps"), zx_groups::at<double>(g, "weight_decay"), steps[gi],
            zx_groups::get<bool>(g, "decoupled_weight_decay", adamw), zx_groups::get<bool>(g, "amsgrad", false),
            zx_groups::get<bool>(g, "maximize", false), scale);
    }
    return out;
}

// Note [Hyperparameters]: as adam_from_groups, for SGD (first_step: the group's step count is 1).
inline std::vector<zx_sgd_hparams> sgd_from_groups(const pybind11::list &param_groups,
                                                   const std::vector<int64_t> &groups,
                                                   const std::vector<int64_t> &steps, double scale) {
    const size_t n = param_groups.size();
    TORCH_CHECK(steps.size() == n, "zero_ext: internal error: ", steps.size(), " step counts for ", n, " groups");
    const std::vector<char> mine = zx_groups::mask(n, groups);
    std::vector<zx_sgd_hparams> out(n, sgd_hparams_of(0.0, 0.0, 0.0, 0.0, false, false, false, 1.0));
    for (size_t gi = 0; gi < n; gi++) {
        if (!mine[gi]) continue;
        pybind11::dict g = param_groups[gi].cast<pybind11::dict>();
        out[gi] = sgd_hparams_of(
            zx_groups::at<double>(g, "lr"), zx_groups::at<double>(g, "momentum"),
            zx_groups::at<double>(g, "dampening"), zx_groups::at<double>(g, "weight_decay"),
            zx_groups::at<bool>(g, "nesterov"), zx_groups::get<bool>(g, "maximize", false), steps[gi] == 1, scale);
    }
    return out;
}
