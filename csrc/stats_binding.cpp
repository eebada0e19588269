// stats_binding.cpp — the engine's reports (Note [Engine stats], engine/stats.h) as the
// dicts Python reads: engine.stats(), engine.atomic_stats(). Keys in each struct's field
// order; an empty comm_groups is a key left out, an empty offload an empty dict.
#include <torch/extension.h>

#include "engine/stats.h"

namespace py = pybind11;

namespace {

py::dict counter_dict(const zx::CommCounter &c) {
    py::dict d;
    d["calls"] = c.calls;
    d["numel"] = c.numel;
    d["bytes"] = c.bytes;
    d["wire_bytes"] = c.wire_bytes;
    return d;
}

py::dict comm_dict(const zx::CommStats &c) {
    py::dict d;
    d["all_reduce"] = counter_dict(c.all_reduce);
    d["reduce_scatter"] = counter_dict(c.reduce_scatter);
    d["all_gather"] = counter_dict(c.all_gather);
    d["broadcast"] = counter_dict(c.broadcast);
    d["used_flags"] = counter_dict(c.used_flags);
    return d;
}

py::dict comm_groups_dict(const zx::CommGroupStats &g) {
    py::dict intra = comm_dict(g.intra);
    intra["node_all_gather"] = counter_dict(g.node_all_gather);
    py::dict d;
    d["intra"] = intra;
    d["inter"] = comm_dict(g.inter);
    d["node_size"] = g.node_size;
    return d;
}

py::dict model_state_dict(const zx::ModelStateBytes &m) {
    py::dict d;
    d["parameters"] = m.parameters;
    d["gradients"] = m.gradients;
    d["master_weights"] = m.master_weights;
    d["optimizer_states"] = m.optimizer_states;
    d["total"] = m.total;
    return d;
}

py::dict buffer_dict(const zx::BufferBytes &b) {
    py::dict d;
    d["grad_ring"] = b.grad_ring;
    d["grad_landing"] = b.grad_landing;
    d["ring_slots"] = b.ring_slots;
    d["gathered_params"] = b.gathered_params;
    d["peak_gathered_params"] = b.peak_gathered_params;
    d["quant_buffers"] = b.quant_buffers;
    d["quant_residual"] = b.quant_residual;
    d["quant_gather_buffers"] = b.quant_gather_buffers;
    d["peak_quant_gather_buffers"] = b.peak_quant_gather_buffers;
    d["kernel_scratch"] = b.kernel_scratch;
    d["split_master_scratch"] = b.split_master_scratch;
    d["secondary"] = b.secondary;
    d["peak_secondary"] = b.peak_secondary;
    d["total"] = b.total;
    return d;
}

py::dict offload_dict(const std::optional<zx::OffloadStats> &o) {
    py::dict d;
    if (!o) return d;
    d["device"] = o->device;
    d["master_weights"] = o->master_weights;
    d["optimizer_states"] = o->optimizer_states;
    d["gradients"] = o->gradients;
    d["pinned_ring"] = o->pinned_ring;
    d["total"] = o->total;
    d["down_copies"] = o->down_copies;
    d["down_bytes"] = o->down_bytes;
    d["up_copies"] = o->up_copies;
    d["up_bytes"] = o->up_bytes;
    return d;
}

}  // namespace

py::dict zx_atomic_stats_dict(const zx::AtomicStats &a) {
    py::dict d;
    d["tensors"] = a.tensors;
    d["buckets"] = a.buckets;
    d["numel"] = a.numel;
    d["padding"] = a.padding;
    d["cost_per_rank"] = py::cast(a.cost_per_rank);     // a list
    d["numel_per_rank"] = py::cast(a.numel_per_rank);
    d["cost_balance"] = a.cost_balance;
    d["numel_balance"] = a.numel_balance;
    d["filled_numel"] = a.filled_numel;
    d["cut_params"] = a.cut_params;
    d["state_bytes_per_rank"] = py::cast(a.state_bytes_per_rank);
    d["state_balance"] = a.state_balance;
    return d;
}

py::dict zx_stats_dict(const zx::EngineStats &s) {
    py::dict d;
    d["stage"] = s.stage;
    d["world_size"] = s.world_size;
    d["rank"] = s.rank;
    d["isa"] = s.isa;
    d["device"] = s.device;
    d["kernels"] = s.kernels;
    d["num_params"] = s.num_params;
    d["padded_numel"] = s.padded_numel;
    d["alignment_padding_numel"] = s.alignment_padding_numel;
    d["shard_numel"] = s.shard_numel;
    d["num_buckets"] = s.num_buckets;
    d["param_dtype"] = s.param_dtype;
    d["reduce_dtype"] = s.reduce_dtype;
    d["reduce_scatter_impl"] = s.reduce_scatter_impl;
    d["param_gather_impl"] = s.param_gather_impl;
    d["model_state_bytes"] = model_state_dict(s.model_state_bytes);
    d["buffer_bytes"] = buffer_dict(s.buffer_bytes);
    py::dict held;   // Note [Gradient shard lifetime]
    held["gradients"] = s.held_bytes.gradients;
    held["grad_ring"] = s.held_bytes.grad_ring;
    d["held_bytes"] = held;
    d["comm"] = comm_dict(s.comm);
    d["comm_wait_s"] = s.comm_wait_s;
    d["comm_delay_ms"] = s.comm_delay_ms;
    if (s.comm_groups) d["comm_groups"] = comm_groups_dict(*s.comm_groups);
    d["reductions"] = s.reductions;
    d["num_units"] = s.num_units;
    d["frozen_shard_bytes"] = s.frozen_shard_bytes;
    d["atomic"] = zx_atomic_stats_dict(s.atomic);
    d["offload"] = offload_dict(s.offload);
    return d;
}
