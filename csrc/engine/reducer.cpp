// reducer.cpp — backward: gradient readiness, the stage-2 ring of staging
// buffers, reductions launched strictly in bucket order (all-reduce in stage 0,
// reduce-scatter or all-to-all + local sum in stages 1-3), zero_grad.
#include "engine/engine.h"

namespace zx {

// Note [Gradient sums in stages 1-2]
//   Stage 0 divides each bucket by N before its SUM all-reduce, as DDP does, so
//   param.grad holds the average. Stages 1-2 reduce with SUM (never AVG: gloo's
//   AVG has been wrong) and keep the *sum* in the owned gradient slice; the
//   1/N is folded into the optimizer kernel's grad_scale (and into the norm).
//   Keeping sums makes a second backward without zero_grad() still correct:
//   after a stage-1 reduce-scatter the non-owned parts of the bucket are
//   zeroed, so the next reduce-scatter adds exactly the new gradients.

// A sparse gradient (nn.Embedding(sparse=True) after zeroify, F.embedding(sparse=True))
// has no flat layout to shard; the message names the parameter.
static void require_dense(const Engine &e, int64_t i, const at::Tensor &g) {
    TORCH_CHECK(!g.defined() || !g.is_sparse(), "zero_ext: ", e.pname(i), " got a sparse gradient, which cannot "
                "be sharded; produce a dense one: nn.Embedding(..., sparse=False), F.embedding(..., sparse=False)");
}

void Engine::ensure_grad_view(int64_t i) {
    at::Tensor &p = params_[i];
    const at::Tensor &g = p.grad();
    const at::Tensor &view = sharded_grads_.views[i];
    require_dense(*this, i, g);
    if (params_.cut(i)) {
        // Note [Cut parameters]: added piece by piece into each bucket's flat_grad.
        if (g.defined()) {
            const at::Tensor flat = g.reshape(-1);
            for (const zx_piece &pc : params_.pieces(i))
                buckets_[pc.bucket].flat_grad.narrow(0, pc.offset, pc.numel).add_(flat.narrow(0, pc.param_offset, pc.numel));
            p.mutable_grad() = at::Tensor();
        }
        return;
    }
    if (!sharded_grads_.views_ok) {
        // Note [Mixed precision]: accumulate in reduce_dtype, keep no param.grad.
        if (g.defined()) {
            view.add_(g);
            p.mutable_grad() = at::Tensor();
        }
        return;
    }
    if (g.defined() && g.data_ptr() == view.data_ptr()) return;
    // Autograd made a fresh tensor (first backward or after zero_grad(set_to_none)):
    // the bucket region was zeroed by zero_grad, so this gradient replaces it.
    if (g.defined()) view.copy_(g);
    p.mutable_grad() = view;
}

void Engine::stage_grad(int64_t i) {
    at::Tensor &p = params_[i];
    const at::Tensor g = p.grad();
    require_dense(*this, i, g);
    const at::Tensor flat = g.defined() ? g.reshape(-1) : at::Tensor();
    for (const zx_piece &pc : params_.pieces(i)) {   // one piece unless cut (Note [Cut parameters])
        Bucket &bk = buckets_[pc.bucket];
        if (bk.slot < 0) acquire_slot(pc.bucket);
        at::Tensor dst = reducer_.ring()[bk.slot].send.narrow(0, pc.offset, pc.numel);
        if (flat.defined())
            dst.copy_(flat.narrow(0, pc.param_offset, pc.numel));
        else
            dst.zero_();
    }
    p.mutable_grad() = at::Tensor();   // stage 2 keeps no full gradient
}

// Note [Local accumulation]
//   no_sync() / require_backward_grad_sync = False defers the reduction to the
//   first backward with sync on, as DDP does: that micro-step sends no gradient
//   bytes. Stages 0-1 accumulate in their full gradient buckets. Stages 2-3 keep
//   no full gradient, so a micro-step without sync adds each parameter's
//   gradient into its bucket's local_grad (reduce_dtype, allocated at the first
//   such micro-step: the full-size gradient DDP and FSDP2 hold while they
//   accumulate) and frees param.grad; the next reduction of the bucket sends
//   local_grad plus that backward's gradients and frees it. Without no_sync,
//   stages 2-3 reduce every micro-step into the shard and hold no full gradient.
void Engine::accumulate_local(int64_t i) {
    at::Tensor &p = params_[i];
    const at::Tensor g = p.grad();
    require_dense(*this, i, g);
    if (!g.defined()) return;
    const at::Tensor flat = g.reshape(-1);
    for (const zx_piece &pc : params_.pieces(i)) {
        Bucket &bk = buckets_[pc.bucket];
        if (!bk.local_grad.defined())
            bk.local_grad = at::zeros({bk.padded_numel}, on_device(layout_.dtypes.reduce));
        bk.local_grad.narrow(0, pc.offset, pc.numel).add_(flat.narrow(0, pc.param_offset, pc.numel));
    }
    p.mutable_grad() = at::Tensor();
}

void Engine::mark_ready(int64_t i) {
    TORCH_CHECK(i >= 0 && i < (int64_t)params_.size(), "zero_ext: internal: bad parameter index ", i);
    book_.note_grad(i);
    if (layout_.opts.stage <= 1) ensure_grad_view(i);
    BackwardPass &pass = reducer_.pass();
    const bool reduce_now = layout_.opts.stage >= 2 || pass.require_sync();
    if (layout_.opts.stage >= 2 && !pass.require_sync()) {
        accumulate_local(i);
        if (layout_.opts.stage == 3) {   // its backward is over: release as a reducing pass would
            for (const zx_piece &pc : params_.pieces(i)) {
                Bucket &bk = buckets_[pc.bucket];
                if (--bk.pending == 0 && bk.unit != 0) release_bucket(bk);
            }
        }
        return;
    }
    if (!reduce_now) return;
    if (layout_.opts.stage >= 2) stage_grad(i);
    TORCH_CHECK(!pass.ready(i), "zero_ext: ", pname(i),
                " got its gradient twice in one backward pass (its gradient was reduced already); if you "
                "call backward() twice, call it under model.no_sync() for all but the last, or step in between");
    pass.set_ready(i);
    bool done = false;
    for (const zx_piece &pc : params_.pieces(i)) {
        Bucket &bk = buckets_[pc.bucket];
        if (--bk.pending > 0) continue;
        done = true;
        // Stage 3: its backward is over; the root unit waits for the end.
        if (layout_.opts.stage == 3 && bk.unit != 0) release_bucket(bk);
    }
    // Launch strictly in bucket order so that every rank issues the same collectives.
    if (done)
        pass.launch_in_order((int64_t)buckets_.size(), [&](int64_t b) { return buckets_[b].pending == 0; },
                             [&](int64_t b) { launch(b); });
}

void Engine::finalize_backward() {
    BackwardPass &pass = reducer_.pass();
    if (!pass.require_sync()) {   // Note [Local accumulation]: nothing sent
        if (layout_.opts.stage == 3) {
            for (auto &bk : buckets_) {
                release_bucket(bk);
                bk.pending = (int64_t)bk.params.size();
            }
            release_all_frozen();
            if (units_.secondary) units_.secondary->drop_all();
        }
        return;
    }
    // Parameters that got no gradient this pass: their region holds zeros or
    // earlier accumulated gradients (stage 0/1), or is zero-filled (stage 2).
    for (int64_t i = 0; i < (int64_t)params_.size(); i++) {
        if (pass.ready(i)) continue;
        if (layout_.opts.stage >= 2) stage_grad(i);
        pass.set_ready(i);
        for (const zx_piece &pc : params_.pieces(i)) buckets_[pc.bucket].pending--;
    }
    pass.launch_in_order((int64_t)buckets_.size(), [](int64_t) { return true; }, [&](int64_t b) { launch(b); });
    reducer_.launch_group(comm_);   // Note [Coalesced gradient reductions]: what is left
    // Note [Reductions end with backward]
    // As DDP's reducer does, wait here.
    // The reductions overlapped the rest of backward; the step needs them next
    // anyway, and no later backward may write into a bucket (stage 0/1) or a
    // ring slot (stage 2) that a collective is still reading.
    wait_reductions();
    if (layout_.opts.stage == 3) {
        for (auto &bk : buckets_) release_bucket(bk);
        release_all_frozen();   // Note [Stage 3 frozen parameters]
        if (units_.secondary) units_.secondary->drop_all();   // Note [Hierarchical partitioning]: the pass is over
    }
    // Reset readiness for the next backward.
    for (auto &bk : buckets_) {
        bk.pending = (int64_t)bk.params.size();
    }
    pass.reduced();
    book_.end_backward();   // Note [Step in backward]: the backward may have been one optimizer step
    sharded_grads_.show(params_.tensors());   // Note [Sharded gradients]
}

void Engine::hide_sharded_grads() {
    sharded_grads_.hide(params_.tensors(), [&](int64_t i) {
        // stage 1: the bucket view again (its owned part holds the reduced sum, the rest zeros)
        const bool view = layout_.opts.stage <= 1 && sharded_grads_.views_ok && !params_.cut(i);
        return view ? sharded_grads_.views[i] : at::Tensor();
    });
}

int64_t Engine::acquire_slot(int64_t b) {
    GradRing &ring = reducer_.ring();
    int64_t s = ring.take_free(b);
    if (s < 0) {
        // All slots busy: the ring grows to grad_ring_buckets first, then finishes
        // the oldest launched reduction and takes its slot.
        if (ring.at_size() && !reducer_.idle()) {
            complete(reducer_.oldest());
            return acquire_slot(b);
        }
        // Below its configured size, or every slot held by a bucket still filling
        // (gradients arrived out of bucket order): grow the ring by one; bounded by
        // the number of buckets.
        s = ring.grow(b);
    }
    if (off_) off_->before_reuse(s);   // Note [Optimizer offload]: its last down copy is done
    buckets_[b].slot = s;
    return s;
}

void Engine::release_slot(int64_t b) {
    Bucket &bk = buckets_[b];
    if (bk.slot >= 0) reducer_.ring().release(bk.slot);
    bk.slot = -1;
}

void Engine::launch(int64_t b) {
    Bucket &bk = buckets_[b];
    if (layout_.opts.stage >= 2 && bk.slot < 0) acquire_slot(b);   // bucket with no gradients at all
    // stages 2-3: the bucket's gradient, staged in its ring slot
    const at::Tensor staged = layout_.opts.stage >= 2 ? reducer_.ring()[bk.slot].send.narrow(0, 0, bk.padded_numel)
                                               : at::Tensor();
    if (staged.defined()) {
        if (bk.local_grad.defined()) {   // Note [Local accumulation]
            staged.add_(bk.local_grad);
            bk.local_grad = at::Tensor();
        }
        // Zero the padding so it never feeds the optimizer garbage.
        for (const auto &g : bk.gaps) staged.narrow(0, g.first, g.second).zero_();
    }
    if (layout_.world == 1) {
        if (staged.defined()) {
            if (layout_.opts.step_in_backward) {   // Note [Step in backward]
                step_landed(bk, staged);
            } else if (off_) {   // Note [Optimizer offload]: added on the host as it lands
                at::Tensor dst = view().host_grad(bk);
                off_->down(b, staged, bk.slot, [dst](const at::Tensor &v) { dst.add_(v); });
            } else {
                view().grad(bk).add_(staged);
            }
            release_slot(b);
        } else if (layout_.opts.step_in_backward) {   // stage 1: the bucket is its own shard, consumed
            step_landed(bk, bk.flat_grad);
            bk.flat_grad.zero_();
        } else if (off_) {   // stage 1: the bucket is its own shard; the host gets a copy
            at::Tensor dst = view().host_grad(bk);
            off_->down(b, bk.flat_grad, -1, [dst](const at::Tensor &v) { dst.copy_(v); });
        }
        return;
    }
    ReduceGroups &groups = reducer_.groups();
    if (groups.enabled()) {   // Note [Coalesced gradient reductions]
        if (groups.coalesces(bk.slice_numel)) {
            if (!groups.fits(bk.slice_numel)) reducer_.launch_group(comm_);
            groups.add(b, bk.unit, staged, bk.slice_numel);
            release_slot(b);
            return;
        }
        reducer_.launch_group(comm_);   // the small buckets before this one first: bucket order
    }
    comm_.seq.subject(b, layout_.opts.stage == 3 ? bk.unit : -1);
    if (layout_.opts.stage == 1 && bk.slot < 0) acquire_slot(b);   // its recv
    reducer_.launch(comm_, b, staged.defined() ? staged : bk.flat_grad, bk.padded_numel, bk.slice_numel, bk.slot);
}

void GradReducer::launch(Communicator &comm, int64_t b, const at::Tensor &send, int64_t padded, int64_t slice,
                         int64_t slot) {
    WorkPtr work;
    switch (kind_) {
    case ReduceKind::kAllReduce:
        // As DDP's reducer scales while copying into its bucket: times the
        // reciprocal, which rounds differently from a division when N is not a
        // power of two (tests/test_hf_models.py at 3 ranks).
        send.mul_(1.0 / (double)world_);
        work = comm.all_reduce_sum(send);
        break;
    case ReduceKind::kQuantized:   // Note [Quantized gradient reduction] (quant_reduce.h)
        work = quant_->launch(comm, b, send, slice, slot);
        break;
    case ReduceKind::kAllToAll:
        // Note [Reduce-scatter on gloo]
        // gloo's reduce_scatter is an
        // all-reduce underneath (2x the bytes); an equal-split all-to-all
        // moves exactly one slice to each peer, and sum_slices adds them.
        work = comm.all_to_all(ring_[slot].recv.narrow(0, 0, padded), send, padded);
        break;
    case ReduceKind::kReduceScatter:
        work = comm.reduce_scatter_sum(ring_[slot].recv.narrow(0, 0, slice), send);
        break;
    }
    inflight_.emplace_back(b, std::move(work));
}

int64_t GradReducer::wait_oldest(Communicator &comm) {
    auto [b, work] = inflight_.front();
    inflight_.pop_front();
    comm.watch(work, kind_ == ReduceKind::kAllReduce ? "gradient all-reduce" : "gradient reduce-scatter");
    return b;
}

// Note [Coalesced gradient reductions]
//   A collective costs a fixed latency however small it is (on gloo over loopback,
//   ~0.3 ms), and stage 3 makes one bucket per unit, so a model of many small units
//   would pay one reduction per unit and step (benchmarks/bench_units.py: 300).
//   As the gathers of small units are coalesced (Note [Coalesced unit gathers]), a
//   bucket whose slice is below coalesce_numel / N elements does not launch its own
//   reduction: launch() copies its gradient into the group being filled (row r
//   holds every member's slice r) and frees its ring slot. The group is reduced by
//   one reduce-scatter (or all-to-all) of the rows when the next member would not
//   fit, when a larger bucket launches (so collectives stay in bucket order), and
//   at the end of backward. Consecutive buckets' shard slices are consecutive, so
//   the group's result lands in the gradient shard as one piece: the same sums,
//   added in the same order, as one reduction per bucket. The composition of a
//   group depends only on the bucket sizes, so every rank forms the same groups.
//   Stage 3 only (stages 1-2 have few, large buckets), not with grad_quant, offload
//   or step_in_backward, which finish each bucket on its own.
void GradReducer::launch_group(Communicator &comm) {
    if (!groups_.filling()) return;
    ReduceGroup g = groups_.close();
    const int64_t n = g.numel;
    comm.seq.subject(g.members.front(), g.unit);
    WorkPtr work;
    if (kind_ == ReduceKind::kAllToAll) {
        g.recv = at::empty({partitions_ * n}, reduce_);
        work = comm.all_to_all(g.recv, g.send, partitions_ * n);
    } else {
        g.recv = at::empty({n}, reduce_);
        work = comm.reduce_scatter_sum(g.recv, g.send);
    }
    const int64_t last = g.members.back();
    groups_.fly(std::move(g));
    inflight_.emplace_back(last, std::move(work));
}

void Engine::finish_reduce_group(ReduceGroup &g) {
    const Bucket &first = buckets_[g.members.front()];
    view().grad(first);   // allocates the gradient shard at the first backward
    int64_t at = first.shard_offset;
    for (int64_t m : g.members) {
        TORCH_CHECK(buckets_[m].shard_offset == at, "zero_ext: internal: a reduction group's shard slices "
                    "are not consecutive");
        at += buckets_[m].slice_numel;
    }
    reducer_.finish(layout_.partitions * g.numel, g.numel, g.recv, shard_.grad.narrow(0, first.shard_offset, g.numel),
                    true, *kernels_.device);
}

void Engine::complete(int64_t b) {
    // Works finish in launch order; complete everything up to b.
    while (!reducer_.idle()) {
        const int64_t cur = reducer_.wait_oldest(comm_);
        if (reducer_.groups().flying(cur)) {   // Note [Coalesced gradient reductions]
            ReduceGroup g = reducer_.groups().land(cur);
            finish_reduce_group(g);
            if (cur == b) break;
            continue;
        }
        Bucket &bk = buckets_[cur];
        if (layout_.opts.stage >= 1) {
            const bool accumulate = layout_.opts.stage >= 2;
            const int64_t padded = bk.padded_numel, slice = bk.slice_numel;
            if (layout_.opts.step_in_backward && accumulate) {
                // Note [Step in backward]: the step reads the reduced slice where it landed.
                const auto land_at = [&](int64_t n) { return view().landing(n); };
                step_landed(bk, reducer_.reduced(bk.slot, padded, slice, land_at, *kernels_.device));
            } else if (off_ && accumulate) {
                // Note [Optimizer offload]: what the collective left, finished on the host as it lands.
                at::Tensor dst = view().host_grad(bk);
                off_->down(cur, reducer_.recv(bk.slot, padded, slice), bk.slot,
                           [this, padded, slice, dst](const at::Tensor &v) {
                               reducer_.finish(padded, slice, v, dst, true, kernels_.step());
                           });
            } else {
                // stage 1 keeps the sum in its bucket (Note [Gradient sums in stages 1-2]); offload copies it down
                at::Tensor dst = off_ ? view().owned(bk.flat_grad, bk) : view().grad(bk);
                reducer_.land(bk.slot, padded, slice, dst, accumulate, *kernels_.device);
                if (off_) {
                    at::Tensor host = view().host_grad(bk);
                    off_->down(cur, dst, -1, [host](const at::Tensor &v) { host.copy_(v); });
                }
            }
            if (layout_.opts.stage == 1 && layout_.opts.step_in_backward) {
                step_landed(bk, view().owned(bk.flat_grad, bk));   // Note [Step in backward]: consumed
                bk.flat_grad.zero_();
            } else if (layout_.opts.stage == 1) {
                // Note [Gradient sums in stages 1-2]: zero what this rank does not own.
                const int64_t lo = layout_.rank * slice, hi = lo + slice;
                if (lo > 0) bk.flat_grad.narrow(0, 0, lo).zero_();
                if (hi < padded) bk.flat_grad.narrow(0, hi, padded - hi).zero_();
            }
            release_slot(cur);
        }
        if (cur == b) break;
    }
}

void GradReducer::finish(int64_t padded, int64_t slice, const at::Tensor &recv, at::Tensor dst, bool accumulate,
                         Kernels &k) const {
    const bool all_to_all = kind_ == ReduceKind::kAllToAll;
    if (all_to_all && reduce_.dtype() != at::kFloat) {
        // Low-precision reduce: add the N slices in fp32 and round once.
        at::Tensor sum = recv.narrow(0, 0, padded).view({partitions_, slice}).to(at::kFloat).sum(0);
        if (accumulate) sum.add_(dst);
        dst.copy_(sum);
    } else if (all_to_all) {
        k.sum_slices(slice, (int32_t)partitions_, recv.data_ptr<float>(), dst.data_ptr<float>(), accumulate);
    } else if (accumulate) {
        dst.add_(recv.narrow(0, 0, slice));
    } else {
        dst.copy_(recv.narrow(0, 0, slice));
    }
}

void GradReducer::land(int64_t slot, int64_t padded, int64_t slice, at::Tensor dst, bool accumulate, Kernels &k) {
    if (quant_)
        quant_->finish(slot, slice, dst, accumulate);
    else
        finish(padded, slice, ring_[slot].recv, dst, accumulate, k);
}

void Engine::wait_reductions() {
    while (!reducer_.idle()) complete(reducer_.newest());
}

void Engine::zero_grad(bool set_to_none, const std::vector<int64_t> &groups) {
    const Groups cover(groups);
    wait_reductions();
    reducer_.groups().drop_filling();   // Note [Coalesced gradient reductions]: a backward that did not end
    if (off_) off_->drain();   // no landing writes the host shard any more
    reducer_.pass().gradients_changed();
    hide_sharded_grads();   // Note [Sharded gradients]: cleared, or zeroed (the plain views again)
    if (!cover.all()) {
        // One of several wrapped optimizers: only its groups' gradients, as torch's
        // zero_grad touches only its own parameters (the others may still step).
        ensure_step_tables();
        for (size_t i = 0; i < params_.size(); i++) {
            if (!cover.has(layout_.group_of[i])) continue;
            if (layout_.opts.stage <= 1)
                for (const zx_piece &pc : params_.pieces(i))
                    buckets_[pc.bucket].flat_grad.narrow(0, pc.offset, pc.numel).zero_();
            if (set_to_none) {
                params_[i].mutable_grad() = at::Tensor();
                book_.forget_grad((int64_t)i);   // Note [Unused parameters]
            }
        }
        if (shard_.grad.defined())
            for (size_t b = 0; b < buckets_.size(); b++)
                for (const StepRun &f : book_.fragments((int64_t)b))
                    if (cover.has(layout_.group_of[f.param]))
                        shard_.grad.narrow(0, buckets_[b].shard_offset + f.offset, f.numel).zero_();
        return;
    }
    for (auto &bk : buckets_) {
        if (bk.flat_grad.defined()) bk.flat_grad.zero_();
        bk.local_grad = at::Tensor();   // Note [Local accumulation]
    }
    if (shard_.grad.defined()) shard_.grad.zero_();
    for (auto &p : params_) {
        if (set_to_none) p.mutable_grad() = at::Tensor();
    }
    if (set_to_none) book_.forget_grads();   // Note [Unused parameters]
}

}  // namespace zx
