// stepper.cpp — the optimizer side: fused Adam/AdamW and SGD steps over each
// bucket's slice of the shard through the kernel table (Note [Kernel table]),
// shard views for generic optimizers, gradient norm / inf-nan scan, scaling,
// and the low-precision copy of the master.
#include "engine/engine.h"

#include "core/zx_step_control.h"   // defines: ZX_CTL_SIZE

namespace zx {

namespace {

const double *ctl_ptr(const at::Tensor &ctl) {
    if (!ctl.defined()) return nullptr;
    TORCH_CHECK(ctl.scalar_type() == at::kDouble && ctl.numel() == ZX_CTL_SIZE && ctl.is_contiguous(),
                "zero_ext: internal: the step control must be a contiguous float64 tensor of ", ZX_CTL_SIZE,
                " elements");
    return ctl.data_ptr<double>();
}

const int64_t *step_ptr(const at::Tensor &steps, int64_t group) {
    if (!steps.defined()) return nullptr;
    TORCH_CHECK(steps.scalar_type() == at::kLong && steps.is_contiguous() && group < steps.numel(),
                "zero_ext: internal: the step counts must be a contiguous int64 tensor with one element per "
                "param group");
    return steps.data_ptr<int64_t>() + group;
}

}  // namespace

// Note [bf16 optimizer states]
//   state_dtype="bf16" keeps exp_avg and exp_avg_sq in bfloat16 (2 + 2 bytes per
//   element instead of 4 + 4), updated by zx_adam_step_bf16_states: the states are
//   widened exactly, stepped in fp32 and stored with stochastic rounding, so updates
//   below half a bf16 ulp (most of exp_avg_sq's at beta2 = 0.999) survive on average
//   instead of being rounded away. The parameter update uses the fp32 states of the
//   step, and the master stays fp32. amsgrad has no bf16 form (refused by zeroify).
//   The random bits of an element are a hash of (seed, counter) alone:
//     seed     kStateSeed (fused_ops.h) + the element's step count (hp.step / the device step):
//              new bits every step, the same on every rank and thread count;
//     counter  the element's position in its bucket + the unpadded elements of the
//              buckets before it (StateWindow::counter, fill.cpp, counts from this
//              rank's slice: its element 0's counter). Element-granular buckets
//              hold their parameters packed in an order that does not depend on the
//              world size (only the padding after them does), so an element draws the
//              same bits at any world size and stage 1/2: with the same gradients the
//              states are the same bits on 1 or N ranks (tests/test_state_dtype.py).
//              Tensor-atomic buckets (Muon/Adafactor beside AdamW) place pieces per rank,
//              so there the counters are unique but depend on the world size; stage 3's
//              buckets follow its units. Padding elements share counters with the next
//              bucket's first ones, which is harmless: they stay exactly zero.
//   With offload the host kernels step the host's bf16 states (kernels_.step()).

// Note [One fused step]
//   step_adam and step_sgd are one loop, step_fused<Op>, over the buckets of the groups
//   the call covers (Note [Groups as an argument]); an Op (fused_ops.h: AdamOp, SgdOp)
//   says where a bucket's states lie, how a step count enters the hyperparameters and
//   which kernel-table calls step a stretch of the slice. Per bucket: wait for its host
//   gradient (offload), then either one call over the whole slice with the device's step
//   control (Note [Step control]) or one call per run of parameters that step (Note
//   [Unused parameters]; a mixed bucket's runs of its covered groups, Note [Cut
//   parameters]), each with its own step count. step_range runs one stretch: on the fp32
//   master, or over a split master in one pass where the kernel table has one, else chunk
//   by chunk through the split master's fp32 scratch (Note [Split master in the engine]).
//   step_in_backward's step_landed (backward_step.cpp) calls step_range directly.
AdamOp Engine::fused_op(const std::vector<zx_adam_hparams> &hps) {
    at::Tensor m = state("exp_avg"), v = state("exp_avg_sq");
    bool ams = false;
    for (const auto &h : hps) ams = ams || h.amsgrad;
    AdamOp op;
    if (m.scalar_type() == at::kBFloat16) {   // Note [bf16 optimizer states]
        TORCH_CHECK(!ams, "zero_ext: amsgrad=True has no bf16 optimizer state; pass state_dtype='fp32' or build "
                    "the optimizer with amsgrad=False");
        op.mb = (uint16_t *)m.data_ptr();
        op.vb = (uint16_t *)v.data_ptr();
        return op;
    }
    op.m = m.data_ptr<float>();
    op.v = v.data_ptr<float>();
    if (ams) op.vmax = state("max_exp_avg_sq").data_ptr<float>();
    return op;
}

SgdOp Engine::fused_op(const std::vector<zx_sgd_hparams> &hps) {
    bool momentum = false;
    for (const auto &h : hps) momentum = momentum || h.momentum != 0.0;
    return {momentum ? state("momentum_buffer").data_ptr<float>() : nullptr};
}

template <class Op>
void Engine::step_range(Kernels &k, Bucket &bk, int64_t lo, int64_t n, const at::Tensor &grad, const Op &op,
                        char *lp, const typename Op::Hparams &hp, const double *ctl, const int64_t *step) {
    const zx_dtype lp_dt = layout_.dtypes.param_zx;
    const int64_t lp_elem = (int64_t)zx_dtype_size(lp_dt);
    auto chunked = [&](float *p, int64_t o, int64_t c) {
        op.chunk(k, p, o, c, grad, lp ? lp + o * lp_elem : nullptr, lp_dt, hp, ctl, step);
    };
    if (!shard_.split) return chunked(master(bk) + lo, lo, n);
    const int64_t b = &bk - buckets_.data();
    auto one_pass = [&](int64_t total, int64_t lead, uint16_t *hi, int16_t *rem, uint8_t *ties) {
        return op.one_pass(k, total, lead, lo, n, hi, rem, ties, grad, hp, ctl, step);
    };
    if (!shard_.split->one_pass(b, (uint16_t *)lp, bk.slice_numel, lo, n, one_pass))
        shard_.split->over(*kernels_.device, b, hi_bits(bk), bk.slice_numel, lo, n, chunked);
}
template void Engine::step_range<AdamOp>(Kernels &, Bucket &, int64_t, int64_t, const at::Tensor &, const AdamOp &,
                                         char *, const zx_adam_hparams &, const double *, const int64_t *);
template void Engine::step_range<SgdOp>(Kernels &, Bucket &, int64_t, int64_t, const at::Tensor &, const SgdOp &,
                                        char *, const zx_sgd_hparams &, const double *, const int64_t *);

template <class Op>
void Engine::step_fused(const std::vector<typename Op::Hparams> &hps, const Groups &groups, const at::Tensor &ctl,
                        const at::Tensor &steps) {
    wait_reductions();
    wait_params();
    const Op op = fused_op(hps);
    settle_masters();   // Note [Split master in the engine]: step the split form
    for (auto &bk : buckets_) {
        // Whole tensors / another part's groups; a mixed bucket's pieces (Note [Cut parameters]).
        if (bk.atomic ? !bk.mixed : !groups.has(bk.group)) continue;
        const int64_t b = &bk - buckets_.data();
        TORCH_CHECK(bk.group < (int64_t)hps.size(), "zero_ext: internal: missing hyperparameters for group ", bk.group);
        char *lp = off_ ? nullptr : (char *)lp_out(bk);   // offload: upload() casts after the step
        if (off_) off_->wait_bucket(b);                   // Note [Optimizer offload]: this bucket alone
        const at::Tensor gs = off_ ? host_grad_slice(bk) : grad_shard_slice(bk);
        const Op on = op.at(bk.window.offset - bk.window.lo, bk.window.counter);   // Note [State windows]
        if (ctl.defined()) {   // Note [Step control]: device step counts, one call per bucket
            TORCH_CHECK(!bk.atomic, "zero_ext: internal: step control with tensor-atomic buckets");
            TORCH_CHECK(!off_, "zero_ext: internal: step control with offload");
            step_range(*kernels_.device, bk, 0, bk.slice_numel, gs, on, lp, hps[bk.group], ctl_ptr(ctl),
                       step_ptr(steps, bk.group));
            continue;
        }
        // Note [Unused parameters]: only the stretches of stepped parameters.
        for (const StepRun &r : step_runs(bk)) {
            const int64_t g = bk.mixed ? layout_.group_of[r.param] : bk.group;
            if (!groups.has(g)) continue;
            TORCH_CHECK(g < (int64_t)hps.size(), "zero_ext: internal: missing hyperparameters for group ", g);
            typename Op::Hparams h = hps[g];
            Op::at_step(h, r.step);
            step_range(kernels_.step(), bk, r.offset, r.numel, gs, on, lp, h, nullptr, nullptr);
        }
        if (off_) upload(bk);   // overlaps the next bucket's step
    }
}

void Engine::step_adam(const std::vector<zx_adam_hparams> &hps, const std::vector<int64_t> &groups,
                       const at::Tensor &ctl, const at::Tensor &steps) {
    step_fused<AdamOp>(hps, Groups(groups), ctl, steps);
}

void Engine::step_sgd(const std::vector<zx_sgd_hparams> &hps, const std::vector<int64_t> &groups,
                      const at::Tensor &ctl, const at::Tensor &steps) {
    step_fused<SgdOp>(hps, Groups(groups), ctl, steps);
}

std::vector<StepRun> Engine::step_runs(const Bucket &bk) const {
    const int64_t b = &bk - buckets_.data();
    return bk.mixed ? book_.mixed_runs(b, layout_.plan, layout_.group_of) : book_.runs(b, bk.slice_numel);
}

std::vector<at::Tensor> Engine::param_shards(const std::vector<int64_t> &groups) {
    const Groups cover(groups);
    std::vector<at::Tensor> out;
    for (auto &bk : buckets_)
        if (cover.has(bk.group)) out.push_back(master_slice(bk));
    return out;
}

std::vector<at::Tensor> Engine::grad_shards(const std::vector<int64_t> &groups) {
    const Groups cover(groups);
    std::vector<at::Tensor> out;
    for (auto &bk : buckets_)
        if (cover.has(bk.group)) out.push_back(grad_shard_slice(bk));
    return out;
}

std::vector<int64_t> Engine::bucket_groups(const std::vector<int64_t> &groups) const {
    const Groups cover(groups);
    std::vector<int64_t> out;
    for (const auto &bk : buckets_)
        if (cover.has(bk.group)) out.push_back(bk.group);
    return out;
}

void Engine::scale_grads(double factor, const std::vector<int64_t> &groups) {
    const Groups cover(groups);
    wait_reductions();
    if (factor == 1.0) return;
    if (params_.any_cut()) ensure_step_tables();
    for (auto &bk : buckets_) {
        if (bk.mixed) {
            // Note [Cut parameters]: only the pieces of the groups covered.
            const at::Tensor gs = grad_shard_slice(bk);
            for (const StepRun &f : book_.fragments(&bk - buckets_.data()))
                if (cover.has(layout_.group_of[f.param])) gs.narrow(0, f.offset, f.numel).mul_(factor);
            continue;
        }
        if (!cover.has(bk.group)) continue;
        at::Tensor gs = grad_shard_slice(bk);
        if (layout_.dtypes.reduce != at::kFloat) {
            gs.mul_(factor);
            continue;
        }
        kernels_.step().scale(bk.slice_numel, gs.data_ptr<float>(), (float)factor);
    }
}

std::pair<double, int64_t> Engine::grad_sumsq(double scale) {
    wait_reductions();
    double sumsq = 0.0;
    int64_t nonfinite = 0;
    for (auto &bk : buckets_) kernels_.step().grad_sumsq(grad_shard_slice(bk), scale, &sumsq, &nonfinite);
    if (layout_.partitions > 1) {
        // One small all-reduce carries both the norm and the inf/nan count.
        at::Tensor t = at::empty({2}, at::TensorOptions().dtype(at::kDouble).device(layout_.dev));
        t[0] = sumsq;
        t[1] = (double)nonfinite;
        comm_.all_reduce_sum_blocking(t, "gradient-norm all-reduce");
        sumsq = t[0].item<double>();
        nonfinite = (int64_t)t[1].item<double>();
    }
    return {sumsq, nonfinite};
}

void Engine::grad_sumsq_into(at::Tensor out2) {
    wait_reductions();
    TORCH_CHECK(out2.scalar_type() == at::kFloat && out2.numel() == 2 && out2.is_contiguous() &&
                    out2.device() == layout_.dev,
                "zero_ext: internal: grad_sumsq_into needs a contiguous float32 tensor of 2 elements on ", layout_.dev);
    TORCH_CHECK(!off_, "zero_ext: internal: step control with offload");
    out2.zero_();
    for (auto &bk : buckets_) kernels_.device->grad_sumsq_into(grad_shard_slice(bk), out2.data_ptr<float>());
    if (layout_.partitions > 1) comm_.all_reduce_sum_blocking(out2, "gradient-norm all-reduce");
}

void Engine::cast_masters(const std::vector<int64_t> &groups) {
    const Groups cover(groups);
    if (!off_ && (!layout_.dtypes.low() || layout_.opts.stage == 3)) return;   // stage 3 casts at each gather
    if (shard_.split) return settle_masters();   // the parameters hold the rounding unless a master was joined
    wait_params();
    for (auto &bk : buckets_) {
        bool any = cover.has(bk.group);
        for (int64_t g : bk.groups)   // a mixed bucket: any of its groups (Note [Cut parameters])
            any = any || cover.has(g);
        if (!any) continue;
        if (off_) {   // Note [Optimizer offload]: the device's copy, in fp32 too
            upload(bk);
            continue;
        }
        const float *p = master(bk);
        char *lp = (char *)lp_slice(bk).data_ptr();
        kernels_.device->cast_from_f32(bk.slice_numel, p, lp, layout_.dtypes.param_zx);
    }
}

// Note [Optimizer offload]: the master slice as the device computes with it (the
// step's rounding: the bits the fused step writes without offload), through the up
// ring into the owned slice of the bucket (stage 3: into the device's parameter shard,
// which the unit gathers read).
void Engine::upload(Bucket &bk) {
    at::Tensor slot = off_->up_slot(bk.slice_numel);
    if (layout_.dtypes.low())
        kernels_.step().cast_from_f32(bk.slice_numel, master(bk), slot.data_ptr(), layout_.dtypes.param_zx);
    else
        slot.copy_(master_slice(bk));
    off_->up(slot, layout_.opts.stage == 3 ? units_.param_shard.narrow(0, bk.shard_offset, bk.slice_numel)
                                    : owned_slice(bk.flat_param, bk));
}

}  // namespace zx
