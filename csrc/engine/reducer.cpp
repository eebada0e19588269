// reducer.cpp — GradReducer (grad_reducer.h), backward: gradient readiness, the stage-2
// ring of staging buffers, reductions launched strictly in bucket order (all-reduce in
// stage 0, reduce-scatter or all-to-all + local sum in stages 1-3), zero_grad.
#include "engine/grad_reducer.h"

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
static void require_dense(const Layout &layout, int64_t i, const at::Tensor &g) {
    TORCH_CHECK(!g.defined() || !g.is_sparse(), "zero_ext: ", layout.pname(i), " got a sparse gradient, which cannot "
                "be sharded; produce a dense one: nn.Embedding(..., sparse=False), F.embedding(..., sparse=False)");
}

void GradReducer::ensure_grad_view(ReduceWork &w, int64_t i) {
    at::Tensor &p = w.params[i];
    const at::Tensor &g = p.grad();
    const at::Tensor &view = grads_.views[i];
    require_dense(w.layout(), i, g);
    // Note [Bucket gradient lifetime] (shard_view.cpp): the first gradient into a bucket gives its bytes back
    for (const zx_piece &pc : w.params.pieces(i)) bucket_grad(w.buckets[pc.bucket]);
    if (w.params.cut(i)) {
        // Note [Cut parameters]: added piece by piece into each bucket's flat_grad.
        if (g.defined()) {
            const at::Tensor flat = g.reshape(-1);
            for (const zx_piece &pc : w.params.pieces(i))
                bucket_grad(w.buckets[pc.bucket]).narrow(0, pc.offset, pc.numel).add_(flat.narrow(0, pc.param_offset, pc.numel));
            p.mutable_grad() = at::Tensor();
        }
        return;
    }
    if (!grads_.views_ok) {
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

void GradReducer::stage_grad(ReduceWork &w, int64_t i) {
    at::Tensor &p = w.params[i];
    const at::Tensor g = p.grad();
    require_dense(w.layout(), i, g);
    const at::Tensor flat = g.defined() ? g.reshape(-1) : at::Tensor();
    for (const zx_piece &pc : w.params.pieces(i)) {   // one piece unless cut (Note [Cut parameters])
        Bucket &bk = w.buckets[pc.bucket];
        if (bk.slot < 0) acquire_slot(w, pc.bucket);
        if (narrow() && flat.defined() && flat.scalar_type() != wire_) widen(bk.slot);
        at::Tensor dst = send_of(bk.slot).narrow(0, pc.offset, pc.numel);
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
void GradReducer::accumulate_local(ReduceWork &w, int64_t i) {
    at::Tensor &p = w.params[i];
    const at::Tensor g = p.grad();
    require_dense(w.layout(), i, g);
    if (!g.defined()) return;
    const at::Tensor flat = g.reshape(-1);
    for (const zx_piece &pc : w.params.pieces(i)) {
        Bucket &bk = w.buckets[pc.bucket];
        if (!bk.local_grad.defined())
            bk.local_grad = at::zeros({bk.padded_numel}, w.layout().on_device(w.layout().dtypes.reduce));
        bk.local_grad.narrow(0, pc.offset, pc.numel).add_(flat.narrow(0, pc.param_offset, pc.numel));
    }
    p.mutable_grad() = at::Tensor();
}

void GradReducer::mark_ready(ReduceWork w, int64_t i, const at::Tensor &grad) {
    TORCH_CHECK(i >= 0 && i < (int64_t)w.params.size(), "zero_ext: internal: bad parameter index ", i);
    if (grad.defined()) {   // the parameter itself may be released (0 elements): no shape to check
        int64_t numel = 0;
        for (const zx_piece &pc : w.params.pieces(i)) numel += pc.numel;
        TORCH_CHECK(grad.numel() == numel, "zero_ext: internal: ", w.layout().pname(i), " given a gradient of ",
                    grad.numel(), " elements, not ", numel);
        w.params[i].mutable_grad() = grad;
    }
    w.book.note_grad(i);
    if (w.stage() <= 1) ensure_grad_view(w, i);
    const bool reduce_now = w.stage() >= 2 || pass_.require_sync();
    if (w.stage() >= 2 && !pass_.require_sync()) {
        accumulate_local(w, i);
        if (w.stage() == 3) {   // its backward is over: release as a reducing pass would
            for (const zx_piece &pc : w.params.pieces(i)) {
                Bucket &bk = w.buckets[pc.bucket];
                if (--bk.pending == 0 && bk.unit != 0) w.hooks.release_bucket(bk);
            }
        }
        return;
    }
    if (!reduce_now) return;
    if (w.stage() >= 2) stage_grad(w, i);
    TORCH_CHECK(!pass_.ready(i), "zero_ext: ", w.layout().pname(i),
                " got its gradient twice in one backward pass (its gradient was reduced already); if you "
                "call backward() twice, call it under model.no_sync() for all but the last, or step in between");
    pass_.set_ready(i);
    bool done = false;
    for (const zx_piece &pc : w.params.pieces(i)) {
        Bucket &bk = w.buckets[pc.bucket];
        if (--bk.pending > 0) continue;
        done = true;
        // Stage 3: its backward is over; the root unit waits for the end.
        if (w.stage() == 3 && bk.unit != 0) w.hooks.release_bucket(bk);
    }
    // Launch strictly in bucket order so that every rank issues the same collectives.
    if (done)
        pass_.launch_in_order((int64_t)w.buckets.size(), [&](int64_t b) { return w.buckets[b].pending == 0; },
                             [&](int64_t b) { launch_bucket(w, b); });
}

void GradReducer::finalize(ReduceWork w) {
    if (!pass_.require_sync()) {   // Note [Local accumulation]: nothing sent
        if (w.stage() == 3) {
            w.hooks.release_pass();
            for (auto &bk : w.buckets) bk.pending = (int64_t)bk.params.size();
        }
        return;
    }
    // Parameters that got no gradient this pass: their region holds zeros or
    // earlier accumulated gradients (stage 0/1), or is zero-filled (stage 2).
    for (int64_t i = 0; i < (int64_t)w.params.size(); i++) {
        if (pass_.ready(i)) continue;
        if (w.stage() >= 2) stage_grad(w, i);
        pass_.set_ready(i);
        for (const zx_piece &pc : w.params.pieces(i)) w.buckets[pc.bucket].pending--;
    }
    pass_.launch_in_order((int64_t)w.buckets.size(), [](int64_t) { return true; },
                         [&](int64_t b) { launch_bucket(w, b); });
    launch_group(w.comm);   // Note [Coalesced gradient reductions]: what is left
    // Note [Reductions end with backward]
    // As DDP's reducer does, wait here.
    // The reductions overlapped the rest of backward; the step needs them next
    // anyway, and no later backward may write into a bucket (stage 0/1) or a
    // ring slot (stage 2) that a collective is still reading.
    wait_all(w);
    if (w.stage() == 3) w.hooks.release_pass();   // the pass is over
    // Reset readiness for the next backward.
    for (auto &bk : w.buckets) {
        bk.pending = (int64_t)bk.params.size();
    }
    pass_.reduced();
    w.book.end_backward();   // Note [Step in backward]: the backward may have been one optimizer step
    grads_.show(w.params.tensors());   // Note [Sharded gradients]
}

void GradReducer::hide_grads(ReduceWork w) {
    grads_.hide(w.params.tensors(), [&](int64_t i) {
        // stage 1: the bucket view again (its owned part holds the reduced sum, the rest zeros)
        const bool view = w.stage() <= 1 && grads_.views_ok && !w.params.cut(i);
        return view ? grads_.views[i] : at::Tensor();
    });
}

int64_t GradReducer::acquire_slot(ReduceWork &w, int64_t b) {
    GradRing &ring = ring_;
    int64_t s = ring.take_free(b);
    if (s < 0) {
        // All slots busy: the ring grows to grad_ring_buckets first, then finishes
        // the oldest launched reduction and takes its slot.
        if (ring.at_size() && !idle()) {
            complete(w, oldest());
            return acquire_slot(w, b);
        }
        // Below its configured size, or every slot held by a bucket still filling
        // (gradients arrived out of bucket order): grow the ring by one; bounded by
        // the number of buckets.
        s = ring.grow(b);
    }
    if (w.off()) w.off()->before_reuse(s);   // Note [Optimizer offload]: its last down copy is done
    w.buckets[b].slot = s;
    return s;
}

// Note [Narrow gradient wire]
//   With 16-bit parameters (param_dtype bf16/fp16) each gradient autograd makes is
//   16-bit, and reduce_dtype fp32 only widens it: exactly. So the all-to-all of
//   stages 2-3 (Note [Reduce-scatter on gloo]) stages and sends the gradients as they
//   are, and sum_slices16 widens each received element before the same fp32 sums, in
//   the same order: bit for bit the fp32 reduction, from a ring half its size and
//   half the bytes on the wire. A bucket whose values are not 16-bit (a no_sync
//   sum in local_grad, a gradient given in another dtype) is widened for that one
//   reduction: its staged part copied (exactly) into a reduce_dtype send, received
//   into a reduce_dtype recv, both freed with its slot. CPU only (the kernel);
//   not with offload, whose pinned rings hold reduce_dtype (build.cpp).
void GradReducer::widen(int64_t slot) {
    Slot &sl = ring_[slot];
    if (!sl.wide_send.defined()) sl.wide_send = sl.send.to(reduce_.dtype().toScalarType());
}

void GradReducer::release_slot(ReduceWork &w, int64_t b) {
    Bucket &bk = w.buckets[b];
    if (bk.slot >= 0) ring_.release(bk.slot);
    bk.slot = -1;
}

void GradReducer::launch_bucket(ReduceWork &w, int64_t b) {
    Bucket &bk = w.buckets[b];
    if (w.stage() >= 2 && bk.slot < 0) acquire_slot(w, b);   // bucket with no gradients at all
    if (narrow() && bk.local_grad.defined()) widen(bk.slot);   // a sum of micro-steps: not 16-bit exact
    // stages 2-3: the bucket's gradient, staged in its ring slot
    const at::Tensor staged = w.stage() >= 2 ? send_of(bk.slot).narrow(0, 0, bk.padded_numel) : at::Tensor();
    if (staged.defined()) {
        if (bk.local_grad.defined()) {   // Note [Local accumulation]
            staged.add_(bk.local_grad);
            bk.local_grad = at::Tensor();
        }
        // Zero the padding so it never feeds the optimizer garbage.
        for (const auto &g : bk.gaps) staged.narrow(0, g.first, g.second).zero_();
    }
    if (w.layout().world == 1) {
        if (staged.defined()) {
            if (w.layout().opts.step_in_backward) {   // Note [Step in backward]
                w.hooks.step_landed(bk, staged);
            } else if (w.off()) {   // Note [Optimizer offload]: added on the host as it lands
                at::Tensor dst = w.shard.host_grad(bk);
                w.off()->down(b, staged, bk.slot, [dst](const at::Tensor &v) { dst.add_(v); });
            } else {
                w.shard.grad(bk).add_(staged);
            }
            release_slot(w, b);
        } else if (w.layout().opts.step_in_backward) {   // stage 1: the bucket is its own shard, consumed
            w.hooks.step_landed(bk, bucket_grad(bk));
            bk.flat_grad.zero_();
        } else if (w.off()) {   // stage 1: the bucket is its own shard; the host gets a copy
            at::Tensor dst = w.shard.host_grad(bk);
            w.off()->down(b, bucket_grad(bk), -1, [dst](const at::Tensor &v) { dst.copy_(v); });
        }
        return;
    }
    ReduceGroups &groups = groups_;
    if (groups.enabled()) {   // Note [Coalesced gradient reductions]
        if (groups.coalesces(bk.slice_numel)) {
            if (!groups.fits(bk.slice_numel)) launch_group(w.comm);
            groups.add(b, bk.unit, staged, bk.slice_numel);
            release_slot(w, b);
            return;
        }
        launch_group(w.comm);   // the small buckets before this one first: bucket order
    }
    w.comm.seq.subject(b, w.stage() == 3 ? bk.unit : -1);
    if (w.stage() == 1 && bk.slot < 0) acquire_slot(w, b);   // its recv
    launch(w.comm, b, staged.defined() ? staged : bucket_grad(bk), bk.padded_numel, bk.slice_numel, bk.slot);
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
        if (narrow() && send.scalar_type() != wire_) ring_[slot].wide_recv = at::empty({padded}, reduce_);   // widened
        work = comm.all_to_all(recv_of(slot).narrow(0, 0, padded), send, padded, reduce_.dtype().itemsize());
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
//   reduction: launch_bucket() copies its gradient into the group being filled (row r
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

void GradReducer::finish_group(ReduceWork &w, ReduceGroup &g) {
    const Bucket &first = w.buckets[g.members.front()];
    int64_t at = first.shard_offset;
    for (int64_t m : g.members) {
        w.shard.grad(w.buckets[m]);   // made (zeroed) at its first use (Note [Gradient shard lifetime])
        TORCH_CHECK(w.buckets[m].shard_offset == at, "zero_ext: internal: a reduction group's shard slices "
                    "are not consecutive");
        at += w.buckets[m].slice_numel;
    }
    finish(partitions_ * g.numel, g.numel, g.recv, w.shard.buffers.grad.narrow(0, first.shard_offset, g.numel), true,
           *w.kernels.device);
}

void GradReducer::complete(ReduceWork &w, int64_t b) {
    // Works finish in launch order; complete everything up to b.
    while (!idle()) {
        const int64_t cur = wait_oldest(w.comm);
        if (groups_.flying(cur)) {   // Note [Coalesced gradient reductions]
            ReduceGroup g = groups_.land(cur);
            finish_group(w, g);
            if (cur == b) break;
            continue;
        }
        Bucket &bk = w.buckets[cur];
        if (w.stage() >= 1) {
            const bool accumulate = w.stage() >= 2;
            const int64_t padded = bk.padded_numel, slice = bk.slice_numel;
            if (w.layout().opts.step_in_backward && accumulate) {
                // Note [Step in backward]: the step reads the reduced slice where it landed.
                const auto land_at = [&](int64_t n) { return w.shard.landing(n); };
                w.hooks.step_landed(bk, reduced(bk.slot, padded, slice, land_at, *w.kernels.device));
            } else if (w.off() && accumulate) {
                // Note [Optimizer offload]: what the collective left, finished on the host as it lands.
                at::Tensor dst = w.shard.host_grad(bk);
                Kernels *host = &w.kernels.step();   // the landing worker runs this after the call
                w.off()->down(cur, recv(bk.slot, padded, slice), bk.slot,
                               [this, padded, slice, dst, host](const at::Tensor &v) {
                                   finish(padded, slice, v, dst, true, *host);
                               });
            } else {
                // stage 1 keeps the sum in its bucket (Note [Gradient sums in stages 1-2]); offload copies it down
                at::Tensor dst = w.off() ? w.shard.owned(bucket_grad(bk), bk) : w.shard.grad(bk);
                land(bk.slot, padded, slice, dst, accumulate, *w.kernels.device);
                if (w.off()) {
                    at::Tensor host = w.shard.host_grad(bk);
                    w.off()->down(cur, dst, -1, [host](const at::Tensor &v) { host.copy_(v); });
                }
            }
            if (w.stage() == 1 && w.layout().opts.step_in_backward) {
                w.hooks.step_landed(bk, w.shard.owned(bucket_grad(bk), bk));   // Note [Step in backward]: consumed
                bk.flat_grad.zero_();
            } else if (w.stage() == 1) {
                // Note [Gradient sums in stages 1-2]: zero what this rank does not own.
                const int64_t lo = w.layout().rank * slice, hi = lo + slice;
                at::Tensor &full = bucket_grad(bk);
                if (lo > 0) full.narrow(0, 0, lo).zero_();
                if (hi < padded) full.narrow(0, hi, padded - hi).zero_();
            }
            release_slot(w, cur);
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
    } else if (all_to_all && recv.scalar_type() != at::kFloat) {   // Note [Narrow gradient wire]
        const zx_dtype dt = recv.scalar_type() == at::kBFloat16 ? ZX_BF16 : ZX_F16;
        TORCH_CHECK(k.sum_slices16(slice, (int32_t)partitions_, (const uint16_t *)recv.data_ptr(), dt,
                                   dst.data_ptr<float>(), accumulate),
                    "zero_ext: internal: no 16-bit slice sum on this device");
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
        finish(padded, slice, recv_of(slot), dst, accumulate, k);
}

void GradReducer::wait_all(ReduceWork w) {
    while (!idle()) complete(w, newest());
}

void GradReducer::zero_grad(ReduceWork w, bool set_to_none, const Groups &cover) {
    wait_all(w);
    groups_.drop_filling();   // Note [Coalesced gradient reductions]: a backward that did not end
    if (w.off()) w.off()->drain();   // no landing writes the host shard any more
    pass_.gradients_changed();
    hide_grads(w);   // Note [Sharded gradients]: cleared, or zeroed (the plain views again)
    if (!cover.all()) {
        // One of several wrapped optimizers: only its groups' gradients, as torch's
        // zero_grad touches only its own parameters (the others may still step).
        for (size_t i = 0; i < w.params.size(); i++) {
            if (!cover.has(w.layout().group_of[i])) continue;
            if (w.stage() <= 1)
                for (const zx_piece &pc : w.params.pieces(i))   // (a released bucket reads as zeros already)
                    if (bucket_grad_held(w.buckets[pc.bucket]))
                        w.buckets[pc.bucket].flat_grad.narrow(0, pc.offset, pc.numel).zero_();
            if (set_to_none) {
                w.params[i].mutable_grad() = at::Tensor();
                w.book.forget_grad((int64_t)i);   // Note [Unused parameters]
            }
        }
        if (grad_shard_held(w.shard.buffers))
            for (size_t b = 0; b < w.buckets.size(); b++)
                for (const StepRun &f : w.book.fragments((int64_t)b))
                    if (cover.has(w.layout().group_of[f.param]))
                        w.shard.buffers.grad.narrow(0, w.buckets[b].shard_offset + f.offset, f.numel).zero_();
        return;
    }
    // Note [Gradient shard lifetime] (shard_view.cpp): set_to_none frees the shard and the ring
    // (offload keeps its host shard, step_in_backward its landing: they have no gradient shard to free);
    // stages 0-1 free their buckets' gradients alike (Note [Bucket gradient lifetime])
    const bool release = set_to_none && !w.off() && !w.layout().opts.step_in_backward;
    for (auto &bk : w.buckets) {
        if (release)
            release_bucket_grad(bk);
        else if (bucket_grad_held(bk))
            bk.flat_grad.zero_();
        bk.local_grad = at::Tensor();   // Note [Local accumulation]
    }
    if (release) {
        release_grad_shard(w.shard.buffers);
        ring_.release_all();
    } else if (grad_shard_held(w.shard.buffers)) {
        w.shard.buffers.grad.zero_();
        w.shard.buffers.grad_lazy = false;
    }
    for (auto &p : w.params) {
        if (set_to_none) p.mutable_grad() = at::Tensor();
    }
    if (set_to_none) w.book.forget_grads();   // Note [Unused parameters]
}

}  // namespace zx
