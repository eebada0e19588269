// stepper.cpp — Stepper (stepper.h): fused Adam/AdamW and SGD steps over each bucket's
// slice of the shard through the kernel table (Note [Kernel table]), shard views for
// generic optimizers, gradient norm / inf-nan scan, scaling, and the low-precision copy
// of the master.
#include "engine/stepper.h"

#include "engine/check.h"   // defines: plan_fragments

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
//   step_adam and step_sgd are one loop, Stepper::step<Op>, over the buckets of the groups
//   the call covers (Note [Groups as an argument]); an Op (fused_ops.h: AdamOp, SgdOp)
//   says where a bucket's states lie, how a step count enters the hyperparameters and
//   which kernel-table calls step a stretch of the slice. Per bucket: wait for its host
//   gradient (offload), then either one call over the whole slice with the device's step
//   control (Note [Step control]) or one call per run of parameters that step (Note
//   [Unused parameters]; a mixed bucket's runs of its covered groups, Note [Cut
//   parameters]), each with its own step count. Stepper::range runs one stretch: on the fp32
//   master, or over a split master in one pass where the kernel table has one, else chunk
//   by chunk through the split master's fp32 scratch (Note [Split master in the engine]).
//   step_in_backward's Stepper::land (backward_step.cpp) runs one range over a whole slice.
//   The engine (engine.cpp) waits for reductions and gathers and settles a split master
//   before it lends the Stepper its buckets and shard (Engine::stepper()).
AdamOp Stepper::op(const std::vector<zx_adam_hparams> &hps) {
    at::Tensor m = shard.state("exp_avg"), v = shard.state("exp_avg_sq");
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
    if (ams) op.vmax = shard.state("max_exp_avg_sq").data_ptr<float>();
    return op;
}

SgdOp Stepper::op(const std::vector<zx_sgd_hparams> &hps) {
    bool momentum = false;
    for (const auto &h : hps) momentum = momentum || h.momentum != 0.0;
    return {momentum ? shard.state("momentum_buffer").data_ptr<float>() : nullptr};
}

template <class Op>
void Stepper::range(Kernels &k, Bucket &bk, int64_t lo, int64_t n, const at::Tensor &grad, const Op &op, char *lp,
                    const typename Op::Hparams &hp, const double *ctl, const int64_t *step) {
    const zx_dtype lp_dt = shard.layout.dtypes.param_zx;
    const int64_t lp_elem = (int64_t)zx_dtype_size(lp_dt);
    auto chunked = [&](float *p, int64_t o, int64_t c) {
        op.chunk(k, p, o, c, grad, lp ? lp + o * lp_elem : nullptr, lp_dt, hp, ctl, step);
    };
    MasterSplit *split = shard.buffers.split.get();
    if (!split) return chunked(shard.master_data(bk) + lo, lo, n);
    auto one_pass = [&](int64_t total, int64_t lead, uint16_t *hi, int16_t *rem, uint8_t *ties) {
        return op.one_pass(k, total, lead, lo, n, hi, rem, ties, grad, hp, ctl, step);
    };
    if (!split->one_pass(index(bk), (uint16_t *)lp, bk.slice_numel, lo, n, one_pass))
        split->over(*kernels.device, index(bk), shard.hi_bits(bk), bk.slice_numel, lo, n, chunked);
}

template void Stepper::range<AdamOp>(Kernels &, Bucket &, int64_t, int64_t, const at::Tensor &, const AdamOp &, char *,
                                    const zx_adam_hparams &, const double *, const int64_t *);
template void Stepper::range<SgdOp>(Kernels &, Bucket &, int64_t, int64_t, const at::Tensor &, const SgdOp &, char *,
                                   const zx_sgd_hparams &, const double *, const int64_t *);

template <class Op>
void Stepper::step(const std::vector<typename Op::Hparams> &hps, const Groups &groups, const at::Tensor &ctl,
                   const at::Tensor &steps) {
    const Op all = op(hps);
    Offload *off = shard.offload;
    for (auto &bk : buckets) {
        // Whole tensors / another part's groups; a mixed bucket's pieces (Note [Cut parameters]).
        if (bk.atomic ? !bk.mixed : !groups.has(bk.group)) continue;
        TORCH_CHECK(bk.group < (int64_t)hps.size(), "zero_ext: internal: missing hyperparameters for group ", bk.group);
        char *lp = off ? nullptr : (char *)shard.lp_out(bk);   // offload: upload() casts after the step
        if (off) off->wait_bucket(index(bk));                  // Note [Optimizer offload]: this bucket alone
        const at::Tensor gs = off ? shard.host_grad(bk) : shard.grad(bk);
        const Op on = all.at(bk.window.offset - bk.window.lo, bk.window.counter);   // Note [State windows]
        if (ctl.defined()) {   // Note [Step control]: device step counts, one call per bucket
            TORCH_CHECK(!bk.atomic, "zero_ext: internal: step control with tensor-atomic buckets");
            TORCH_CHECK(!off, "zero_ext: internal: step control with offload");
            range(*kernels.device, bk, 0, bk.slice_numel, gs, on, lp, hps[bk.group], ctl_ptr(ctl),
                  step_ptr(steps, bk.group));
            continue;
        }
        // Note [Unused parameters]: only the stretches of stepped parameters.
        for (const StepRun &r : runs(bk)) {
            const int64_t g = bk.mixed ? shard.layout.group_of[r.param] : bk.group;
            if (!groups.has(g)) continue;
            TORCH_CHECK(g < (int64_t)hps.size(), "zero_ext: internal: missing hyperparameters for group ", g);
            typename Op::Hparams h = hps[g];
            Op::at_step(h, r.step);
            range(kernels.step(), bk, r.offset, r.numel, gs, on, lp, h, nullptr, nullptr);
        }
        if (off) upload(bk);   // overlaps the next bucket's step
    }
}
template void Stepper::step<AdamOp>(const std::vector<zx_adam_hparams> &, const Groups &, const at::Tensor &,
                                    const at::Tensor &);
template void Stepper::step<SgdOp>(const std::vector<zx_sgd_hparams> &, const Groups &, const at::Tensor &,
                                   const at::Tensor &);

std::vector<StepRun> Stepper::runs(const Bucket &bk) const {
    const Layout &layout = shard.layout;
    return bk.mixed ? book.mixed_runs(index(bk), layout.plan, layout.group_of) : book.runs(index(bk), bk.slice_numel);
}

std::vector<at::Tensor> Stepper::masters(const Groups &groups) {
    return per_bucket(groups, [&](Bucket &bk) { return shard.master(bk); });
}

std::vector<at::Tensor> Stepper::grads(const Groups &groups) {
    return per_bucket(groups, [&](Bucket &bk) { return shard.grad(bk); });
}

std::vector<int64_t> Stepper::bucket_groups(const Groups &groups) {
    return per_bucket(groups, [](Bucket &bk) { return bk.group; });
}

std::vector<FragmentView> Stepper::fragment_views(bool masters, const Groups &groups) {
    const Layout &layout = shard.layout;
    const int32_t r = (int32_t)layout.part();
    std::vector<FragmentView> out;
    int64_t index = 0;   // among the covered buckets
    for (int64_t b = 0; b < (int64_t)buckets.size(); b++) {
        Bucket &bk = buckets[b];
        if (!groups.has(bk.group)) continue;
        const std::vector<zx_fragment> fr = plan_fragments(layout.plan, b, r);
        const at::Tensor m = !fr.empty() && masters ? shard.master(bk) : at::Tensor();
        for (const auto &f : fr)
            out.push_back({f.param, f.param_offset, index, f.slice_offset, f.numel,
                           m.defined() ? m.narrow(0, f.slice_offset, f.numel) : at::Tensor()});
        index++;
    }
    return out;
}

void Stepper::scale_grads(double factor, const Groups &groups) {
    for (auto &bk : buckets) {
        if (bk.mixed) {
            // Note [Cut parameters]: only the pieces of the groups covered.
            const at::Tensor gs = shard.grad(bk);
            for (const StepRun &f : book.fragments(index(bk)))
                if (groups.has(shard.layout.group_of[f.param])) gs.narrow(0, f.offset, f.numel).mul_(factor);
            continue;
        }
        if (!groups.has(bk.group)) continue;
        at::Tensor gs = shard.grad(bk);
        if (shard.layout.dtypes.reduce != at::kFloat) {
            gs.mul_(factor);
            continue;
        }
        kernels.step().scale(bk.slice_numel, gs.data_ptr<float>(), (float)factor);
    }
}

void Stepper::grad_sumsq(double scale, double *sumsq, int64_t *nonfinite) {
    for (auto &bk : buckets) kernels.step().grad_sumsq(shard.grad(bk), scale, sumsq, nonfinite);
}

void Stepper::grad_sumsq_into(const at::Tensor &out2) {
    for (auto &bk : buckets) kernels.device->grad_sumsq_into(shard.grad(bk), out2.data_ptr<float>());
}

void Stepper::cast_masters(const Groups &groups) {
    for (auto &bk : buckets) {
        bool any = groups.has(bk.group);
        for (int64_t g : bk.groups)   // a mixed bucket: any of its groups (Note [Cut parameters])
            any = any || groups.has(g);
        if (!any) continue;
        if (shard.offload) {   // Note [Optimizer offload]: the device's copy, in fp32 too
            upload(bk);
            continue;
        }
        kernels.device->cast_from_f32(bk.slice_numel, shard.master_data(bk), shard.lp(bk).data_ptr(),
                                      shard.layout.dtypes.param_zx);
    }
}

// Note [Optimizer offload]: the master slice as the device computes with it (the
// step's rounding: the bits the fused step writes without offload), through the up
// ring into the owned slice of the bucket (stage 3: into the device's parameter shard,
// which the unit gathers read).
void Stepper::upload(Bucket &bk) {
    const Layout &layout = shard.layout;
    at::Tensor slot = shard.offload->up_slot(bk.slice_numel);
    if (layout.dtypes.low())
        kernels.step().cast_from_f32(bk.slice_numel, shard.master_data(bk), slot.data_ptr(), layout.dtypes.param_zx);
    else
        slot.copy_(shard.master(bk));
    shard.offload->up(slot, layout.opts.stage == 3 ? param_shard.narrow(0, bk.shard_offset, bk.slice_numel)
                                                   : shard.owned(bk.flat_param, bk));
}

}  // namespace zx
