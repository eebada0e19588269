// schedule_binding.cpp — stage 3's UnitSchedule (engine/unit_schedule.h) for model.py's hooks,
// `ahead` asking the Engine which units are requested (Note [Stage 3 unit sequence]); and
// replay_peak and buffer_bytes for estimate_memory, so the estimate replays the schedule the hooks run;
// model_state_bytes and smallest_world (engine/model_state.h) for estimate_memory and stage="auto".
#include <torch/extension.h>

#include <pybind11/functional.h>   // fits, a Python callable

#include <algorithm>

#include "engine/engine.h"
#include "engine/model_state.h"
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
    m.def("buffer_bytes",
          [](const std::vector<int64_t> &bucket_unit, const std::vector<int64_t> &bucket_padded,
             const std::vector<std::pair<int64_t, int64_t>> &frozen, int64_t stage, int64_t world,
             int64_t param_bytes, int64_t reduce_bytes, int64_t grad_ring_buckets, int64_t depth,
             int64_t coalesce_numel, int64_t accum, int64_t piece_align, int64_t slice_align, bool alltoall,
             bool on_meta, bool narrow_wire) {
              const zx::EstimateBuffers b = zx::buffer_bytes(
                  bucket_unit, bucket_padded, frozen,
                  {stage, world, param_bytes, reduce_bytes, grad_ring_buckets, depth, coalesce_numel, accum,
                   piece_align, slice_align, alltoall, on_meta, narrow_wire});
              py::dict d;
              d["ring_slots"] = b.ring_slots, d["grad_ring"] = b.grad_ring;
              d["gathered_root"] = b.gathered_root, d["gathered_unit"] = b.gathered_unit;
              d["prefetch"] = b.prefetch, d["peak_gathered_params"] = b.peak_gathered;
              d["frozen_sharded"] = b.frozen_sharded, d["comm"] = b.comm;
              return d;
          },
          py::arg("bucket_unit"), py::arg("bucket_padded"), py::arg("frozen"), py::kw_only(), py::arg("stage"),
          py::arg("world"), py::arg("param_bytes"), py::arg("reduce_bytes"), py::arg("grad_ring_buckets"),
          py::arg("depth"), py::arg("coalesce_numel"), py::arg("accum"), py::arg("piece_align"),
          py::arg("slice_align"), py::arg("alltoall"), py::arg("on_meta"), py::arg("narrow_wire"),
          "estimate_memory's gradient ring, stage 3's gathered units and frozen shard (bytes), and the "
          "collective bytes of one optimizer step");
    m.def("model_state_bytes",
          [](const std::vector<int64_t> &bucket_group, const std::vector<int64_t> &bucket_padded,
             const std::vector<int64_t> &bucket_shard, int64_t stage, int64_t world, int64_t param_bytes,
             int64_t reduce_bytes, int64_t state_bytes, std::vector<int64_t> states_per_group, bool fused, bool adam,
             bool param_quant, bool grad_quant, bool offload, bool alltoall, bool master_remainder, bool on_gpu,
             bool step_in_backward) {
              const zx::ModelState m = zx::model_state_bytes(
                  bucket_group, bucket_padded, bucket_shard,
                  {stage, world, param_bytes, reduce_bytes, state_bytes, std::move(states_per_group), fused, adam,
                   param_quant, grad_quant, offload, alltoall, master_remainder, on_gpu, step_in_backward});
              py::dict msb, host, d;
              msb["parameters"] = m.parameters, msb["gradients"] = m.gradients;
              msb["master_weights"] = m.master_weights, msb["optimizer_states"] = m.optimizer_states;
              msb["total"] = m.parameters + m.gradients + m.master_weights + m.optimizer_states;
              if (m.offloaded) {
                  host["master_weights"] = m.host_master, host["optimizer_states"] = m.host_states;
                  host["gradients"] = m.host_gradients, host["pinned_ring"] = m.pinned_ring;
                  host["total"] = m.host_master + m.host_states + m.host_gradients + m.pinned_ring;
              }
              d["model_state_bytes"] = msb, d["offload"] = host;
              d["grad_landing"] = m.grad_landing, d["split_master_scratch"] = m.split_scratch;
              return d;
          },
          py::arg("bucket_group"), py::arg("bucket_padded"), py::arg("bucket_shard"), py::kw_only(), py::arg("stage"),
          py::arg("world"), py::arg("param_bytes"), py::arg("reduce_bytes"), py::arg("state_bytes"),
          py::arg("states_per_group"), py::arg("fused"), py::arg("adam"), py::arg("param_quant"),
          py::arg("grad_quant"), py::arg("offload"), py::arg("alltoall"), py::arg("master_remainder"),
          py::arg("on_gpu"), py::arg("step_in_backward"),
          "estimate_memory's model state on the device, what offload keeps on the host, the split master's "
          "scratch and step_in_backward's landing buffer (bytes)");
    m.def("smallest_world", &zx::smallest_world, py::arg("world"), py::arg("max_world"), py::arg("fits"),
          "The smallest world size in (world, max_world] at which fits(n) holds (fits true from some n on), "
          "or 0");
}
