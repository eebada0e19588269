// backward_step.cpp — step_in_backward: each bucket takes its fused optimizer step as
// soon as its reduced gradient lands, during backward, and no gradient shard is kept.
#include "engine/engine.h"

namespace zx {

// Note [Step in backward]
//   With step_in_backward=True (stages 1-3, one fused Adam/AdamW/SGD optimizer) nothing
//   needs the whole gradient before the step (no clipping, no loss scaling), so Engine::
//   complete() steps each bucket right after its reduction: the fused kernel reads the
//   reduce-scatter's output slice (stage 2-3: the ring slot's receive buffer, or with the
//   all-to-all reduce-scatter the slices summed into one landing buffer; stage 1: the owned
//   slice of the bucket) and the slot is free again. Stages 2-3 then allocate no gradient
//   shard: model state is 4 (master) + 8 (Adam) bytes per sharded element (stage 3: 12
//   B/param; FSDP2 16), the gradient exists only one ring slot at a time. Stage 1 zeroes the
//   bucket after its step (its gradient is consumed, as in stages 2-3).
//   The hyperparameters are the optimizer's param groups as they are when the backward
//   starts (ZeroModel's first gradient hook arms them: a scheduler's step() after the last
//   opt.step() is seen), one step count for every parameter (backward_steps() + 1): a
//   parameter that no rank gave a gradient takes a step with a zero gradient, as under
//   torch's optimizer-in-backward (not DDP's skip). Each reducing backward is one optimizer
//   step; opt.step() then only publishes the parameters (the stage 1-2 all-gather).
//   no_sync micro-steps reduce nothing and step nothing; the backward that reduces steps.

void Engine::set_backward_step_adam(std::vector<zx_adam_hparams> hps) {
    TORCH_CHECK(layout_.opts.step_in_backward, "zero_ext: internal: set_backward_step_adam without step_in_backward");
    book_.backward.adam = std::move(hps);
    book_.backward.sgd.clear();
}

void Engine::set_backward_step_sgd(std::vector<zx_sgd_hparams> hps) {
    TORCH_CHECK(layout_.opts.step_in_backward, "zero_ext: internal: set_backward_step_sgd without step_in_backward");
    book_.backward.sgd = std::move(hps);
    book_.backward.adam.clear();
}

at::Tensor Engine::landing(int64_t numel) {
    if (!shard_.land.defined() || shard_.land.numel() < numel)
        shard_.land = at::empty({layout_.max_padded / layout_.partitions}, on_device(layout_.dtypes.reduce));
    return shard_.land.narrow(0, 0, numel);
}

void Engine::step_landed(Bucket &bk, const at::Tensor &grad) {
    BackwardStep &armed = book_.backward;
    TORCH_CHECK(!armed.adam.empty() || !armed.sgd.empty(),
                "zero_ext: internal: a bucket landed in a step_in_backward backward that was not armed");
    const int64_t g = bk.group, step = armed.steps + 1;
    settle_masters();   // Note [Split master in the engine]
    char *lp = (char *)lp_out(bk);
    // Note [One fused step] (stepper.cpp): the whole slice, with the armed optimizer's Op
    const auto land = [&](const auto &hps) {
        TORCH_CHECK(g < (int64_t)hps.size(), "zero_ext: internal: missing hyperparameters for group ", g);
        const auto op = fused_op(hps).at(bk.window.offset - bk.window.lo, bk.window.counter);   // Note [State windows]
        auto h = hps[g];
        op.at_step(h, step);
        step_range(*kernels_.device, bk, 0, bk.slice_numel, grad, op, lp, h, nullptr, nullptr);
    };
    if (!armed.adam.empty())
        land(armed.adam);
    else
        land(armed.sgd);
    armed.stepped = true;
}

}  // namespace zx
