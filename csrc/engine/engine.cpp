// engine.cpp — the Engine facade's calls that hand the work to an owner: the optimizer
// side goes to the Stepper (stepper.cpp, backward_step.cpp) over this rank's ShardView
// (shard_view.cpp), after the engine's own waits (reductions: reducer.cpp; gathers:
// gatherer.cpp) and the split master's settling (master_split.cpp).
#include "engine/engine.h"

namespace zx {

void Engine::step_adam(const std::vector<zx_adam_hparams> &hps, const std::vector<int64_t> &groups,
                       const at::Tensor &ctl, const at::Tensor &steps) {
    before_step();
    stepper().step<AdamOp>(hps, Groups(groups), ctl, steps);
}

void Engine::step_sgd(const std::vector<zx_sgd_hparams> &hps, const std::vector<int64_t> &groups,
                      const at::Tensor &ctl, const at::Tensor &steps) {
    before_step();
    stepper().step<SgdOp>(hps, Groups(groups), ctl, steps);
}

void Engine::before_step() {
    wait_reductions();
    wait_params();
    settle_masters();   // Note [Split master in the engine]: step the split form
}

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

void Engine::step_landed(Bucket &bk, const at::Tensor &grad) {
    settle_masters();   // Note [Split master in the engine]
    stepper().land(book_.backward, bk, grad);
    book_.backward.stepped = true;
}

std::vector<at::Tensor> Engine::param_shards(const std::vector<int64_t> &groups) {
    join_masters();   // Note [Split master in the engine]: only with a split master
    return stepper().masters(Groups(groups));
}

std::vector<at::Tensor> Engine::grad_shards(const std::vector<int64_t> &groups) {
    return stepper().grads(Groups(groups));
}

std::vector<int64_t> Engine::bucket_groups(const std::vector<int64_t> &groups) {
    return stepper().bucket_groups(Groups(groups));
}

at::Tensor Engine::master_slice(Bucket &bk) {
    join_masters();   // Note [Split master in the engine]: only with a split master
    return view().master(bk);
}

at::Tensor Engine::state(const std::string &name) { return view().state(name); }

void Engine::scale_grads(double factor, const std::vector<int64_t> &groups) {
    wait_reductions();
    if (factor == 1.0) return;
    if (params_.any_cut()) ensure_step_tables();   // a mixed bucket's pieces (Note [Cut parameters])
    stepper().scale_grads(factor, Groups(groups));
}

std::pair<double, int64_t> Engine::grad_sumsq(double scale) {
    wait_reductions();
    double sumsq = 0.0;
    int64_t nonfinite = 0;
    stepper().grad_sumsq(scale, &sumsq, &nonfinite);
    if (layout_.partitions > 1) {
        // One small all-reduce carries both the norm and the inf/nan count.
        at::Tensor t = at::empty({2}, on_device(at::kDouble));
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
    stepper().grad_sumsq_into(out2);
    if (layout_.partitions > 1) comm_.all_reduce_sum_blocking(out2, "gradient-norm all-reduce");
}

void Engine::cast_masters(const std::vector<int64_t> &groups) {
    if (!off_ && (!layout_.dtypes.low() || layout_.opts.stage == 3)) return;   // stage 3 casts at each gather
    if (shard_.split) return settle_masters();   // the parameters hold the rounding unless a master was joined
    wait_params();
    stepper().cast_masters(Groups(groups));
}

}  // namespace zx
