// stats.cpp — EngineStats::of: what the engine's owners report about themselves (Note
// [Engine stats], stats.h): the model state's bytes, the working buffers', the collectives'
// counts, the tensor-atomic balance and, with offload, the host's bytes and copies.
#include "engine/stats.h"

#include "engine/grad_reducer.h"   // defines: GradReducer, and (through it) Layout, Bucket, Communicator
#include "engine/kernels.h"        // defines: KernelTables
#include "engine/offload.h"        // defines: Offload
#include "engine/param_gather.h"   // defines: ParamGather
#include "engine/shard_buffers.h"  // defines: ShardBuffers
#include "engine/unit_store.h"     // defines: UnitStore

namespace zx {

static std::optional<OffloadStats> offload_stats(const EngineStats::Sources &s) {
    if (!s.offload) return std::nullopt;
    OffloadStats o;
    o.master_weights = s.shard.master.nbytes();
    o.optimizer_states = s.shard.states.bytes();
    o.gradients = s.shard.grad.defined() ? s.shard.grad.nbytes() : 0;
    o.pinned_ring = s.offload->pinned_bytes();
    o.total = o.master_weights + o.optimizer_states + o.gradients + o.pinned_ring;
    o.down_copies = s.offload->down_copies();
    o.down_bytes = s.offload->down_bytes();
    o.up_copies = s.offload->up_copies();
    o.up_bytes = s.offload->up_bytes();
    return o;
}

EngineStats EngineStats::of(const Sources &s) {
    const Layout &layout = s.layout;
    const EngineOptions &o = layout.opts;
    const ShardBuffers &shard = s.shard;
    const bool off = s.offload != nullptr;
    const Secondary *sec = s.units.secondary.get();
    EngineStats st;
    int64_t param_bytes = 0, grad_bytes = 0, held = 0, numel = 0, padded = 0, gaps = 0;
    for (const auto &bk : s.buckets) {
        if (o.stage < 3) param_bytes += bk.flat_param.nbytes();
        if (bk.flat_grad.defined()) {
            grad_bytes += bk.flat_grad.nbytes();
            held += (int64_t)bk.flat_grad.storage().nbytes();   // Note [Bucket gradient lifetime]
        }
        numel += bk.numel;
        padded += bk.padded_numel;
        gaps += bk.gap_numel;
    }
    if (shard.grad.defined() && !off) {   // offload: in offload_stats()
        grad_bytes += shard.grad.nbytes();
        held += (int64_t)shard.grad.storage().nbytes();   // Note [Gradient shard lifetime]
    }
    int64_t master_bytes = 0;
    // stage 3: the fp32 master is the parameter shard; with a low param_dtype the gather
    // casts it, so no low-precision copy persists (it is counted as master weights)
    if (o.stage == 3 && !layout.dtypes.low() && !off) param_bytes += shard.master.nbytes();
    if (s.units.param_shard.defined()) param_bytes += s.units.param_shard.nbytes();   // offload, stage 3
    if ((layout.dtypes.low() || (s.gather.quantized() && o.stage < 3)) && !off)
        master_bytes = (shard.master.defined() ? shard.master.nbytes() : 0) + (shard.split ? shard.split->bytes() : 0);
    const int64_t state_bytes = off ? 0 : shard.states.bytes();
    ModelStateBytes &msb = st.model_state_bytes;
    msb.parameters = param_bytes;
    msb.gradients = grad_bytes;
    msb.master_weights = master_bytes;
    msb.optimizer_states = state_bytes;
    msb.total = param_bytes + grad_bytes + master_bytes + state_bytes;
    st.held_bytes.gradients = held;
    st.held_bytes.grad_ring = s.reducer.ring().bytes();
    BufferBytes &buf = st.buffer_bytes;
    buf.grad_ring = s.reducer.ring().step_bytes();
    buf.grad_landing = shard.land.defined() ? shard.land.nbytes() : 0;
    buf.ring_slots = s.reducer.ring().slots();
    buf.gathered_params = s.units.meter.now();
    buf.peak_gathered_params = s.units.meter.peak();
    const QuantReduce *quant = s.reducer.quant();
    buf.quant_buffers = quant ? quant->buffer_bytes() : 0;
    buf.quant_residual = quant ? quant->residual_bytes() : 0;
    const QuantGather *qg = s.gather.quant();
    buf.quant_gather_buffers = qg ? qg->buffer_bytes() : 0;
    buf.peak_quant_gather_buffers = qg ? qg->peak_buffer_bytes() : 0;
    buf.kernel_scratch = s.kernels.device->scratch_bytes();
    buf.split_master_scratch = shard.split ? shard.split->scratch_bytes() : 0;
    buf.secondary = sec ? sec->bytes() : 0;
    buf.peak_secondary = sec ? sec->peak_bytes() : 0;
    buf.total = buf.grad_ring + buf.grad_landing + buf.gathered_params + buf.quant_buffers + buf.quant_residual +
                buf.quant_gather_buffers + buf.kernel_scratch + buf.secondary + buf.split_master_scratch;
    st.stage = o.stage;
    st.world_size = layout.world;
    st.rank = layout.rank;
    st.isa = zx_isa_name(s.kernels.isa);
    st.device = layout.dev.str();
    st.kernels = s.kernels.device->name();
    st.num_params = numel;
    st.padded_numel = padded;
    st.alignment_padding_numel = gaps;
    st.shard_numel = layout.shard_numel;
    st.num_buckets = (int64_t)s.buckets.size();
    st.param_dtype = o.param_dtype;
    st.reduce_dtype = o.reduce_dtype;
    st.reduce_scatter_impl = s.reducer.quantized() ? (o.grad_quant_bits == 8 ? "alltoall-int8" : "alltoall-int4")
                             : o.alltoall_reduce_scatter ? "alltoall" : "native";
    st.param_gather_impl = s.gather.quantized() ? "allgather-int8" : "allgather";
    st.comm = s.comm.count;
    st.comm_wait_s = s.comm.waited_s() + (sec ? sec->comm().waited_s() : 0.0);
    st.comm_delay_ms = s.comm.delay_ms();
    if (sec) st.comm_groups = sec->group_stats(s.comm);   // Note [Per-group byte counters]
    st.reductions = s.reducer.pass().reductions();
    st.num_units = s.units.count();
    st.frozen_shard_bytes = s.units.frozen.shard_bytes();
    st.atomic = AtomicStats::of(layout, s.buckets, s.params);
    st.offload = offload_stats(s);
    return st;
}

}  // namespace zx
