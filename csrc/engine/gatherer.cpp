// gatherer.cpp — parameters every rank computes with: the stage 0-2
// all-gather of the owned slices after a step, and stage-3 units gathered on
// demand, released after use, edited and committed back into the shards.
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

void Engine::absorb(at::Tensor master, const at::Tensor &lp_in) {
    // offload: the master is in host memory (Note [Optimizer offload])
    const at::Tensor lp_new = lp_in.device() == master.device() ? lp_in : lp_in.to(master.device());
    // Only elements whose low-precision (param_quant: dequantized) value changed take the new value.
    at::Tensor changed = lp_new.ne(gather_.as_gathered(master, layout_.dtypes.param));
    master.copy_(at::where(changed, lp_new.to(at::kFloat), master));
}

void Engine::publish_params() {
    wait_params();
    cast_masters();
    if (layout_.opts.stage == 3) {
        // Gathered units hold stale values: release them; the next gather reads the shards.
        if (units_.secondary) units_.secondary->drop_all();
        for (auto &bk : buckets_) release_bucket(bk);
        release_all_frozen();
        return;
    }
    all_gather_params();
    wait_params();
}

void Engine::absorb_param_edits() {
    TORCH_CHECK(layout_.opts.stage <= 2,
                "zero_ext: internal: absorb_param_edits is for stages 0-2 (stage 3: commit_unit)");
    wait_params();
    if (params_.any_cut()) copy_cut_params(false);   // Note [Cut parameters]: their edits live in their own storage
    if (!layout_.dtypes.low() && !gather_.quantized() && !off_) return;   // the owned slice is the master
    // Note [Split master in the engine]: without a joined master the edits already are its top halves
    if (shard_.split && !shard_.master.defined()) return;
    for (auto &bk : buckets_) absorb(master_slice(bk), owned_slice(bk.flat_param, bk));
}

void Engine::all_gather_params() {
    if (layout_.partitions == 1 || layout_.opts.stage == 3) {   // stage 3 gathers per unit, on demand
        if (params_.any_cut()) copy_cut_params(true);
        return;
    }
    wait_params();
    // Last bucket first: buckets fill in gradient order (the model's last layers first),
    // so the first layers' parameters, which the next forward needs first, are gathered first.
    for (int64_t b = (int64_t)buckets_.size() - 1; b >= 0; b--) {
        Bucket &bk = buckets_[b];
        if (bk.mixed) {
            // Note [Cut parameters]: gathered once every group inside has stepped.
            bool all = true;
            for (size_t k = 0; k < bk.groups.size(); k++) {
                if (active_group(bk.groups[k])) bk.stepped[k] = 1;
                all = all && bk.stepped[k];
            }
            if (!all) continue;
            std::fill(bk.stepped.begin(), bk.stepped.end(), 0);
        } else if (!active(bk)) {
            continue;
        }
        launch_param_gather(b);
    }
}

void Engine::launch_param_gather(int64_t b) {
    Bucket &bk = buckets_[b];
    at::Tensor in = owned_slice(bk.flat_param, bk);   // in place: the owned slice of the output
    comm_.seq.subject(b, -1);
    gather_.launch(comm_, b, bk.flat_param, in, [&] { return master_slice(bk); });
    params_.gathered();
}

void Engine::flush_params(bool wait) {
    // Note [Cut parameters]: a mixed bucket some of whose optimizers did not step this
    // iteration is gathered now, with what did step (the same buckets on every rank).
    std::vector<int64_t> pending;
    for (int64_t b = 0; b < (int64_t)buckets_.size(); b++) {
        std::vector<char> &st = buckets_[b].stepped;
        if (std::find(st.begin(), st.end(), 1) == st.end()) continue;
        std::fill(st.begin(), st.end(), 0);
        pending.push_back(b);
    }
    if (!pending.empty()) {
        wait_params();
        for (int64_t b : pending) launch_param_gather(b);
    }
    if (wait) wait_params();
}

void Engine::wait_param_buckets(const std::vector<int64_t> &buckets) {
    if (params_.any_cut()) {   // a cut parameter is copied out once all of its buckets have arrived
        wait_params();
        return;
    }
    gather_.wait(comm_, buckets);
}

void Engine::wait_params() {
    gather_.wait_all(comm_);
    if (params_.stale()) copy_cut_params(true);
}

void Engine::broadcast_tensors(std::vector<at::Tensor> tensors, int64_t src) {
    for (auto &t : tensors) comm_.broadcast(t, src);
}

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
        if (m->gather_group != g) continue;
        m->flat_param.view({layout_.world, m->slice_numel}).copy_(rows.narrow(1, offset, m->slice_numel));
        m->gather_group.reset();
        mark_gathered(*m);
    }
    units_.meter.sub(g->in.nbytes() + g->out.nbytes());
    g->in = at::Tensor();
    g->out = at::Tensor();
}

void Engine::wait_gather(Bucket &bk) {
    if (bk.gather_group) finish_group(std::shared_ptr<GatherGroup>(bk.gather_group));
    if (bk.gather_work) {
        auto work = std::move(bk.gather_work);
        bk.gather_work.reset();
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
    const bool staged = bk.fp32_values.defined();
    if (!staged && !bk.gathered) return;   // the common case after backward: nothing held
    if (staged) {
        units_.meter.sub(bk.fp32_values.nbytes());
        bk.fp32_values = at::Tensor();
    }
    if (bk.gathered) {
        kernels_.device->resize_storage(bk.flat_param, 0);
        units_.meter.sub(bk.flat_param.numel() * bk.flat_param.element_size());
        bk.gathered = false;
    }
    const at::Tensor empty = at::empty({0}, bk.flat_param.options());
    for (int64_t i : bk.params) (bk.frozen ? units_.frozen.param(i) : params_[i]).set_data(empty);
}

void Engine::mark_gathered(Bucket &bk) {
    wait_gather(bk);
    if (bk.gathered) return;
    bk.gathered = true;
    if (bk.frozen)
        units_.frozen.point_home(bk);
    else
        for (int64_t i : bk.params) params_[i].set_data(units_.param_views[i]);
}

at::Tensor Engine::gather_source(Bucket &bk, at::Tensor dst) {
    if (bk.frozen) return units_.frozen.slice(bk);
    if (off_) return units_.param_shard.narrow(0, bk.shard_offset, bk.slice_numel);   // Note [Optimizer offload]
    if (!layout_.dtypes.low()) return master_slice(bk);   // stage 3 fp32: the master is the slice
    kernels_.device->cast_from_f32(bk.slice_numel, master(bk), dst.data_ptr(), layout_.dtypes.param_zx);
    return dst;
}

int64_t Engine::subject_of(const Bucket &bk) const {
    return bk.frozen ? (int64_t)buckets_.size() + units_.frozen.index(bk) : (int64_t)(&bk - buckets_.data());
}

std::vector<Bucket *> Engine::unit_gather_buckets(int64_t u) {
    std::vector<Bucket *> out;
    for (int64_t b : units_.buckets(u)) out.push_back(&buckets_[b]);
    if (Bucket *f = units_.frozen.of_unit(u)) out.push_back(f);
    return out;
}

void Engine::launch_gather(Bucket &bk) {
    const int64_t bytes = bk.flat_param.numel() * bk.flat_param.element_size();
    kernels_.device->resize_storage(bk.flat_param, bytes);
    units_.meter.add(bytes);
    units_.meter.note_peak();
    at::Tensor own = owned_slice(bk.flat_param, bk);
    at::Tensor in = gather_source(bk, own);   // with a low param_dtype: cast into place
    if (layout_.world == 1) {
        if (!in.is_same(own)) own.copy_(in);
        mark_gathered(bk);
        return;
    }
    if (units_.secondary && units_.secondary->has(subject_of(bk))) {   // Note [Hierarchical partitioning]: in the node
        bk.gather_work = units_.secondary->launch(subject_of(bk), bk.flat_param);
        return;
    }
    comm_.seq.subject(subject_of(bk), bk.unit);
    // param_quant: trainable buckets travel quantized from the exact master (frozen
    // ones have no master and stay exact)
    const auto master = [&] { return master_slice(bk); };
    bk.gather_work = bk.frozen ? comm_.all_gather(bk.flat_param, in)
                               : gather_.start(comm_, subject_of(bk), bk.flat_param, in, master);
}

static bool requested(const Bucket &bk) { return bk.gathered || bk.gather_work || bk.gather_group; }

bool Engine::gather_unit(int64_t u, bool wait) {
    TORCH_CHECK(layout_.opts.stage == 3, "zero_ext: internal: gather_unit is a stage-3 operation");
    bool prefetched = true;
    for (Bucket *bk : unit_gather_buckets(u)) {
        if (bk->gathered) continue;
        if (!requested(*bk)) {
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
        for (Bucket *bk : unit_gather_buckets(u))
            if (!requested(*bk) && std::find(todo.begin(), todo.end(), bk) == todo.end()) todo.push_back(bk);
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
        bk->gather_group = g;
    }
    units_.meter.note_peak();
    const Bucket &first = *g->members[0].first;
    comm_.seq.subject(subject_of(first), first.unit);
    g->work = comm_.all_gather(g->out, g->in);
}

void Engine::release_unit(int64_t u, bool keep) {
    for (Bucket *bk : unit_gather_buckets(u)) {   // trainable, then frozen
        if (units_.secondary) {   // Note [Hierarchical partitioning]
            wait_gather(*bk);
            if (!keep)
                units_.secondary->drop(subject_of(*bk));
            else if (bk->gathered)
                units_.secondary->keep(subject_of(*bk), bk->flat_param);
        }
        release_bucket(*bk);
    }
}

void Engine::commit_unit(int64_t u, int64_t src) {
    if (units_.secondary) units_.secondary->drop_all();   // the masters change
    for (int64_t b : units_.buckets(u)) {
        Bucket &bk = buckets_[b];
        if (bk.fp32_values.defined()) {   // open_unit_fp32: full-precision values
            comm_.seq.subject(b, u);
            broadcast_tensors({bk.fp32_values}, src);
            master_slice(bk).copy_(owned_slice(bk.fp32_values, bk));
            if (off_) upload(bk);
            release_bucket(bk);
            continue;
        }
        TORCH_CHECK(bk.gathered, "zero_ext: internal: commit_unit needs unit ", u, " gathered");
        comm_.seq.subject(b, u);
        broadcast_tensors({bk.flat_param}, src);
        const at::Tensor owned = owned_slice(bk.flat_param, bk);
        if (layout_.dtypes.low() || gather_.quantized()) {
            absorb(master_slice(bk), owned);
        } else {
            master_slice(bk).copy_(owned);
        }
        if (off_) upload(bk);   // Note [Optimizer offload]: what the next gathers read
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
        bk.fp32_values = at::empty({bk.padded_numel}, on_device(at::kFloat));
        at::Tensor in = master_slice(bk);
        if (in.device() != layout_.dev) in = in.to(layout_.dev);   // offload: the collective runs on the device
        if (layout_.world == 1) {
            bk.fp32_values.copy_(in);
        } else {
            comm_.seq.subject(b, u);
            comm_.watch(comm_.all_gather(bk.fp32_values, in), "unit all-gather");
        }
        units_.meter.add(bk.fp32_values.nbytes());
        units_.meter.note_peak();
        for (int64_t i : bk.params)
            params_[i].set_data(bk.fp32_values.narrow(0, layout_.offset_of[i], units_.param_views[i].numel())
                                    .view(units_.param_views[i].sizes()));
    }
}

bool Engine::unit_gathered(int64_t u) const {
    for (int64_t b : units_.buckets(u))
        if (!buckets_[b].gathered) return false;
    const Bucket *f = units_.frozen.of_unit(u);
    return f == nullptr || f->gathered;
}

bool Engine::unit_requested(int64_t u) const {
    for (int64_t b : units_.buckets(u))
        if (!requested(buckets_[b])) return false;
    const Bucket *f = units_.frozen.of_unit(u);
    return f == nullptr || requested(*f);
}

int64_t Engine::unit_numel(int64_t u) const {
    const Bucket *f = units_.frozen.of_unit(u);
    int64_t n = f != nullptr ? f->padded_numel : 0;
    for (int64_t b : units_.buckets(u)) n += buckets_[b].padded_numel;
    return n;
}

}  // namespace zx
