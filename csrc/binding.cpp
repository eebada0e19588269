// binding.cpp — the zero_ext._C module: the Engine (engine.h), the raw
// kernels (kernels_binding.cpp) and, when built with CUDA, the CUDA kernels.
#include <torch/extension.h>

#include <cstring>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "engine/engine.h"
#include "kernels_binding.h"   // defines: zx_bind_kernels

void zx_bind_cuda(pybind11::module_ &m);   // cuda_binding.cpp (a no-op without CUDA)
void zx_bind_plan(pybind11::module_ &m);   // plan_binding.cpp (the planner, for estimate_memory)
void zx_bind_control(pybind11::module_ &m);   // control_binding.cpp (the step control on CPU tensors)
void zx_bind_schedule(pybind11::module_ &m);   // schedule_binding.cpp (stage 3's unit schedule)
// stats_binding.cpp: the engine's reports as dicts (Note [Engine stats], engine/stats.h)
pybind11::dict zx_stats_dict(const zx::EngineStats &s);
pybind11::dict zx_atomic_stats_dict(const zx::AtomicStats &a);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "zero_ext C/C++ core: ZeRO engine, planner and optimizer kernels";
    zx_bind_kernels(m);
    zx_bind_cuda(m);
    zx_bind_plan(m);
    zx_bind_control(m);
    zx_bind_schedule(m);
    m.attr("BF16_STATE_SEED") = py::int_(zx::kStateSeed);   // Note [bf16 optimizer states]
    // The phases of Note [Collective sequence check] (SeqPhase, engine/digest.h) that
    // Python marks with Engine.sequence_mark; UNIT_NEED_BASE + k: stage-3 unit k is needed.
    for (const auto &[name, phase] : {std::pair<const char *, int64_t>{"PHASE_FORWARD", zx::kPhaseForward},
                                      {"PHASE_BACKWARD", zx::kPhaseBackward},
                                      {"PHASE_CLIP", zx::kPhaseClip},
                                      {"PHASE_STEP", zx::kPhaseStep},
                                      {"PHASE_FORWARD_NOGRAD", zx::kPhaseForwardNoGrad},
                                      {"PHASE_MODEL_STATE", zx::kPhaseModelState},
                                      {"PHASE_OPTIM_STATE", zx::kPhaseOptimState},
                                      {"PHASE_CHECKPOINT", zx::kPhaseCheckpoint},
                                      {"PHASE_GRAD_STATS", zx::kPhaseGradStats},
                                      {"UNIT_NEED_BASE", zx::kUnitNeedBase}})
        m.attr(name) = py::int_(phase);

    py::class_<zx::EngineOptions>(m, "EngineOptions")
        .def(py::init<>())
        .def_readwrite("stage", &zx::EngineOptions::stage)
        .def_readwrite("bucket_bytes", &zx::EngineOptions::bucket_bytes)
        .def_readwrite("first_bucket_bytes", &zx::EngineOptions::first_bucket_bytes)
        .def_readwrite("align", &zx::EngineOptions::align)
        .def_readwrite("param_align_bytes", &zx::EngineOptions::param_align_bytes)
        .def_readwrite("alltoall_reduce_scatter", &zx::EngineOptions::alltoall_reduce_scatter)
        .def_readwrite("grad_quant_bits", &zx::EngineOptions::grad_quant_bits)
        .def_readwrite("grad_quant_error_feedback", &zx::EngineOptions::grad_quant_error_feedback)
        .def_readwrite("quant_block_numel", &zx::EngineOptions::quant_block_numel)
        .def_readwrite("param_quant_bits", &zx::EngineOptions::param_quant_bits)
        .def_readwrite("grad_ring_buckets", &zx::EngineOptions::grad_ring_buckets)
        .def_readwrite("isa", &zx::EngineOptions::isa)
        .def_readwrite("copy_params", &zx::EngineOptions::copy_params)
        .def_readwrite("param_dtype", &zx::EngineOptions::param_dtype)
        .def_readwrite("reduce_dtype", &zx::EngineOptions::reduce_dtype)
        .def_readwrite("group_update_kind", &zx::EngineOptions::group_update_kind)
        .def_readwrite("param_state", &zx::EngineOptions::param_state)
        .def_readwrite("agree_unused", &zx::EngineOptions::agree_unused)
        .def_readwrite("param_names", &zx::EngineOptions::param_names)
        .def_readwrite("offload", &zx::EngineOptions::offload)
        .def_readwrite("step_in_backward", &zx::EngineOptions::step_in_backward)
        .def_readwrite("state_dtype", &zx::EngineOptions::state_dtype)
        .def_readwrite("coalesce_numel", &zx::EngineOptions::coalesce_numel);

    // The loss-scaling state machine of the C core (zx_scaler.c), state and all.
    py::class_<zx_loss_scaler>(m, "LossScaler")
        .def(py::init([](double scale, double growth_factor, double backoff_factor, int64_t growth_interval,
                         int64_t hysteresis, double min_scale, double max_scale, bool dynamic) {
                 zx_loss_scaler s{};
                 s.scale = scale;
                 s.growth_factor = growth_factor;
                 s.backoff_factor = backoff_factor;
                 s.growth_interval = growth_interval;
                 s.hysteresis = hysteresis;
                 s.min_scale = min_scale;
                 s.max_scale = max_scale;
                 s.dynamic = dynamic ? 1 : 0;
                 zx_check(zx_scaler_init(&s), "configuring the loss scaler (check its options)");
                 return s;
             }),
             py::arg("scale"), py::arg("growth_factor"), py::arg("backoff_factor"), py::arg("growth_interval"),
             py::arg("hysteresis"), py::arg("min_scale"), py::arg("max_scale"), py::arg("dynamic"))
        .def("update", [](zx_loss_scaler &s, bool found_nonfinite) {
            int32_t skip = 0;
            zx_check(zx_scaler_update(&s, found_nonfinite ? 1 : 0, &skip), "updating the loss scaler");
            return skip != 0;
        }, "Report this step's overflow; returns True when the step must be skipped.")
        // The struct's bytes, for a copy in device memory that the CUDA step
        // control advances (Note [Step control] in csrc/core/zx_step_control.h; kernels in csrc/cuda/zx_cuda_control.h).
        .def("to_bytes", [](const zx_loss_scaler &s) {
            at::Tensor t = at::empty({(int64_t)sizeof(zx_loss_scaler)}, at::TensorOptions().dtype(at::kByte));
            std::memcpy(t.data_ptr(), &s, sizeof(zx_loss_scaler));
            return t;
        }, "The scaler as a uint8 CPU tensor of its C struct's bytes.")
        .def_static("from_bytes", [](const at::Tensor &t) {
            TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.is_contiguous() &&
                            t.numel() == (int64_t)sizeof(zx_loss_scaler),
                        "LossScaler.from_bytes needs the contiguous uint8 CPU tensor of to_bytes()");
            zx_loss_scaler s;
            std::memcpy(&s, t.data_ptr(), sizeof(zx_loss_scaler));
            return s;
        }, "The scaler whose bytes to_bytes() returned (copied back from the device).")
        .def("state_dict", [](const zx_loss_scaler &s) {
            py::dict d;
            d["scale"] = s.scale;
            d["good_steps"] = s.good_steps;
            d["hysteresis_left"] = s.hysteresis_left;
            d["skipped"] = s.skipped;
            d["dynamic"] = s.dynamic != 0;
            return d;
        }, "The scaler's state (its configuration comes from the ZeroConfig).")
        .def("load_state_dict", [](zx_loss_scaler &s, const py::dict &d) {
            const double scale = d["scale"].cast<double>();
            TORCH_CHECK(scale > 0.0, "zero_ext: a loss-scaler state with scale ", scale,
                        " cannot be loaded (a scale must be > 0); load the state dict that optimizer.state_dict() "
                        "saved, unedited");
            s.scale = scale;
            s.good_steps = d["good_steps"].cast<int64_t>();
            s.hysteresis_left = d["hysteresis_left"].cast<int64_t>();
            s.skipped = d["skipped"].cast<int64_t>();
        })
        .def_readwrite("scale", &zx_loss_scaler::scale)
        .def_readonly("growth_factor", &zx_loss_scaler::growth_factor)
        .def_readonly("backoff_factor", &zx_loss_scaler::backoff_factor)
        .def_readonly("growth_interval", &zx_loss_scaler::growth_interval)
        .def_readonly("hysteresis", &zx_loss_scaler::hysteresis)
        .def_readonly("min_scale", &zx_loss_scaler::min_scale)
        .def_readonly("max_scale", &zx_loss_scaler::max_scale)
        .def_readonly("dynamic", &zx_loss_scaler::dynamic)
        .def_readwrite("good_steps", &zx_loss_scaler::good_steps)
        .def_readwrite("hysteresis_left", &zx_loss_scaler::hysteresis_left)
        .def_readwrite("skipped", &zx_loss_scaler::skipped);

    // Note [Fragment views] (engine/fragment_view.h)
    py::class_<zx::FragmentView>(m, "FragmentView")
        .def_readonly("param", &zx::FragmentView::param)
        .def_readonly("param_offset", &zx::FragmentView::param_offset)
        .def_readonly("bucket", &zx::FragmentView::bucket)
        .def_readonly("slice_offset", &zx::FragmentView::slice_offset)
        .def_readonly("numel", &zx::FragmentView::numel)
        .def_readonly("master", &zx::FragmentView::master)
        .def("__repr__", [](const zx::FragmentView &f) {
            return "FragmentView(param=" + std::to_string(f.param) + ", param_offset=" +
                   std::to_string(f.param_offset) + ", bucket=" + std::to_string(f.bucket) + ", slice_offset=" +
                   std::to_string(f.slice_offset) + ", numel=" + std::to_string(f.numel) + ")";
        });
    // Note [Groups as an argument] (engine/groups.h): calls a wrapped optimizer makes for its own
    // param groups take them; by default a call covers every group.
    const py::arg_v all_groups = py::arg("groups") = std::vector<int64_t>{};

    // Note [Engine teardown without the GIL]
    //   ~Engine waits for the collectives still in flight (an overlapped parameter gather
    //   launched by the last step, say). Meanwhile a gloo worker thread may need the GIL: it
    //   destroys the works it finished, and a work drops the Python objects its captured
    //   thread-local state holds (a torch function mode, saved-tensor hooks). With the GIL
    //   held by the waiting destructor, that thread blocks while holding the process group's
    //   queue, the awaited collective never runs, and every rank hangs at teardown (seen once
    //   in about 30 runs of a two-rank stage-2 overlap_param_gather script on gloo). So the
    //   destructor runs without the GIL, as every method here that may wait does (the
    //   collectives, and with offload the landing worker: grad_shards, owned_tensors); tensors
    //   freed there take the GIL themselves where they must (torch's PyObject slot).
    //   tests/test_overlap.py: test_engine_teardown_waits_without_the_gil.
    py::class_<zx::Engine>(m, "Engine", py::release_gil_before_calling_cpp_dtor())
        .def(py::init([](std::vector<at::Tensor> params, std::vector<int64_t> groups,
                         std::vector<int64_t> units, py::object pg, const zx::EngineOptions &opts) {
                 c10::optional<zx::ProcessGroupPtr> p;
                 if (!pg.is_none()) p = pg.cast<zx::ProcessGroupPtr>();
                 return std::make_unique<zx::Engine>(std::move(params), std::move(groups), std::move(units),
                                                     p, opts);
             }),
             py::arg("params"), py::arg("groups"), py::arg("units"), py::arg("process_group"),
             py::arg("options"))
        .def("gather_unit", &zx::Engine::gather_unit, py::arg("unit"), py::arg("wait") = true,
             py::call_guard<py::gil_scoped_release>())
        .def("release_unit", &zx::Engine::release_unit, py::arg("unit"), py::arg("keep") = false,
             py::call_guard<py::gil_scoped_release>())
        .def("enable_hierarchy", [](zx::Engine &e, py::object pg) {
                 e.enable_hierarchy(pg.cast<zx::ProcessGroupPtr>());
             }, py::arg("node_group"))
        .def("gather_units", &zx::Engine::gather_units, py::arg("units"),
             py::call_guard<py::gil_scoped_release>())
        .def("unit_gathered", &zx::Engine::unit_gathered)
        .def("unit_requested", &zx::Engine::unit_requested)
        .def("unit_numel", &zx::Engine::unit_numel)
        .def("commit_unit", &zx::Engine::commit_unit, py::call_guard<py::gil_scoped_release>())
        .def("unit_part", &zx::Engine::unit_part, py::call_guard<py::gil_scoped_release>())
        .def("install_unit", &zx::Engine::install_unit, py::call_guard<py::gil_scoped_release>())
        .def("add_frozen", &zx::Engine::add_frozen, py::arg("params"), py::arg("units"),
             py::arg("names") = std::vector<std::string>())
        .def("unit_has_frozen", [](const zx::Engine &e, int64_t u) { return e.units().frozen.of_unit(u) != nullptr; })
        .def("release_frozen", &zx::Engine::release_frozen, py::call_guard<py::gil_scoped_release>())
        .def("frozen_shard", [](const zx::Engine &e) { return e.units().frozen.shard(); })   // param_dtype
        .def("frozen_fragments", &zx::Engine::frozen_fragments, py::arg("rank"))
        .def_property_readonly("frozen_shard_bytes", [](const zx::Engine &e) { return e.units().frozen.shard_bytes(); })
        .def_property_readonly("num_units", [](const zx::Engine &e) { return e.units().count(); })
        .def("mark_ready", [](zx::Engine &e, int64_t i) { e.mark_ready(i); }, py::call_guard<py::gil_scoped_release>())
        .def("mark_ready_with", [](zx::Engine &e, int64_t i, const at::Tensor &grad) { e.mark_ready(i, grad); },
             py::call_guard<py::gil_scoped_release>())
        .def("finalize_backward", &zx::Engine::finalize_backward, py::call_guard<py::gil_scoped_release>())
        .def("wait_reductions", &zx::Engine::wait_reductions, py::call_guard<py::gil_scoped_release>())
        .def("set_require_sync", &zx::Engine::set_require_sync)
        .def("require_sync", &zx::Engine::require_sync)
        // Note [Hyperparameters] (kernels_binding.h): the optimizer's param groups as they are;
        // groups: the ones this fused optimizer steps (Note [Groups as an argument] in
        // engine/groups.h: every call a wrapped optimizer makes for its groups names them;
        // empty: all); steps: every group's step count
        .def("step_adam", [](zx::Engine &e, const py::list &param_groups, const std::vector<int64_t> &groups,
                             const std::vector<int64_t> &steps, double scale, bool adamw,
                             std::optional<at::Tensor> ctl, std::optional<at::Tensor> ctl_steps) {
            auto h = adam_from_groups(param_groups, groups, steps, scale, adamw);
            py::gil_scoped_release nogil;
            e.step_adam(h, groups, ctl.value_or(at::Tensor()), ctl_steps.value_or(at::Tensor()));
        }, py::arg("param_groups"), py::arg("groups"), py::arg("steps"), py::arg("scale"), py::arg("adamw"),
           py::arg("ctl") = py::none(), py::arg("ctl_steps") = py::none())
        .def("step_sgd", [](zx::Engine &e, const py::list &param_groups, const std::vector<int64_t> &groups,
                            const std::vector<int64_t> &steps, double scale, std::optional<at::Tensor> ctl,
                            std::optional<at::Tensor> ctl_steps) {
            auto h = sgd_from_groups(param_groups, groups, steps, scale);
            py::gil_scoped_release nogil;
            e.step_sgd(h, groups, ctl.value_or(at::Tensor()), ctl_steps.value_or(at::Tensor()));
        }, py::arg("param_groups"), py::arg("groups"), py::arg("steps"), py::arg("scale"),
           py::arg("ctl") = py::none(), py::arg("ctl_steps") = py::none())
        .def("set_backward_step_adam", [](zx::Engine &e, const py::list &param_groups,
                                          const std::vector<int64_t> &groups, double scale, bool adamw) {
            std::vector<int64_t> steps(param_groups.size(), 1);   // ignored (Note [Step in backward])
            e.set_backward_step_adam(adam_from_groups(param_groups, groups, steps, scale, adamw));
        }, py::arg("param_groups"), py::arg("groups"), py::arg("scale"), py::arg("adamw"))
        .def("set_backward_step_sgd", [](zx::Engine &e, const py::list &param_groups,
                                         const std::vector<int64_t> &groups, double scale) {
            std::vector<int64_t> steps(param_groups.size(), 1);
            e.set_backward_step_sgd(sgd_from_groups(param_groups, groups, steps, scale));
        }, py::arg("param_groups"), py::arg("groups"), py::arg("scale"))
        .def_property_readonly("backward_steps", [](const zx::Engine &e) { return e.book().backward.steps; })
        .def("grad_sumsq_into", &zx::Engine::grad_sumsq_into, py::call_guard<py::gil_scoped_release>())
        .def("param_shards", &zx::Engine::param_shards, all_groups)
        .def("grad_shards", &zx::Engine::grad_shards, all_groups,
             py::call_guard<py::gil_scoped_release>())   // offload: waits
        .def("bucket_groups", &zx::Engine::bucket_groups, all_groups)
        // Where rank r's shard holds pieces of parameters (any r, from the plan):
        // (param index, offset in the flattened parameter, offset in the flat shard, numel).
        .def("fragments", [](const zx::Engine &e, int64_t r) { return e.layout().fragments(r); }, py::arg("rank"))
        // The same per bucket, at offsets in the bucket's slice: where what rank r sends goes.
        .def("bucket_fragments", [](const zx::Engine &e, int64_t r) { return e.layout().bucket_fragments(r); },
             py::arg("rank"))
        .def("fragment_views", &zx::Engine::fragment_views, py::arg("masters") = true, all_groups)
        .def("frozen_fragment_views", [](const zx::Engine &e) {
            return e.units().frozen.fragment_views(e.layout().part());
        })
        .def("owned_tensors", &zx::Engine::owned_tensors, all_groups,
             py::call_guard<py::gil_scoped_release>())   // the same
        .def("cut_params", &zx::Engine::cut_params)
        .def("owners", [](const zx::Engine &e) { return e.layout().owners(); })   // -1: element-granular
        .def("atomic_stats", [](const zx::Engine &e) { return zx_atomic_stats_dict(e.atomic_stats()); })
        .def("publish_params", &zx::Engine::publish_params, py::call_guard<py::gil_scoped_release>())
        .def("cast_masters", &zx::Engine::cast_masters, all_groups, py::call_guard<py::gil_scoped_release>())
        .def("enable_split_master", &zx::Engine::enable_split_master, py::call_guard<py::gil_scoped_release>())
        .def("join_masters", &zx::Engine::join_masters, py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("split_master", &zx::Engine::split_master)
        .def_property_readonly("shard_device", &zx::Engine::shard_device)
        .def("absorb_param_edits", &zx::Engine::absorb_param_edits, py::call_guard<py::gil_scoped_release>())
        .def("open_unit_fp32", &zx::Engine::open_unit_fp32, py::call_guard<py::gil_scoped_release>())
        .def("scale_grads", &zx::Engine::scale_grads, py::arg("factor"), all_groups,
             py::call_guard<py::gil_scoped_release>())
        .def("grad_sumsq", &zx::Engine::grad_sumsq, py::call_guard<py::gil_scoped_release>())
        .def("all_gather_params", &zx::Engine::all_gather_params, all_groups, py::call_guard<py::gil_scoped_release>())
        .def("wait_params", &zx::Engine::wait_params, py::call_guard<py::gil_scoped_release>())
        .def("flush_params", &zx::Engine::flush_params, py::arg("wait") = true,
             py::call_guard<py::gil_scoped_release>())
        .def("wait_param_buckets", &zx::Engine::wait_param_buckets, py::arg("buckets"),
             py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("bucket_of_params", [](const zx::Engine &e) { return e.layout().bucket_of; })
        .def("begin_step", &zx::Engine::begin_step, py::arg("advance") = true, py::call_guard<py::gil_scoped_release>())
        .def("advance_steps", &zx::Engine::advance_steps, all_groups, py::call_guard<py::gil_scoped_release>())
        // Note [Unused parameters]: whether the next begin_step() agrees across ranks on which
        // parameters got a gradient; if not, every one must have one: locally_unused() names those that have none.
        .def_property_readonly("agrees_unused", [](const zx::Engine &e) { return e.book().agrees(); })
        .def("locally_unused", [](const zx::Engine &e) { return e.book().locally_unused(); })
        .def_property_readonly("grads_since_step", [](const zx::Engine &e) { return e.book().grads_since_step(); })
        .def("stepped_params", [](const zx::Engine &e) { return e.book().stepped_params(); })
        .def("param_steps", [](const zx::Engine &e) { return e.book().steps(); })
        .def("set_param_steps", &zx::Engine::set_param_steps)
        .def("zero_grad", &zx::Engine::zero_grad, py::arg("set_to_none"), all_groups,
             py::call_guard<py::gil_scoped_release>())
        .def("broadcast_tensors", &zx::Engine::broadcast_tensors, py::call_guard<py::gil_scoped_release>())
        .def("enable_sequence_check", [](zx::Engine &e, py::object store, double patience_s, py::object group,
                                         bool every_phase, int64_t id, py::object meet) {
                 const auto as_store = [](py::object o) {
                     c10::optional<zx::StorePtr> st;
                     if (!o.is_none()) st = o.cast<zx::StorePtr>();
                     return st;
                 };
                 c10::optional<zx::ProcessGroupPtr> g;
                 if (!group.is_none()) g = group.cast<zx::ProcessGroupPtr>();
                 e.enable_sequence_check(as_store(store), patience_s, g, every_phase, id, as_store(meet));
             },
             py::arg("store"), py::arg("patience_s"), py::arg("group"), py::arg("every_phase"), py::arg("id"),
             py::arg("meet") = py::none())
        .def("sequence_mark", &zx::Engine::sequence_mark, py::arg("phase"), py::arg("servable") = false,
             py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("sequence_away", &zx::Engine::sequence_away)
        .def_property_readonly("sequence_diverged", &zx::Engine::sequence_diverged)
        .def_property_readonly("sequence_exchanges", &zx::Engine::sequence_exchanges)
        .def("sequence_sync", &zx::Engine::sequence_sync, py::call_guard<py::gil_scoped_release>())
        .def("set_grad_wrappers", &zx::Engine::set_grad_wrappers)
        .def("hide_sharded_grads", &zx::Engine::hide_sharded_grads)
        .def_property_readonly("grad_generation", &zx::Engine::grad_generation)
        .def("state", &zx::Engine::state)
        .def("state_windows", &zx::Engine::state_windows)
        .def("states", [](zx::Engine &e) {
            py::dict d;
            for (auto &kv : e.states()) d[py::str(kv.first)] = kv.second;
            return d;
        })
        .def("stats", [](const zx::Engine &e) { return zx_stats_dict(e.stats()); })
        .def("set_comm_delay", &zx::Engine::set_comm_delay, py::arg("ms"), py::arg("serialize") = false)
        .def("describe_plan", [](const zx::Engine &e) { return e.layout().describe(); })
        .def("grad_divisor", [](const zx::Engine &e) { return e.layout().grad_divisor(); })
        .def_property_readonly("rank", [](const zx::Engine &e) { return e.layout().rank; })
        .def_property_readonly("world_size", [](const zx::Engine &e) { return e.layout().world; })
        .def_property_readonly("partitions", [](const zx::Engine &e) { return e.layout().partitions; })
        .def_property_readonly("isa", &zx::Engine::isa_name);
}
