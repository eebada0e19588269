// units.cpp — stage 3: each unit's buckets gathered on demand (alone or coalesced with other
// small units), released after use, opened at fp32 for initialization, edited and committed
// back into the shards; the frozen parameters' side is frozen.cpp.
#include "engine/engine.h"

#include <algorithm>

namespace zx {

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

void Engine::finish_group(const std::shared_ptr<GatherGroup> &g) {
    comm_.watch(g->work, "unit all-gather");
    g->work.reset();
    const int64_t slice = g->in.numel();
    const at::Tensor rows = g->out.view({layout_.world, slice});
    for (auto [m, offset] : g->members) {
        if (m->full.group != g) continue;
        m->flat_param.view({layout_.world, m->slice_numel}).copy_(rows.narrow(1, offset, m->slice_numel));
        m->full.group.reset();
        mark_gathered(*m);
    }
    units_.meter.sub(g->in.nbytes() + g->out.nbytes());
    g->in = at::Tensor();
    g->out = at::Tensor();
}

void Engine::wait_gather(Bucket &bk) {
    if (bk.full.group) finish_group(std::shared_ptr<GatherGroup>(bk.full.group));
    if (bk.full.work) {
        auto work = std::move(bk.full.work);
        bk.full.work.reset();
        const int64_t s = subject_of(bk);
        if (units_.secondary && units_.secondary->in_flight(s)) {   // Note [Hierarchical partitioning]
            units_.secondary->comm().timed_wait(work, "node all-gather");
            units_.secondary->finish(s);
        } else {
            comm_.watch(work, "unit all-gather");
            if (gather_.quantized() && !bk.frozen) gather_.quant()->finish(s);
        }
        // A finished gather holds the full bucket, used or not: a prefetched unit that
        // the pass then skipped must still be freed (and uncounted) by release_bucket.
        mark_gathered(bk);
    }
}

void Engine::release_bucket(Bucket &bk) {
    wait_gather(bk);
    const bool staged = bk.full.fp32_values.defined();
    if (!staged && !bk.full.gathered) return;   // the common case after backward: nothing held
    if (staged) {
        units_.meter.sub(bk.full.fp32_values.nbytes());
        bk.full.fp32_values = at::Tensor();
    }
    if (bk.full.gathered) {
        kernels_.device->resize_storage(bk.flat_param, 0);
        units_.meter.sub(bk.flat_param.numel() * bk.flat_param.element_size());
        bk.full.gathered = false;
    }
    const at::Tensor empty = at::empty({0}, bk.flat_param.options());
    for (int64_t i : bk.params) (bk.frozen ? units_.frozen.param(i) : params_[i]).set_data(empty);
}

void Engine::release_pass() {
    for (auto &bk : buckets_) release_bucket(bk);
    release_all_frozen();   // Note [Stage 3 frozen parameters]
    if (units_.secondary) units_.secondary->drop_all();   // Note [Hierarchical partitioning]: the pass is over
}

void Engine::mark_gathered(Bucket &bk) {
    wait_gather(bk);
    if (bk.full.gathered) return;
    bk.full.gathered = true;
    if (bk.frozen)
        units_.frozen.point_home(bk);
    else
        for (int64_t i : bk.params) params_[i].set_data(units_.param_views[i]);
}

at::Tensor Engine::gather_source(Bucket &bk, at::Tensor dst) {
    if (bk.frozen) return units_.frozen.slice(bk);
    if (off_) return units_.param_shard.narrow(0, bk.shard_offset, bk.slice_numel);   // Note [Optimizer offload]
    if (!layout_.dtypes.low()) return master_slice(bk);   // stage 3 fp32: the master is the slice
    kernels_.device->cast_from_f32(bk.slice_numel, view().master_data(bk), dst.data_ptr(), layout_.dtypes.param_zx);
    return dst;
}

int64_t Engine::subject_of(const Bucket &bk) const {
    return bk.frozen ? (int64_t)buckets_.size() + units_.frozen.index(bk) : (int64_t)(&bk - buckets_.data());
}

void Engine::launch_gather(Bucket &bk) {
    const int64_t bytes = bk.flat_param.numel() * bk.flat_param.element_size();
    kernels_.device->resize_storage(bk.flat_param, bytes);
    units_.meter.add(bytes);
    units_.meter.note_peak();
    at::Tensor own = view().owned(bk.flat_param, bk);
    at::Tensor in = gather_source(bk, own);   // with a low param_dtype: cast into place
    if (layout_.world == 1) {
        if (!in.is_same(own)) own.copy_(in);
        mark_gathered(bk);
        return;
    }
    if (units_.secondary && units_.secondary->has(subject_of(bk))) {   // Note [Hierarchical partitioning]: in the node
        bk.full.work = units_.secondary->launch(subject_of(bk), bk.flat_param);
        return;
    }
    comm_.seq.subject(subject_of(bk), bk.unit);
    // param_quant: trainable buckets travel quantized from the exact master (frozen
    // ones have no master and stay exact)
    const auto master = [&] { return master_slice(bk); };
    bk.full.work = bk.frozen ? comm_.all_gather(bk.flat_param, in)
                               : gather_.start(comm_, subject_of(bk), bk.flat_param, in, master);
}

bool Engine::gather_unit(int64_t u, bool wait) {
    TORCH_CHECK(layout_.opts.stage == 3, "zero_ext: internal: gather_unit is a stage-3 operation");
    bool prefetched = true;
    for (Bucket *bk : units_.members(u, buckets_)) {
        if (bk->full.gathered) continue;
        if (!bk->full.requested()) {
            prefetched = false;
            launch_gather(*bk);
        }
        if (wait) mark_gathered(*bk);
    }
    return prefetched;
}

void Engine::gather_units(const std::vector<int64_t> &units) {
    TORCH_CHECK(layout_.opts.stage == 3, "zero_ext: internal: gather_units is a stage-3 operation");
    std::vector<Bucket *> todo;
    for (int64_t u : units)
        for (Bucket *bk : units_.members(u, buckets_))
            if (!bk->full.requested() && std::find(todo.begin(), todo.end(), bk) == todo.end()) todo.push_back(bk);
    // Coalesce the buckets in the parameters' dtype; anything else goes alone (and
    // quantized gathers, which carry records rather than slices, and gathers from
    // node-local secondary parts).
    auto g = std::make_shared<GatherGroup>();
    int64_t slice = 0;
    for (Bucket *bk : todo) {
        if (layout_.world == 1 || todo.size() == 1 || bk->flat_param.scalar_type() != layout_.dtypes.param ||
            (gather_.quantized() && !bk->frozen) ||
            (units_.secondary && units_.secondary->has(subject_of(*bk)))) {
            launch_gather(*bk);
            continue;
        }
        g->members.emplace_back(bk, slice);
        slice += bk->slice_numel;
    }
    if (g->members.empty()) return;
    if (g->members.size() == 1) {
        launch_gather(*g->members[0].first);
        return;
    }
    g->in = at::empty({slice}, on_device(layout_.dtypes.param));
    g->out = at::empty({slice * layout_.world}, on_device(layout_.dtypes.param));
    units_.meter.add(g->in.nbytes() + g->out.nbytes());
    for (auto [bk, offset] : g->members) {
        const int64_t bytes = bk->flat_param.numel() * bk->flat_param.element_size();
        kernels_.device->resize_storage(bk->flat_param, bytes);
        units_.meter.add(bytes);
        at::Tensor dst = g->in.narrow(0, offset, bk->slice_numel);
        at::Tensor src = gather_source(*bk, dst);
        if (!src.is_same(dst)) dst.copy_(src);
        bk->full.group = g;
    }
    units_.meter.note_peak();
    const Bucket &first = *g->members[0].first;
    comm_.seq.subject(subject_of(first), first.unit);
    g->work = comm_.all_gather(g->out, g->in);
}

void Engine::release_unit(int64_t u, bool keep) {
    for (Bucket *bk : units_.members(u, buckets_)) {   // trainable, then frozen
        if (units_.secondary) {   // Note [Hierarchical partitioning]
            wait_gather(*bk);
            if (!keep)
                units_.secondary->drop(subject_of(*bk));
            else if (bk->full.gathered)
                units_.secondary->keep(subject_of(*bk), bk->flat_param);
        }
        release_bucket(*bk);
    }
}

void Engine::commit_unit(int64_t u, int64_t src) {
    if (units_.secondary) units_.secondary->drop_all();   // the masters change
    for (int64_t b : units_.buckets(u)) {
        Bucket &bk = buckets_[b];
        if (bk.full.fp32_values.defined()) {   // open_unit_fp32: full-precision values
            comm_.seq.subject(b, u);
            broadcast_tensors({bk.full.fp32_values}, src);
            master_slice(bk).copy_(view().owned(bk.full.fp32_values, bk));
            if (off_) stepper().upload(bk);
            release_bucket(bk);
            continue;
        }
        TORCH_CHECK(bk.full.gathered, "zero_ext: internal: commit_unit needs unit ", u, " gathered");
        comm_.seq.subject(b, u);
        broadcast_tensors({bk.flat_param}, src);
        const at::Tensor owned = view().owned(bk.flat_param, bk);
        if (layout_.dtypes.low() || gather_.quantized()) {
            gather_.absorb(master_slice(bk), owned, layout_.dtypes.param);
        } else {
            master_slice(bk).copy_(owned);
        }
        if (off_) stepper().upload(bk);   // Note [Optimizer offload]: what the next gathers read
    }
    commit_frozen(u, src);
}

void Engine::open_unit_fp32(int64_t u) {
    TORCH_CHECK(layout_.opts.stage == 3, "zero_ext: internal: open_unit_fp32 is a stage-3 operation");
    units_.buckets(u);   // checks u
    if (units_.secondary) units_.secondary->drop_all();
    if (!layout_.dtypes.low()) {
        gather_unit(u, true);
        return;
    }
    open_frozen_fp32(u);
    for (int64_t b : units_.buckets(u)) {
        Bucket &bk = buckets_[b];
        release_bucket(bk);
        // The current fp32 masters (zeros before the first commit), so a unit opened
        // again after a commit keeps what was written to it.
        bk.full.fp32_values = at::empty({bk.padded_numel}, on_device(at::kFloat));
        at::Tensor in = master_slice(bk);
        if (in.device() != layout_.dev) in = in.to(layout_.dev);   // offload: the collective runs on the device
        if (layout_.world == 1) {
            bk.full.fp32_values.copy_(in);
        } else {
            comm_.seq.subject(b, u);
            comm_.watch(comm_.all_gather(bk.full.fp32_values, in), "unit all-gather");
        }
        units_.meter.add(bk.full.fp32_values.nbytes());
        units_.meter.note_peak();
        for (int64_t i : bk.params)
            params_[i].set_data(bk.full.fp32_values.narrow(0, layout_.offset_of[i], units_.param_views[i].numel())
                                    .view(units_.param_views[i].sizes()));
    }
}

bool Engine::unit_gathered(int64_t u) const {
    for (const Bucket *bk : units_.members(u, buckets_))
        if (!bk->full.gathered) return false;
    return true;
}

bool Engine::unit_requested(int64_t u) const {
    for (const Bucket *bk : units_.members(u, buckets_))
        if (!bk->full.requested()) return false;
    return true;
}

int64_t Engine::unit_numel(int64_t u) const {
    int64_t n = 0;
    for (const Bucket *bk : units_.members(u, buckets_)) n += bk->padded_numel;
    return n;
}

}  // namespace zx
