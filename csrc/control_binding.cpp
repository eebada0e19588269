// control_binding.cpp — the step control (Note [Step control],
// csrc/core/zx_step_control.h) on CPU tensors: clip_control and step_control,
// the host twins of cuda_binding.cpp's cuda_clip_control / cuda_step_control,
// so the optimizer's device-resident step (zero_ext/step_control.py) runs the
// same rules, and is tested, without a GPU.
#include <torch/extension.h>

#include <optional>

#include "core/zx_step_control.h"

namespace {

template <typename T>
T *cpu_ptr(const at::Tensor &t, const char *name, at::ScalarType dtype, int64_t numel) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() &&
                    (numel < 0 || t.numel() == numel),
                name, " must be a contiguous CPU ", dtype, " tensor", numel >= 0 ? " of " : "",
                numel >= 0 ? std::to_string(numel) : std::string(), numel >= 0 ? " elements" : "");
    return static_cast<T *>(t.data_ptr());
}

zx_loss_scaler *scaler_ptr(const std::optional<at::Tensor> &scaler) {
    if (!scaler.has_value()) return nullptr;
    return cpu_ptr<zx_loss_scaler>(*scaler, "scaler", at::kByte, (int64_t)sizeof(zx_loss_scaler));
}

void clip_control(at::Tensor ctl, at::Tensor out2, double divisor, std::optional<at::Tensor> scaler, double max_norm,
                  at::Tensor norm_out) {
    TORCH_CHECK(divisor > 0.0, "divisor must be > 0, got ", divisor);
    zx_clip_control(cpu_ptr<double>(ctl, "ctl", at::kDouble, ZX_CTL_SIZE), cpu_ptr<float>(out2, "out2", at::kFloat, 2),
                    divisor, scaler_ptr(scaler), max_norm, cpu_ptr<float>(norm_out, "norm_out", at::kFloat, 1));
}

void step_control(at::Tensor ctl, std::optional<at::Tensor> out2, double divisor, std::optional<at::Tensor> scaler,
                  std::optional<at::Tensor> scale_out, at::Tensor steps) {
    TORCH_CHECK(divisor > 0.0, "divisor must be > 0, got ", divisor);
    zx_step_control(cpu_ptr<double>(ctl, "ctl", at::kDouble, ZX_CTL_SIZE),
                    out2 ? cpu_ptr<float>(*out2, "out2", at::kFloat, 2) : nullptr, divisor, scaler_ptr(scaler),
                    scale_out ? cpu_ptr<float>(*scale_out, "scale_out", at::kFloat, 1) : nullptr,
                    cpu_ptr<int64_t>(steps, "steps", at::kLong, -1), (int32_t)steps.numel());
}

}  // namespace

void zx_bind_control(pybind11::module_ &m) {
    namespace py = pybind11;
    m.attr("CTL_SIZE") = ZX_CTL_SIZE;
    m.attr("CTL_CLIP") = ZX_CTL_CLIP;
    m.attr("CTL_FOUND") = ZX_CTL_FOUND;
    m.attr("CTL_MULT") = ZX_CTL_MULT;
    m.attr("CTL_SKIP") = ZX_CTL_SKIP;
    m.def("clip_control", &clip_control,
          "After a gradient scan into out2: the norm into norm_out, the clip factor and overflow flag into ctl.",
          py::arg("ctl"), py::arg("out2"), py::arg("divisor"), py::arg("scaler"), py::arg("max_norm"),
          py::arg("norm_out"));
    m.def("step_control", &step_control,
          "At step(): the gradient multiplier, the skip verdict, the loss-scale update and the step counts.",
          py::arg("ctl"), py::arg("out2"), py::arg("divisor"), py::arg("scaler"), py::arg("scale_out"),
          py::arg("steps"));
}
