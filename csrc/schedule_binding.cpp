// schedule_binding.cpp — stage 3's UnitSchedule (engine/unit_schedule.h) for model.py's hooks,
// `ahead` asking the Engine which units are requested (Note [Stage 3 unit sequence]); and
// replay_peak for estimate_memory, so the estimate replays the schedule the hooks run.
#include <torch/extension.h>

#include <algorithm>

#include "engine/engine.h"
#include "engine/unit_schedule.h"


void zx_bind_schedule(py::module_ &m) {
    py::class_<zx::UnitSchedule>(m, "UnitSchedule")
        .def(py::init<std::vector<int64_t>, int64_t, int64_t>(), py::arg("numel"), py::arg("depth"),
             py::arg("coalesce_numel"))
        .def("begin_pass", &zx::UnitSchedule::begin_pass, py::arg("grad_enabled"))
        .def("need", &zx::UnitSchedule::need, py::arg("unit"), py::arg("in_backward"))
        .def("ahead", [](const zx::UnitSchedule &s, const zx::Engine &e, int64_t k, bool in_backward) {
                 const zx::UnitFetch f = s.ahead(k, in_backward, [&e](int64_t u) { return e.unit_requested(u); });
                 return std::make_pair(f.together, f.launch);
             }, py::arg("engine"), py::arg("unit"), py::arg("in_backward"),
             "(together, units): what to gather after this unit's need, the engine's requested units left out")
        .def("ahead_of", [](const zx::UnitSchedule &s, int64_t k, bool in_backward, const std::vector<int64_t> &have) {
                 const zx::UnitFetch f = s.ahead(k, in_backward, [&have](int64_t u) {
                     return std::find(have.begin(), have.end(), u) != have.end();
                 });
                 return std::make_pair(f.together, f.launch);
             }, py::arg("unit"), py::arg("in_backward"), py::arg("requested"),
             "As ahead, with the requested units listed (tests)")
        .def("end_forward", &zx::UnitSchedule::end_forward, py::arg("grad_enabled"), py::arg("backward_follows"))
        .def("kept_after_forward", &zx::UnitSchedule::kept_after_forward, py::arg("unit"))
        .def("stop_recording", &zx::UnitSchedule::stop_recording)
        .def_readwrite("fetches", &zx::UnitSchedule::fetches)
        .def_readwrite("out_of_order", &zx::UnitSchedule::out_of_order);
    m.def("replay_peak", &zx::replay_peak, py::arg("numel"), py::arg("elem_bytes"), py::arg("depth"),
          py::arg("coalesce_numel"), py::arg("world"),
          "Most bytes of non-root units gathered at once over one training step (Note [Stage 3 unit sequence]).");
}
