// engine.cpp — see engine.h. Stages 0-2 on CPU: layout from the C planner,
// gradient readiness, in-order asynchronous reductions, fused optimizer steps,
// parameter all-gather. Every collective goes through the user's ProcessGroup.
#include "engine.h"

#include <ATen/Parallel.h>
#include <ATen/native/Resize.h>
#include <cmath>
#include <mutex>
#include <sstream>

#include "kernels_binding.h"   // defines: zx_check, parse_isa

// Note [Collective entry points]
//   _allgather_base, _reduce_scatter_base and alltoall_base are deprecated in
//   torch 2.13 in favour of *_single, which torch 2.11 (the GPU machine) lacks;
//   the old names exist in both, so we keep them and silence the warning.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace zx {

// Note [Gradient sums in stages 1-2]
//   Stage 0 divides each bucket by N before its SUM all-reduce, as DDP does, so
//   param.grad holds the average. Stages 1-2 reduce with SUM (never AVG: gloo's
//   AVG has been wrong) and keep the *sum* in the owned gradient slice; the
//   1/N is folded into the optimizer kernel's grad_scale (and into the norm).
//   Keeping sums makes a second backward without zero_grad() still correct:
//   after a stage-1 reduce-scatter the non-owned parts of the bucket are
//   zeroed, so the next reduce-scatter adds exactly the new gradients.

// Note [Stage 3 parameter lifetime]
//   Only master_shard_ (this rank's slices; and lp_shard_, their low-precision
//   copy, with a low param_dtype) persists. Each bucket's flat_param
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

// Note [Mixed precision]
//   param_dtype (pdt_) is what parameters compute in and are all-gathered as;
//   reduce_dtype (rdt_) what gradients accumulate and are reduced in; master
//   weights and optimizer states are always fp32 over this rank's shard.
//   With pdt_ = fp32 the owned slice of a stage 0-2 bucket *is* the master; else
//   master_shard_ holds it and the fused step writes the low-precision copy in
//   the same pass straight into what is gathered next: the owned slice of the
//   bucket (stages 0-2; the all-gather runs in place) or lp_shard_ (stage 3).
//   Autograd produces gradients in pdt_. When rdt_ == pdt_ stage 0/1 gradients
//   are views of flat_grad as in fp32; otherwise the hook adds each gradient
//   into the reduce_dtype bucket and drops it, so accumulation over micro-steps
//   happens in reduce_dtype, never silently in bf16. Stage 2/3 cast into the
//   ring as they stage. Kernels read fp32 gradients: low-precision ones are
//   converted in small cache-resident chunks (with_f32_grads).
//   Memory per element: stage 3 = 4 (master) + 2 (lp shard) + |rdt| + 8 over N;
//   with rdt = pdt = bf16 every stage matches the ZeRO paper's mixed-precision
//   formulas (16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N); fp32 reduce adds 2 bytes per
//   gradient element (6Ψ+12Ψ/N, 2Ψ+16Ψ/N, 18Ψ/N).

static constexpr int64_t kGrain = 1 << 16;   // elements per parallel task

static std::pair<at::ScalarType, zx_dtype> parse_dtype(const std::string &name, const char *what) {
    if (name == "fp32") return {at::kFloat, ZX_F32};
    if (name == "bf16") return {at::kBFloat16, ZX_BF16};
    if (name == "fp16") return {at::kHalf, ZX_F16};
    TORCH_CHECK(false, "zero_ext: ", what, " must be 'fp32', 'bf16' or 'fp16', got '", name, "'");
    return {at::kFloat, ZX_F32};
}

// Every wait on a collective goes through here, so that a peer that died (or a
// timeout of the process group) surfaces as one message naming what failed.
static void wait_work(const c10::intrusive_ptr<c10d::Work> &work, const char *what) {
    try {
        work->wait();
    } catch (const std::exception &e) {
        TORCH_CHECK(false, "zero_ext: ", what, " failed: ", e.what(),
                    "\nAnother rank probably died, or stopped calling the same collectives; "
                    "this rank cannot continue. Restart the job from the last checkpoint.");
    }
}

template <class F>
void Engine::parallel(int64_t n, F &&fn) const {
    if (n <= 0) return;
    at::parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) { fn(lo, hi); });
}

Engine::Engine(std::vector<at::Tensor> params, std::vector<int64_t> groups, std::vector<int64_t> units,
               c10::optional<ProcessGroupPtr> pg, EngineOptions opts)
    : params_(std::move(params)), pg_(std::move(pg)), opts_(std::move(opts)) {
    const int64_t n = (int64_t)params_.size();
    TORCH_CHECK(n > 0, "zero_ext: the optimizer has no trainable parameters");
    TORCH_CHECK((int64_t)groups.size() == n, "zero_ext: one group index per parameter expected");
    TORCH_CHECK(opts_.stage >= 0 && opts_.stage <= 3, "zero_ext: the engine runs stages 0-3, got ", opts_.stage);
    const bool s3 = opts_.stage == 3;
    TORCH_CHECK(!s3 || (int64_t)units.size() == n, "zero_ext: stage 3 needs one unit id per parameter");
    if (pg_.has_value()) {
        rank_ = (*pg_)->getRank();
        world_ = (*pg_)->getSize();
    }
    parts_ = opts_.stage == 0 ? 1 : world_;
    isa_ = opts_.isa == "auto" ? zx_cpu_best_isa() : parse_isa(opts_.isa);
    std::tie(pdt_, pzx_) = parse_dtype(opts_.param_dtype, "param_dtype");
    std::tie(rdt_, rzx_) = parse_dtype(opts_.reduce_dtype, "reduce_dtype");
    lp_ = pdt_ != at::kFloat;
    grad_views_ok_ = rdt_ == pdt_;
    TORCH_CHECK(zx_cpu_supports(isa_), "zero_ext: this CPU cannot run isa='", opts_.isa,
                "'; use isa='auto'");

    // Plan: reverse registration order, which is roughly gradient-ready order;
    // stage 3: units in reverse forward order, so buckets again follow backward.
    std::vector<int64_t> numel(n), order(n);
    std::vector<int32_t> dtype(n, pzx_), group(n), unit(n, 0);
    for (int64_t i = 0; i < n; i++) {
        const at::Tensor &p = params_[i];
        TORCH_CHECK(p.scalar_type() == at::kFloat, "zero_ext: parameter ", i, " is ", p.scalar_type(),
                    "; stages 0-2 keep float32 parameters (cast the model with model.float())");
        TORCH_CHECK(p.device().is_cpu(), "zero_ext: parameter ", i, " is on ", p.device(),
                    "; this build runs on CPU tensors");
        numel[i] = p.numel();
        group[i] = (int32_t)groups[i];
        order[i] = n - 1 - i;
        if (s3) unit[i] = (int32_t)units[i];
    }
    if (s3) std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return unit[a] > unit[b]; });
    // Stage 3: one bucket per (unit, group); the unit is the granularity.
    const int64_t cap = s3 ? INT64_MAX / 4 : opts_.bucket_bytes;
    const int64_t first_cap = s3 ? INT64_MAX / 4 : opts_.first_bucket_bytes;
    zx_plan_params pp{(size_t)n, numel.data(), dtype.data(), group.data(), s3 ? unit.data() : nullptr,
                      order.data(), (int32_t)parts_, cap, first_cap, opts_.align};
    zx_check(zx_plan_create(&pp, &plan_), "planning the bucket layout");
    shard_numel_ = zx_plan_shard_numel(plan_);

    // Buckets as tensors; parameters (and stage 0/1 gradients) become views.
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    const auto pt = at::TensorOptions().dtype(pdt_), rt = at::TensorOptions().dtype(rdt_);
    const int64_t nb = zx_plan_num_buckets(plan_);
    buckets_.resize(nb);
    if (s3 || lp_) master_shard_ = at::zeros({shard_numel_}, f32);
    if (s3 && lp_) lp_shard_ = at::zeros({shard_numel_}, pt);
    bucket_of_.assign(n, -1);
    offset_of_.assign(n, 0);
    grad_views_.resize(n);
    if (s3) param_views_.resize(n);
    ready_.assign(n, 0);
    for (int64_t b = 0; b < nb; b++) {
        zx_bucket_info bi;
        zx_check(zx_plan_bucket(plan_, b, &bi), "reading the plan");
        Bucket &bk = buckets_[b];
        bk.group = bi.group;
        bk.numel = bi.numel;
        bk.padded_numel = bi.padded_numel;
        bk.slice_numel = bi.slice_numel;
        bk.shard_offset = zx_plan_shard_offset(plan_, b);
        bk.pending = bi.num_params;
        bk.unit = bi.unit;
        bk.gathered = true;
        // Stage 3 without values: never touch the pages (peak = shards + one unit).
        bk.flat_param = s3 && !opts_.copy_params ? at::empty({bi.padded_numel}, pt)
                                                 : at::zeros({bi.padded_numel}, pt);
        if (opts_.stage <= 1) bk.flat_grad = at::zeros({bi.padded_numel}, rt);
        // Low precision: the fp32 values, from which the master is taken.
        at::Tensor src32 = lp_ && opts_.copy_params ? at::zeros({bi.padded_numel}, f32) : at::Tensor();
        max_padded_ = std::max(max_padded_, bi.padded_numel);
        for (int64_t k = 0; k < bi.num_params; k++) {
            int64_t i;
            zx_check(zx_plan_bucket_param(plan_, b, k, &i), "reading the plan");
            zx_param_loc loc;
            zx_check(zx_plan_param(plan_, i, &loc), "reading the plan");
            bk.params.push_back(i);
            bucket_of_[i] = b;
            offset_of_[i] = loc.offset;
            at::Tensor &p = params_[i];
            at::Tensor view = bk.flat_param.narrow(0, loc.offset, loc.numel).view(p.sizes());
            if (opts_.copy_params) {
                at::NoGradGuard ng;
                (lp_ ? src32.narrow(0, loc.offset, loc.numel).view(p.sizes()) : view).copy_(p);
            }
            p.set_data(view);
            if (s3) param_views_[i] = view;
            if (opts_.stage <= 1) {
                grad_views_[i] = bk.flat_grad.narrow(0, loc.offset, loc.numel).view(p.sizes());
                if (p.grad().defined()) grad_views_[i].copy_(p.grad());
                p.mutable_grad() = at::Tensor();
            } else {
                p.mutable_grad() = at::Tensor();
            }
        }
        if (opts_.copy_params && lp_) {
            bk.flat_param.copy_(src32);                            // rounds to param_dtype
            master_slice(bk).copy_(owned_slice(src32, bk));
            if (s3) lp_slice(bk).copy_(owned_slice(bk.flat_param, bk));
        } else if (opts_.copy_params && s3) {
            master_slice(bk).copy_(owned_slice(bk.flat_param, bk));
        }
        if (s3) {
            // Keep only this rank's slice (Note [Stage 3 parameter lifetime]).
            if ((int64_t)unit_buckets_.size() <= bk.unit) unit_buckets_.resize(bk.unit + 1);
            unit_buckets_[bk.unit].push_back(b);
            gathered_bytes_ += bk.flat_param.nbytes();
            release_bucket(bk);
        }
    }
    if (s3) peak_gathered_bytes_ = 0;
    // The gradient shard and the ring are allocated at the first backward
    // (grad_shard_slice, acquire_slot), so building the model costs no more.
}

Engine::~Engine() {
    // Outstanding collectives must finish before their buffers go away.
    try {
        for (auto &w : inflight_) w.second->wait();
        for (auto &w : gather_works_) w->wait();
        for (auto &bk : buckets_)
            if (bk.gather_work) bk.gather_work->wait();
    } catch (...) {
    }
    zx_plan_free(plan_);
}

at::Tensor Engine::owned_slice(const at::Tensor &flat, const Bucket &bk) const {
    const int64_t r = opts_.stage == 0 ? 0 : rank_;
    return flat.narrow(0, r * bk.slice_numel, bk.slice_numel);
}

at::Tensor Engine::grad_shard_slice(const Bucket &bk) {
    if (opts_.stage >= 2) {
        if (!grad_shard_.defined()) grad_shard_ = at::zeros({shard_numel_}, at::TensorOptions().dtype(rdt_));
        return grad_shard_.narrow(0, bk.shard_offset, bk.slice_numel);
    }
    return owned_slice(bk.flat_grad, bk);
}

at::Tensor Engine::master_slice(Bucket &bk) {
    if (master_shard_.defined()) return master_shard_.narrow(0, bk.shard_offset, bk.slice_numel);
    return owned_slice(bk.flat_param, bk);
}

float *Engine::master(Bucket &bk) { return master_slice(bk).data_ptr<float>(); }

at::Tensor Engine::lp_slice(Bucket &bk) {
    if (opts_.stage == 3) return (lp_ ? lp_shard_ : master_shard_).narrow(0, bk.shard_offset, bk.slice_numel);
    return owned_slice(bk.flat_param, bk);
}

void *Engine::lp_out(Bucket &bk) { return lp_ ? lp_slice(bk).data_ptr() : nullptr; }

void Engine::absorb(at::Tensor master, const at::Tensor &lp_new) {
    // Only elements whose low-precision value changed take the new value.
    at::Tensor changed = lp_new.ne(master.to(pdt_));
    master.copy_(at::where(changed, lp_new.to(at::kFloat), master));
}

template <class F>
void Engine::with_f32_grads(const at::Tensor &grad, int64_t lo, int64_t hi, F &&fn) const {
    if (rdt_ == at::kFloat) {
        fn(grad.data_ptr<float>() + lo, lo, hi);
        return;
    }
    constexpr int64_t kChunk = 2048;   // 8 KiB: stays in L1 between the cast and the kernel
    float buf[kChunk];
    const char *base = (const char *)grad.data_ptr();
    const int64_t es = grad.element_size();
    for (int64_t a = lo; a < hi; a += kChunk) {
        const int64_t b = std::min(hi, a + kChunk);
        zx_check(zx_cast_to_f32(isa_, (size_t)(b - a), base + a * es, rzx_, buf), "converting gradients");
        fn(buf, a, b);
    }
}

double Engine::grad_divisor() const { return opts_.stage == 0 ? 1.0 : (double)world_; }

// ------------------------------------------------------------------ backward

void Engine::ensure_grad_view(int64_t i) {
    at::Tensor &p = params_[i];
    const at::Tensor &g = p.grad();
    const at::Tensor &view = grad_views_[i];
    TORCH_CHECK(!g.defined() || !g.is_sparse(), "zero_ext: parameter ", i,
                " got a sparse gradient; use dense embeddings (sparse=False)");
    if (!grad_views_ok_) {
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
    Bucket &bk = buckets_[bucket_of_[i]];
    if (bk.slot < 0) acquire_slot(bucket_of_[i]);
    at::Tensor dst = slots_[bk.slot].send.narrow(0, offset_of_[i], p.numel());
    if (g.defined()) {
        TORCH_CHECK(!g.is_sparse(), "zero_ext: parameter ", i,
                    " got a sparse gradient; use dense embeddings (sparse=False)");
        dst.view(p.sizes()).copy_(g);
    } else {
        dst.zero_();
    }
    p.mutable_grad() = at::Tensor();   // stage 2 keeps no full gradient
}

void Engine::mark_ready(int64_t i) {
    TORCH_CHECK(i >= 0 && i < (int64_t)params_.size(), "zero_ext: bad parameter index ", i);
    if (opts_.stage <= 1) ensure_grad_view(i);
    const bool reduce_now = opts_.stage >= 2 || require_sync_;
    if (!reduce_now) return;
    if (opts_.stage >= 2) stage_grad(i);
    TORCH_CHECK(!ready_[i], "zero_ext: parameter ", i,
                " was marked ready twice in one backward pass; if you call backward() "
                "twice, call it under model.no_sync() for all but the last, or step in between");
    ready_[i] = 1;
    Bucket &bk = buckets_[bucket_of_[i]];
    if (--bk.pending == 0) {
        // Stage 3: its backward is over; the root unit waits for the end.
        if (opts_.stage == 3 && bk.unit != 0) release_bucket(bk);
        // Launch strictly in bucket order so that every rank issues the same collectives.
        while (next_launch_ < (int64_t)buckets_.size() && buckets_[next_launch_].pending == 0)
            launch(next_launch_++);
    }
}

void Engine::finalize_backward() {
    const bool reduce_now = opts_.stage >= 2 || require_sync_;
    if (!reduce_now) return;
    // Parameters that got no gradient this pass: their region holds zeros or
    // earlier accumulated gradients (stage 0/1), or is zero-filled (stage 2).
    for (int64_t i = 0; i < (int64_t)params_.size(); i++) {
        if (ready_[i]) continue;
        if (opts_.stage >= 2) stage_grad(i);
        ready_[i] = 1;
        buckets_[bucket_of_[i]].pending--;
    }
    while (next_launch_ < (int64_t)buckets_.size()) launch(next_launch_++);
    // Note [Reductions end with backward]: as DDP's reducer does, wait here.
    // The reductions overlapped the rest of backward; the step needs them next
    // anyway, and no later backward may write into a bucket (stage 0/1) or a
    // ring slot (stage 2) that a collective is still reading.
    wait_reductions();
    if (opts_.stage == 3)
        for (auto &bk : buckets_) release_bucket(bk);
    // Reset readiness for the next backward.
    std::fill(ready_.begin(), ready_.end(), 0);
    for (auto &bk : buckets_) {
        bk.pending = (int64_t)bk.params.size();
    }
    next_launch_ = 0;
    reductions_++;
}

int64_t Engine::acquire_slot(int64_t b) {
    for (int64_t s = 0; s < (int64_t)slots_.size(); s++) {
        if (slots_[s].owner < 0) {
            slots_[s].owner = b;
            buckets_[b].slot = s;
            return s;
        }
    }
    // All slots busy: the ring grows to grad_ring_buckets first, then finishes
    // the oldest launched reduction and takes its slot.
    if ((int64_t)slots_.size() >= std::max<int64_t>(1, opts_.grad_ring_buckets) && !inflight_.empty()) {
        const int64_t done = inflight_.front().first;
        complete(done);
        return acquire_slot(b);
    }
    // Below its configured size, or every slot held by a bucket still filling
    // (gradients arrived out of bucket order): grow the ring by one; bounded by
    // the number of buckets.
    Slot sl;
    const auto rt = at::TensorOptions().dtype(rdt_);
    if (opts_.stage >= 2) sl.send = at::zeros({max_padded_}, rt);
    if (world_ > 1) sl.recv = at::zeros({opts_.alltoall_reduce_scatter ? max_padded_ : max_padded_ / parts_}, rt);
    slots_.push_back(std::move(sl));
    return acquire_slot(b);
}

void Engine::release_slot(int64_t b) {
    Bucket &bk = buckets_[b];
    if (bk.slot >= 0) slots_[bk.slot].owner = -1;
    bk.slot = -1;
}

void Engine::launch(int64_t b) {
    Bucket &bk = buckets_[b];
    if (opts_.stage >= 2 && bk.slot < 0) acquire_slot(b);   // bucket with no gradients at all
    if (opts_.stage >= 2) {
        // Zero the padding so it never feeds the optimizer garbage.
        slots_[bk.slot].send.narrow(0, bk.numel, bk.padded_numel - bk.numel).zero_();
    }
    if (world_ == 1) {
        if (opts_.stage >= 2) {
            at::Tensor src = slots_[bk.slot].send.narrow(0, 0, bk.padded_numel);
            grad_shard_slice(bk).add_(src);
            release_slot(b);
        }
        return;
    }
    auto &pg = *pg_;
    c10::intrusive_ptr<c10d::Work> work;
    if (opts_.stage == 0) {
        bk.flat_grad.div_((double)world_);
        std::vector<at::Tensor> t{bk.flat_grad};
        c10d::AllreduceOptions o;
        o.reduceOp = c10d::ReduceOp::SUM;
        work = pg->allreduce(t, o);
        count(c_allreduce_, bk.padded_numel, bk.flat_grad.element_size());
    } else {
        at::Tensor send = opts_.stage >= 2 ? slots_[bk.slot].send.narrow(0, 0, bk.padded_numel) : bk.flat_grad;
        if (bk.slot < 0) acquire_slot(b);
        Slot &sl = slots_[bk.slot];
        if (opts_.alltoall_reduce_scatter) {
            // Note [Reduce-scatter on gloo]: gloo's reduce_scatter is an
            // all-reduce underneath (2x the bytes); an equal-split all-to-all
            // moves exactly one slice to each peer, and zx_sum_slices adds them.
            at::Tensor recv = sl.recv.narrow(0, 0, bk.padded_numel);
            std::vector<int64_t> splits;   // empty: equal splits
            work = pg->alltoall_base(recv, send, splits, splits);
        } else {
            at::Tensor recv = sl.recv.narrow(0, 0, bk.slice_numel);
            c10d::ReduceScatterOptions o;
            o.reduceOp = c10d::ReduceOp::SUM;
            work = pg->_reduce_scatter_base(recv, send, o);
        }
        count(c_reduce_scatter_, bk.padded_numel, send.element_size());
    }
    inflight_.emplace_back(b, std::move(work));
}

void Engine::complete(int64_t b) {
    // Works finish in launch order; complete everything up to b.
    while (!inflight_.empty()) {
        auto [cur, work] = inflight_.front();
        inflight_.pop_front();
        wait_work(work, opts_.stage == 0 ? "gradient all-reduce" : "gradient reduce-scatter");
        Bucket &bk = buckets_[cur];
        if (opts_.stage >= 1) {
            Slot &sl = slots_[bk.slot];
            at::Tensor dst = grad_shard_slice(bk);
            const int accumulate = opts_.stage >= 2 ? 1 : 0;
            if (opts_.alltoall_reduce_scatter && rdt_ != at::kFloat) {
                // Low-precision reduce: add the N slices in fp32 and round once.
                at::Tensor sum = sl.recv.narrow(0, 0, bk.padded_numel).view({parts_, bk.slice_numel})
                                     .to(at::kFloat).sum(0);
                if (accumulate) sum.add_(dst);
                dst.copy_(sum);
            } else if (opts_.alltoall_reduce_scatter) {
                const float *src = sl.recv.data_ptr<float>();
                float *d = dst.data_ptr<float>();
                const int64_t sn = bk.slice_numel;
                const int32_t np = (int32_t)parts_;
                parallel(sn, [&](int64_t lo, int64_t hi) {
                    if (hi - lo == sn) {   // one task: one pass over all slices
                        zx_check(zx_sum_slices(isa_, (size_t)sn, np, src, d, accumulate, 1.0f),
                                 "summing reduce-scatter slices");
                        return;
                    }
                    // Several tasks: each adds columns [lo, hi) of the N slices.
                    for (int32_t j = 0; j < np; j++)
                        zx_check(zx_sum_slices(isa_, (size_t)(hi - lo), 1, src + j * sn + lo, d + lo,
                                               (accumulate || j > 0) ? 1 : 0, 1.0f),
                                 "summing reduce-scatter slices");
                });
            } else if (accumulate) {
                dst.add_(sl.recv.narrow(0, 0, bk.slice_numel));
            } else {
                dst.copy_(sl.recv.narrow(0, 0, bk.slice_numel));
            }
            if (opts_.stage == 1) {
                // Note [Gradient sums in stages 1-2]: zero what this rank does not own.
                const int64_t lo = rank_ * bk.slice_numel, hi = lo + bk.slice_numel;
                if (lo > 0) bk.flat_grad.narrow(0, 0, lo).zero_();
                if (hi < bk.padded_numel) bk.flat_grad.narrow(0, hi, bk.padded_numel - hi).zero_();
            }
            release_slot(cur);
        }
        if (cur == b) break;
    }
}

void Engine::wait_reductions() {
    while (!inflight_.empty()) complete(inflight_.back().first);
}

// ------------------------------------------------------------------ optimizer

void Engine::step_adam(const std::vector<zx_adam_hparams> &hps) {
    wait_reductions();
    wait_params();
    at::Tensor m = state("exp_avg"), v = state("exp_avg_sq");
    bool ams = false;
    for (const auto &h : hps) ams = ams || h.amsgrad;
    at::Tensor vmax = ams ? state("max_exp_avg_sq") : at::Tensor();
    for (auto &bk : buckets_) {
        TORCH_CHECK(bk.group < (int64_t)hps.size(), "zero_ext: missing hyperparameters for group ", bk.group);
        const zx_adam_hparams &hp = hps[bk.group];
        float *p = master(bk);
        char *lp = (char *)lp_out(bk);
        const at::Tensor gs = grad_shard_slice(bk);
        float *mp = m.data_ptr<float>() + bk.shard_offset, *vp = v.data_ptr<float>() + bk.shard_offset;
        float *xp = hp.amsgrad ? vmax.data_ptr<float>() + bk.shard_offset : nullptr;
        parallel(bk.slice_numel, [&](int64_t lo, int64_t hi) {
            with_f32_grads(gs, lo, hi, [&](const float *g, int64_t a, int64_t b) {
                zx_check(zx_adam_step(isa_, (size_t)(b - a), p + a, g, mp + a, vp + a, xp ? xp + a : nullptr,
                                      lp ? lp + a * 2 : nullptr, pzx_, &hp),
                         "Adam step");
            });
        });
    }
}

void Engine::step_sgd(const std::vector<zx_sgd_hparams> &hps) {
    wait_reductions();
    wait_params();
    bool momentum = false;
    for (const auto &h : hps) momentum = momentum || h.momentum != 0.0;
    at::Tensor buf = momentum ? state("momentum_buffer") : at::Tensor();
    for (auto &bk : buckets_) {
        TORCH_CHECK(bk.group < (int64_t)hps.size(), "zero_ext: missing hyperparameters for group ", bk.group);
        const zx_sgd_hparams &hp = hps[bk.group];
        float *p = master(bk);
        char *lp = (char *)lp_out(bk);
        const at::Tensor gs = grad_shard_slice(bk);
        float *bp = hp.momentum != 0.0 ? buf.data_ptr<float>() + bk.shard_offset : nullptr;
        parallel(bk.slice_numel, [&](int64_t lo, int64_t hi) {
            with_f32_grads(gs, lo, hi, [&](const float *g, int64_t a, int64_t b) {
                zx_check(zx_sgd_step(isa_, (size_t)(b - a), p + a, g, bp ? bp + a : nullptr,
                                     lp ? lp + a * 2 : nullptr, pzx_, &hp),
                         "SGD step");
            });
        });
    }
}

std::vector<at::Tensor> Engine::param_shards() {
    std::vector<at::Tensor> out;
    for (auto &bk : buckets_) out.push_back(master_slice(bk));
    return out;
}

std::vector<at::Tensor> Engine::grad_shards() {
    std::vector<at::Tensor> out;
    for (auto &bk : buckets_) out.push_back(grad_shard_slice(bk));
    return out;
}

std::vector<int64_t> Engine::bucket_groups() {
    std::vector<int64_t> out;
    for (auto &bk : buckets_) out.push_back(bk.group);
    return out;
}

std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> Engine::fragments(int64_t r) const {
    TORCH_CHECK(r >= 0 && r < std::max<int64_t>(parts_, 1), "zero_ext: no rank ", r, " among ", parts_, " partitions");
    std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> out;
    std::vector<zx_fragment> fr;
    for (int64_t b = 0; b < (int64_t)buckets_.size(); b++) {
        int64_t count = 0;
        zx_plan_fragments(plan_, b, (int32_t)r, nullptr, 0, &count);
        fr.resize((size_t)count);
        zx_check(zx_plan_fragments(plan_, b, (int32_t)r, fr.data(), count, &count), "reading the plan");
        for (const auto &f : fr)
            out.emplace_back(f.param, f.param_offset, buckets_[b].shard_offset + f.slice_offset, f.numel);
    }
    return out;
}

void Engine::publish_params() {
    wait_params();
    cast_masters();
    if (opts_.stage == 3) {
        // Gathered units hold stale values: release them; the next gather reads the shards.
        for (auto &bk : buckets_) release_bucket(bk);
        return;
    }
    all_gather_params();
    wait_params();
}

void Engine::scale_grads(double factor) {
    wait_reductions();
    if (factor == 1.0) return;
    for (auto &bk : buckets_) {
        at::Tensor gs = grad_shard_slice(bk);
        if (rdt_ != at::kFloat) {
            gs.mul_(factor);
            continue;
        }
        float *g = gs.data_ptr<float>();
        parallel(bk.slice_numel, [&](int64_t lo, int64_t hi) {
            zx_check(zx_scale(isa_, (size_t)(hi - lo), g + lo, (float)factor), "scaling gradients");
        });
    }
}

std::pair<double, int64_t> Engine::grad_sumsq(double scale) {
    wait_reductions();
    double sumsq = 0.0;
    int64_t nonfinite = 0;
    for (auto &bk : buckets_) {
        const at::Tensor gs = grad_shard_slice(bk);
        std::mutex mu;
        parallel(bk.slice_numel, [&](int64_t lo, int64_t hi) {
            double s = 0.0;
            int64_t nf = 0;
            with_f32_grads(gs, lo, hi, [&](const float *g, int64_t a, int64_t b) {
                zx_check(zx_grad_sumsq(isa_, (size_t)(b - a), g, (float)scale, &s, &nf), "gradient norm");
            });
            std::lock_guard<std::mutex> lock(mu);
            sumsq += s;
            nonfinite += nf;
        });
    }
    if (parts_ > 1) {
        // One small all-reduce carries both the norm and the inf/nan count.
        at::Tensor t = at::empty({2}, at::TensorOptions().dtype(at::kDouble));
        t[0] = sumsq;
        t[1] = (double)nonfinite;
        std::vector<at::Tensor> ts{t};
        c10d::AllreduceOptions o;
        o.reduceOp = c10d::ReduceOp::SUM;
        wait_work((*pg_)->allreduce(ts, o), "gradient-norm all-reduce");
        count(c_allreduce_, 2, 8);   // two doubles
        sumsq = t[0].item<double>();
        nonfinite = (int64_t)t[1].item<double>();
    }
    return {sumsq, nonfinite};
}

void Engine::cast_masters() {
    if (!lp_) return;
    wait_params();
    for (auto &bk : buckets_) {
        const float *p = master(bk);
        char *lp = (char *)lp_slice(bk).data_ptr();
        parallel(bk.slice_numel, [&](int64_t lo, int64_t hi) {
            zx_check(zx_cast_from_f32(isa_, (size_t)(hi - lo), p + lo, lp + lo * 2, pzx_), "casting parameters");
        });
    }
}

void Engine::absorb_param_edits() {
    TORCH_CHECK(opts_.stage <= 2, "zero_ext: absorb_param_edits is for stages 0-2 (stage 3: commit_unit)");
    wait_params();
    if (!lp_) return;   // the owned slice is the master
    for (auto &bk : buckets_) absorb(master_slice(bk), owned_slice(bk.flat_param, bk));
}

void Engine::all_gather_params() {
    if (parts_ == 1 || opts_.stage == 3) return;   // stage 3 gathers per unit, on demand
    wait_params();
    for (auto &bk : buckets_) {
        at::Tensor in = owned_slice(bk.flat_param, bk);   // in place: the owned slice of the output
        gather_works_.push_back((*pg_)->_allgather_base(bk.flat_param, in));
        count(c_allgather_, bk.padded_numel, bk.flat_param.element_size());
    }
}

void Engine::wait_params() {
    for (auto &w : gather_works_) wait_work(w, "parameter all-gather");
    gather_works_.clear();
}

void Engine::zero_grad(bool set_to_none) {
    wait_reductions();
    for (auto &bk : buckets_)
        if (bk.flat_grad.defined()) bk.flat_grad.zero_();
    if (grad_shard_.defined()) grad_shard_.zero_();
    for (auto &p : params_) {
        if (set_to_none) p.mutable_grad() = at::Tensor();
    }
}

void Engine::broadcast_tensors(std::vector<at::Tensor> tensors, int64_t src) {
    if (world_ == 1 || tensors.empty()) return;
    for (auto &t : tensors) {
        std::vector<at::Tensor> one{t};
        c10d::BroadcastOptions o;
        o.rootRank = src;
        wait_work((*pg_)->broadcast(one, o), "broadcast");
        c_broadcast_.calls++;
        c_broadcast_.numel += t.numel();
        c_broadcast_.bytes += t.numel() * (int64_t)t.element_size();
    }
}

// ------------------------------------------------------------------ stage 3

void Engine::wait_gather(Bucket &bk) {
    if (bk.gather_work) {
        auto work = std::move(bk.gather_work);
        bk.gather_work.reset();
        wait_work(work, "unit all-gather");
    }
}

void Engine::release_bucket(Bucket &bk) {
    wait_gather(bk);
    const bool staged = bk.staging.defined();
    if (!staged && !bk.gathered) return;   // the common case after backward: nothing held
    if (staged) {
        gathered_bytes_ -= bk.staging.nbytes();
        bk.staging = at::Tensor();
    }
    if (bk.gathered) {
        at::native::resize_bytes_cpu(bk.flat_param.storage().unsafeGetStorageImpl(), 0);
        gathered_bytes_ -= bk.flat_param.numel() * bk.flat_param.element_size();
        bk.gathered = false;
    }
    const at::Tensor empty = at::empty({0}, bk.flat_param.options());
    for (int64_t i : bk.params) params_[i].set_data(empty);
}

void Engine::mark_gathered(Bucket &bk) {
    wait_gather(bk);
    if (bk.gathered) return;
    bk.gathered = true;
    for (int64_t i : bk.params) params_[i].set_data(param_views_[i]);
}

bool Engine::gather_unit(int64_t u, bool wait) {
    TORCH_CHECK(opts_.stage == 3, "zero_ext: gather_unit is a stage-3 operation");
    TORCH_CHECK(u >= 0 && u < (int64_t)unit_buckets_.size(), "zero_ext: no unit ", u);
    bool prefetched = true;
    for (int64_t b : unit_buckets_[u]) {
        Bucket &bk = buckets_[b];
        if (bk.gathered) continue;
        if (!bk.gather_work) {
            prefetched = false;
            const int64_t bytes = bk.flat_param.numel() * bk.flat_param.element_size();
            at::native::resize_bytes_cpu(bk.flat_param.storage().unsafeGetStorageImpl(), (size_t)bytes);
            gathered_bytes_ += bytes;
            peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_);
            at::Tensor in = lp_slice(bk);
            if (world_ == 1) {
                bk.flat_param.copy_(in);
                mark_gathered(bk);
                continue;
            }
            bk.gather_work = (*pg_)->_allgather_base(bk.flat_param, in);
            count(c_allgather_, bk.padded_numel, bk.flat_param.element_size());
        }
        if (wait) mark_gathered(bk);
    }
    return prefetched;
}

void Engine::release_unit(int64_t u) {
    TORCH_CHECK(u >= 0 && u < (int64_t)unit_buckets_.size(), "zero_ext: no unit ", u);
    for (int64_t b : unit_buckets_[u]) release_bucket(buckets_[b]);
}

void Engine::commit_unit(int64_t u, int64_t src) {
    TORCH_CHECK(u >= 0 && u < (int64_t)unit_buckets_.size(), "zero_ext: no unit ", u);
    for (int64_t b : unit_buckets_[u]) {
        Bucket &bk = buckets_[b];
        if (bk.staging.defined()) {   // open_unit_fp32: full-precision values
            broadcast_tensors({bk.staging}, src);
            master_slice(bk).copy_(owned_slice(bk.staging, bk));
            if (lp_) lp_slice(bk).copy_(owned_slice(bk.staging, bk));
            release_bucket(bk);
            continue;
        }
        TORCH_CHECK(bk.gathered, "zero_ext: commit_unit needs unit ", u, " gathered");
        broadcast_tensors({bk.flat_param}, src);
        const at::Tensor owned = owned_slice(bk.flat_param, bk);
        if (lp_) {
            absorb(master_slice(bk), owned);
            lp_slice(bk).copy_(owned);
        } else {
            master_slice(bk).copy_(owned);
        }
    }
}

void Engine::open_unit_fp32(int64_t u) {
    TORCH_CHECK(opts_.stage == 3, "zero_ext: open_unit_fp32 is a stage-3 operation");
    TORCH_CHECK(u >= 0 && u < (int64_t)unit_buckets_.size(), "zero_ext: no unit ", u);
    if (!lp_) {
        gather_unit(u, true);
        return;
    }
    for (int64_t b : unit_buckets_[u]) {
        Bucket &bk = buckets_[b];
        release_bucket(bk);
        bk.staging = at::zeros({bk.padded_numel}, at::TensorOptions().dtype(at::kFloat));
        gathered_bytes_ += bk.staging.nbytes();
        peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_);
        for (int64_t i : bk.params)
            params_[i].set_data(bk.staging.narrow(0, offset_of_[i], param_views_[i].numel())
                                    .view(param_views_[i].sizes()));
    }
}

bool Engine::unit_gathered(int64_t u) const {
    for (int64_t b : unit_buckets_.at(u))
        if (!buckets_[b].gathered) return false;
    return true;
}

// ------------------------------------------------------------------ state

at::Tensor Engine::state(const std::string &name) {
    auto it = states_.find(name);
    if (it != states_.end()) return it->second;
    at::Tensor t = at::zeros({shard_numel_}, at::TensorOptions().dtype(at::kFloat));
    states_[name] = t;
    return t;
}

static py::dict counter_dict(const CommCounter &c) {
    py::dict d;
    d["calls"] = c.calls;
    d["numel"] = c.numel;
    d["bytes"] = c.bytes;
    return d;
}

py::dict Engine::stats() const {
    int64_t param_bytes = 0, grad_bytes = 0, numel = 0, padded = 0;
    for (const auto &bk : buckets_) {
        if (opts_.stage < 3) param_bytes += bk.flat_param.nbytes();
        if (bk.flat_grad.defined()) grad_bytes += bk.flat_grad.nbytes();
        numel += bk.numel;
        padded += bk.padded_numel;
    }
    if (grad_shard_.defined()) grad_bytes += grad_shard_.nbytes();
    int64_t master_bytes = 0;
    if (opts_.stage == 3) param_bytes += (lp_ ? lp_shard_ : master_shard_).nbytes();
    if (lp_) master_bytes = master_shard_.nbytes();
    int64_t state_bytes = 0;
    for (const auto &kv : states_) state_bytes += kv.second.nbytes();
    int64_t ring_bytes = 0;
    for (const auto &s : slots_) {
        if (s.send.defined()) ring_bytes += s.send.nbytes();
        if (s.recv.defined()) ring_bytes += s.recv.nbytes();
    }
    py::dict msb;
    msb["parameters"] = param_bytes;
    msb["gradients"] = grad_bytes;
    msb["master_weights"] = master_bytes;   // 0 with fp32 parameters: the owned slice is the master
    msb["optimizer_states"] = state_bytes;
    msb["total"] = param_bytes + grad_bytes + master_bytes + state_bytes;
    py::dict buf;
    buf["grad_ring"] = ring_bytes;
    buf["ring_slots"] = (int64_t)slots_.size();
    buf["gathered_params"] = gathered_bytes_;            // stage 3: full units held now
    buf["peak_gathered_params"] = peak_gathered_bytes_;  // stage 3: most held at once
    buf["total"] = ring_bytes + gathered_bytes_;
    py::dict comm;
    comm["all_reduce"] = counter_dict(c_allreduce_);
    comm["reduce_scatter"] = counter_dict(c_reduce_scatter_);
    comm["all_gather"] = counter_dict(c_allgather_);
    comm["broadcast"] = counter_dict(c_broadcast_);
    py::dict d;
    d["stage"] = opts_.stage;
    d["world_size"] = world_;
    d["rank"] = rank_;
    d["isa"] = std::string(zx_isa_name(isa_));
    d["num_params"] = numel;
    d["padded_numel"] = padded;
    d["shard_numel"] = shard_numel_;
    d["num_buckets"] = (int64_t)buckets_.size();
    d["param_dtype"] = opts_.param_dtype;
    d["reduce_dtype"] = opts_.reduce_dtype;
    d["reduce_scatter_impl"] = std::string(opts_.alltoall_reduce_scatter ? "alltoall" : "native");
    d["model_state_bytes"] = msb;
    d["buffer_bytes"] = buf;
    d["comm"] = comm;
    d["reductions"] = reductions_;
    d["num_units"] = (int64_t)unit_buckets_.size();
    return d;
}

std::string Engine::describe_plan() const {
    size_t need = 0;
    zx_plan_describe(plan_, nullptr, 0, &need);
    std::string s(need + 1, '\0');
    zx_check(zx_plan_describe(plan_, s.data(), s.size(), &need), "describing the plan");
    s.resize(need);
    return s;
}

}  // namespace zx
