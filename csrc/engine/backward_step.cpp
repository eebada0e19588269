// backward_step.cpp — step_in_backward: each bucket takes its fused optimizer step as
// soon as its reduced gradient lands, during backward, and no gradient shard is kept
// (Stepper::land; the engine arms it and calls it: engine.cpp).
#include "engine/stepper.h"

namespace zx {

// Note [Step in backward]
//   With step_in_backward=True (stages 1-3, one fused Adam/AdamW/SGD optimizer) nothing
//   needs the whole gradient before the step (no clipping, no loss scaling), so
//   GradReducer::complete() steps each bucket right after its reduction (through
//   ReducerHooks::step_landed, which the engine implements by calling Stepper::land): the
//   fused kernel reads the reduce-scatter's output slice (stage 2-3: the ring slot's
//   receive buffer, or with the all-to-all reduce-scatter the slices summed into one
//   landing buffer; stage 1: the owned slice of the bucket) and the slot is free again.
//   Stages 2-3 then allocate no gradient shard: model state is 4 (master) + 8 (Adam) bytes
//   per sharded element (stage 3: 12 B/param; FSDP2 16), the gradient exists only one ring
//   slot at a time. Stage 1 zeroes the bucket after its step (its gradient is consumed, as
//   in stages 2-3).
//   The hyperparameters are the optimizer's param groups as they are when the backward
//   starts (ZeroModel's first gradient hook arms them: a scheduler's step() after the last
//   opt.step() is seen), one step count for every parameter (backward_steps() + 1): a
//   parameter that no rank gave a gradient takes a step with a zero gradient, as under
//   torch's optimizer-in-backward (not DDP's skip). Each reducing backward is one optimizer
//   step; opt.step() then only publishes the parameters (the stage 1-2 all-gather).
//   no_sync micro-steps reduce nothing and step nothing; the backward that reduces steps.

void Stepper::land(const BackwardStep &armed, Bucket &bk, const at::Tensor &grad) {
    TORCH_CHECK(!armed.adam.empty() || !armed.sgd.empty(),
                "zero_ext: internal: a bucket landed in a step_in_backward backward that was not armed");
    const int64_t g = bk.group, step = armed.steps + 1;
    char *lp = (char *)shard.lp_out(bk);
    // the whole slice, with the armed optimizer's Op
    const auto with = [&](const auto &hps) {
        TORCH_CHECK(g < (int64_t)hps.size(), "zero_ext: internal: missing hyperparameters for group ", g);
        const auto on = op(hps).at(bk.window.offset - bk.window.lo, bk.window.counter);   // Note [State windows]
        auto h = hps[g];
        on.at_step(h, step);
        range(*kernels.device, bk, 0, bk.slice_numel, grad, on, lp, h, nullptr, nullptr);
    };
    if (!armed.adam.empty())
        with(armed.adam);
    else
        with(armed.sgd);
}

}  // namespace zx
