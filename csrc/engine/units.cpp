// units.cpp — UnitStore (unit_store.h), stage 3: each unit's buckets gathered on demand
// (alone or coalesced with other small units), released after use, opened at fp32 for
// initialization, edited and committed back into the shards; the frozen parameters' side is
// frozen.cpp.
#include "engine/unit_store.h"

#include <algorithm>

namespace zx {

void UnitStore::enable_hierarchy(UnitWork w, ProcessGroupPtr node_pg) {
    TORCH_CHECK(w.layout().opts.stage == 3, "zero_ext: node_size (hierarchical partitioning) is for stage 3; "
                "use stage=3 or node_size=None");
    TORCH_CHECK(!secondary, "zero_ext: internal: enable_hierarchy called twice");
    auto sec = std::make_unique<Secondary>(std::move(node_pg), w.layout().world);
    for (auto *bks : {&w.buckets, &frozen.buckets()})
        for (const auto &bk : *bks)
            TORCH_CHECK(bk.padded_numel % sec->node_size() == 0, "zero_ext: internal: bucket of ",
                        bk.padded_numel, " elements does not split into ", sec->node_size(), " node parts");
    secondary = std::move(sec);
}

// Note [Stage 3 parameter lifetime]
//   Only shard_.master (this rank's slices, fp32) persists: with a low
//   param_dtype a gather casts the slice into its own place in flat_param and
//   all-gathers in place, so no low-precision copy is kept beside the master
//   (fp32 master + gradient + Adam's two states = 16 bytes per parameter, as
//   FSDP2's sharded fp32 parameter; the cast is the step's rounding, so the
//   gathered values are the same bits as a kept copy's). Each bucket's flat_param
//   keeps its tensor and storage object, but the storage is resized to 0 bytes
//   when released and back to full size when gathered, as FSDP2 does: the
//   parameters stay views of it and autograd's saved tensors stay aliases, so a
//   unit gathered again before its backward is seen by them. A bucket is
//   gathered before its unit's forward, released after it (Python hooks),
//   gathered again before its backward, and released as soon as its last
//   gradient is staged (mark_ready). The root unit (0) stays gathered from its
//   forward to the end of backward. While released, the parameters themselves
//   point at a 0-element tensor (set_data), so reading one outside forward gives
//   an empty tensor rather than reading freed memory; gathering points them back.

// Note [Coalesced unit gathers]
//   A gloo or NCCL collective costs a fixed latency however small it is, so a
//   model of many small units would pay two all-gathers per unit and step. The
//   Python hooks therefore ask for the small units ahead together
//   (coalesce_numel), and gather_units launches one all-gather for all of their
//   buckets: each rank's slices are copied into one staging slice, all-gathered,
//   and when any member is first waited for, every member still attached gets its
//   rows copied out (rank r's slice of a bucket sits at r * slice + offset) and
//   counts as gathered.
//   Each bucket is still gathered, counted and released as before; only the
//   collective is shared, and its staging pair is held until it completes.

void UnitStore::finish_group(UnitWork &w, const std::shared_ptr<GatherGroup> &g) {
    w.comm.watch(g->work, "unit all-gather");
    g->work.reset();
    const int64_t slice = g->in.numel();
    const at::Tensor rows = g->out.view({w.layout().world, slice});
    for (auto [m, offset] : g->members) {
        if (m->full.group != g) continue;
        m->flat_param.view({w.layout().world, m->slice_numel}).copy_(rows.narrow(1, offset, m->slice_numel));
        m->full.group.reset();
        mark_gathered(w, *m);
    }
    meter.sub(g->in.nbytes() + g->out.nbytes());
    g->in = at::Tensor();
    g->out = at::Tensor();
}

void UnitStore::wait_gather(UnitWork &w, Bucket &bk) {
    if (bk.full.group) finish_group(w, std::shared_ptr<GatherGroup>(bk.full.group));
    if (bk.full.work) {
        auto work = std::move(bk.full.work);
        bk.full.work.reset();
        const int64_t s = subject_of(w, bk);
        if (secondary && secondary->in_flight(s)) {   // Note [Hierarchical partitioning]
            secondary->comm().timed_wait(work, "node all-gather");
            secondary->finish(s);
        } else {
            w.comm.watch(work, "unit all-gather");
            if (w.gather.quantized() && !bk.frozen) w.gather.quant()->finish(s);
        }
        // A finished gather holds the full bucket, used or not: a prefetched unit that
        // the pass then skipped must still be freed (and uncounted) by release_bucket.
        mark_gathered(w, bk);
    }
}

void UnitStore::release_bucket(UnitWork w, Bucket &bk) {
    wait_gather(w, bk);
    const bool staged = bk.full.fp32_values.defined();
    if (!staged && !bk.full.gathered) return;   // the common case after backward: nothing held
    if (staged) {
        meter.sub(bk.full.fp32_values.nbytes());
        bk.full.fp32_values = at::Tensor();
    }
    if (bk.full.gathered) {
        w.kernels.device->resize_storage(bk.flat_param, 0);
        meter.sub(bk.flat_param.numel() * bk.flat_param.element_size());
        bk.full.gathered = false;
    }
    const at::Tensor empty = at::empty({0}, bk.flat_param.options());
    for (int64_t i : bk.params) (bk.frozen ? frozen.param(i) : w.params[i]).set_data(empty);
}

void UnitStore::release_pass(UnitWork w) {
    for (auto &bk : w.buckets) release_bucket(w, bk);
    release_all_frozen(w);   // Note [Stage 3 frozen parameters]
    if (secondary) secondary->drop_all();   // Note [Hierarchical partitioning]: the pass is over
}

void UnitStore::mark_gathered(UnitWork &w, Bucket &bk) {
    wait_gather(w, bk);
    if (bk.full.gathered) return;
    bk.full.gathered = true;
    if (bk.frozen)
        frozen.point_home(bk);
    else
        for (int64_t i : bk.params) w.params[i].set_data(param_views[i]);
}

at::Tensor UnitStore::gather_source(UnitWork &w, Bucket &bk, at::Tensor dst) {
    if (bk.frozen) return frozen.slice(bk);
    if (w.shard().offload) return param_shard.narrow(0, bk.shard_offset, bk.slice_numel);   // Note [Optimizer offload]
    if (!w.layout().dtypes.low()) return w.shard().master(bk);   // stage 3 fp32: the master is the slice
    w.kernels.device->cast_from_f32(bk.slice_numel, w.shard().master_data(bk), dst.data_ptr(),
                                    w.layout().dtypes.param_zx);
    return dst;
}

int64_t UnitStore::subject_of(UnitWork &w, const Bucket &bk) const {
    return bk.frozen ? (int64_t)w.buckets.size() + frozen.index(bk) : (int64_t)(&bk - w.buckets.data());
}

void UnitStore::launch_gather(UnitWork &w, Bucket &bk) {
    const int64_t bytes = bk.flat_param.numel() * bk.flat_param.element_size();
    w.kernels.device->resize_storage(bk.flat_param, bytes);
    meter.add(bytes);
    meter.note_peak();
    at::Tensor own = w.shard().owned(bk.flat_param, bk);
    at::Tensor in = gather_source(w, bk, own);   // with a low param_dtype: cast into place
    if (w.layout().world == 1) {
        if (!in.is_same(own)) own.copy_(in);
        mark_gathered(w, bk);
        return;
    }
    if (secondary && secondary->has(subject_of(w, bk))) {   // Note [Hierarchical partitioning]: in the node
        bk.full.work = secondary->launch(subject_of(w, bk), bk.flat_param);
        return;
    }
    w.comm.seq.subject(subject_of(w, bk), bk.unit);
    // param_quant: trainable buckets travel quantized from the exact master (frozen
    // ones have no master and stay exact)
    const auto master = [&] { return w.shard().master(bk); };
    bk.full.work = bk.frozen ? w.comm.all_gather(bk.flat_param, in)
                               : w.gather.start(w.comm, subject_of(w, bk), bk.flat_param, in, master);
}

bool UnitStore::gather_unit(UnitWork w, int64_t u, bool wait) {
    TORCH_CHECK(w.layout().opts.stage == 3, "zero_ext: internal: gather_unit is a stage-3 operation");
    bool prefetched = true;
    for (Bucket *bk : members(u, w.buckets)) {
        if (bk->full.gathered) continue;
        if (!bk->full.requested()) {
            prefetched = false;
            launch_gather(w, *bk);
        }
        if (wait) mark_gathered(w, *bk);
    }
    return prefetched;
}

void UnitStore::gather_units(UnitWork w, const std::vector<int64_t> &units) {
    TORCH_CHECK(w.layout().opts.stage == 3, "zero_ext: internal: gather_units is a stage-3 operation");
    std::vector<Bucket *> todo;
    for (int64_t u : units)
        for (Bucket *bk : members(u, w.buckets))
            if (!bk->full.requested() && std::find(todo.begin(), todo.end(), bk) == todo.end()) todo.push_back(bk);
    // Coalesce the buckets in the parameters' dtype; anything else goes alone (and
    // quantized gathers, which carry records rather than slices, and gathers from
    // node-local secondary parts).
    auto g = std::make_shared<GatherGroup>();
    int64_t slice = 0;
    for (Bucket *bk : todo) {
        if (w.layout().world == 1 || todo.size() == 1 || bk->flat_param.scalar_type() != w.layout().dtypes.param ||
            (w.gather.quantized() && !bk->frozen) ||
            (secondary && secondary->has(subject_of(w, *bk)))) {
            launch_gather(w, *bk);
            continue;
        }
        g->members.emplace_back(bk, slice);
        slice += bk->slice_numel;
    }
    if (g->members.empty()) return;
    if (g->members.size() == 1) {
        launch_gather(w, *g->members[0].first);
        return;
    }
    g->in = at::empty({slice}, w.layout().on_device(w.layout().dtypes.param));
    g->out = at::empty({slice * w.layout().world}, w.layout().on_device(w.layout().dtypes.param));
    meter.add(g->in.nbytes() + g->out.nbytes());
    for (auto [bk, offset] : g->members) {
        const int64_t bytes = bk->flat_param.numel() * bk->flat_param.element_size();
        w.kernels.device->resize_storage(bk->flat_param, bytes);
        meter.add(bytes);
        at::Tensor dst = g->in.narrow(0, offset, bk->slice_numel);
        at::Tensor src = gather_source(w, *bk, dst);
        if (!src.is_same(dst)) dst.copy_(src);
        bk->full.group = g;
    }
    meter.note_peak();
    const Bucket &first = *g->members[0].first;
    w.comm.seq.subject(subject_of(w, first), first.unit);
    g->work = w.comm.all_gather(g->out, g->in);
}

void UnitStore::release_unit(UnitWork w, int64_t u, bool keep) {
    for (Bucket *bk : members(u, w.buckets)) {   // trainable, then frozen
        if (secondary) {   // Note [Hierarchical partitioning]
            wait_gather(w, *bk);
            if (!keep)
                secondary->drop(subject_of(w, *bk));
            else if (bk->full.gathered)
                secondary->keep(subject_of(w, *bk), bk->flat_param);
        }
        release_bucket(w, *bk);
    }
}

void UnitStore::commit_unit(UnitWork w, int64_t u, int64_t src) {
    if (secondary) secondary->drop_all();   // the masters change
    for (int64_t b : buckets(u)) {
        Bucket &bk = w.buckets[b];
        if (bk.full.fp32_values.defined()) {   // open_unit_fp32: full-precision values
            w.comm.seq.subject(b, u);
            w.comm.broadcast(bk.full.fp32_values, src);
            w.shard().master(bk).copy_(w.shard().owned(bk.full.fp32_values, bk));
            if (w.shard().offload) w.step.upload(bk);
            release_bucket(w, bk);
            continue;
        }
        TORCH_CHECK(bk.full.gathered, "zero_ext: internal: commit_unit needs unit ", u, " gathered");
        w.comm.seq.subject(b, u);
        w.comm.broadcast(bk.flat_param, src);
        const at::Tensor owned = w.shard().owned(bk.flat_param, bk);
        if (w.layout().dtypes.low() || w.gather.quantized()) {
            w.gather.absorb(w.shard().master(bk), owned, w.layout().dtypes.param);
        } else {
            w.shard().master(bk).copy_(owned);
        }
        if (w.shard().offload) w.step.upload(bk);   // Note [Optimizer offload]: what the next gathers read
    }
    commit_frozen(w, u, src);
}

void UnitStore::open_unit_fp32(UnitWork w, int64_t u) {
    TORCH_CHECK(w.layout().opts.stage == 3, "zero_ext: internal: open_unit_fp32 is a stage-3 operation");
    buckets(u);   // checks u
    if (secondary) secondary->drop_all();
    if (!w.layout().dtypes.low()) {
        gather_unit(w, u, true);
        return;
    }
    open_frozen_fp32(w, u);
    for (int64_t b : buckets(u)) {
        Bucket &bk = w.buckets[b];
        release_bucket(w, bk);
        // The current fp32 masters (zeros before the first commit), so a unit opened
        // again after a commit keeps what was written to it.
        bk.full.fp32_values = at::empty({bk.padded_numel}, w.layout().on_device(at::kFloat));
        at::Tensor in = w.shard().master(bk);
        if (in.device() != w.layout().dev) in = in.to(w.layout().dev);   // offload: the collective runs on the device
        if (w.layout().world == 1) {
            bk.full.fp32_values.copy_(in);
        } else {
            w.comm.seq.subject(b, u);
            w.comm.watch(w.comm.all_gather(bk.full.fp32_values, in), "unit all-gather");
        }
        meter.add(bk.full.fp32_values.nbytes());
        meter.note_peak();
        for (int64_t i : bk.params)
            w.params[i].set_data(bk.full.fp32_values.narrow(0, w.layout().offset_of[i], param_views[i].numel())
                                    .view(param_views[i].sizes()));
    }
}

std::vector<at::Tensor> UnitStore::unit_part(UnitWork w, int64_t u) {
    std::vector<at::Tensor> out;
    for (Bucket *bk : members(u, w.buckets)) {
        at::Tensor dst = at::empty({bk->slice_numel}, bk->flat_param.options());
        at::Tensor in = gather_source(w, *bk, dst);
        out.push_back(in.is_same(dst) ? dst : in.clone());   // a snapshot, not a view of the shard
    }
    return out;
}

void UnitStore::install_unit(UnitWork w, int64_t u, const std::vector<std::vector<at::Tensor>> &parts) {
    const int64_t world = w.layout().world;
    const auto mem = members(u, w.buckets);
    TORCH_CHECK((int64_t)parts.size() == world, "zero_ext: internal: install_unit takes every rank's part");
    for (size_t m = 0; m < mem.size(); m++) {
        Bucket &bk = *mem[m];
        wait_gather(w, bk);
        if (bk.full.gathered) continue;
        const int64_t bytes = bk.flat_param.numel() * bk.flat_param.element_size();
        w.kernels.device->resize_storage(bk.flat_param, bytes);
        meter.add(bytes);
        meter.note_peak();
        const at::Tensor rows = bk.flat_param.view({world, bk.slice_numel});
        for (int64_t r = 0; r < world; r++) {
            TORCH_CHECK(m < parts[r].size() && parts[r][m].numel() == bk.slice_numel,
                        "zero_ext: internal: rank ", r, "'s part of unit ", u, " does not fit its bucket");
            rows[r].copy_(parts[r][m]);
        }
        mark_gathered(w, bk);
    }
}

bool UnitStore::unit_gathered(const std::vector<Bucket> &all, int64_t u) const {
    for (const Bucket *bk : members(u, all))
        if (!bk->full.gathered) return false;
    return true;
}

bool UnitStore::unit_requested(const std::vector<Bucket> &all, int64_t u) const {
    for (const Bucket *bk : members(u, all))
        if (!bk->full.requested()) return false;
    return true;
}

int64_t UnitStore::unit_numel(const std::vector<Bucket> &all, int64_t u) const {
    int64_t n = 0;
    for (const Bucket *bk : members(u, all)) n += bk->padded_numel;
    return n;
}

}  // namespace zx
