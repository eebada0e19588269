// unused.cpp — parameters that got no gradient: which ones, agreed across
// ranks with one small all-reduce when needed, per-parameter step counts, and the
// runs of this rank's fragments that a fused step updates.
//
// Note [Unused parameters]
//   torch's optimizers skip a parameter whose .grad is None: no weight decay, no
//   moment update, and its step count (Adam's bias correction) does not advance.
//   Under DDP(find_unused_parameters=True) a parameter keeps .grad None exactly
//   when no rank produced a gradient for it since the last zero_grad(set_to_none=
//   True); a gradient on any rank makes it a (zero-padded) average on all ranks.
//   The engine reproduces this:
//     - used_[i]: parameter i got a gradient on this rank (its accumulation hook
//       fired) since the last zero_grad(set_to_none=True); zero_grad with
//       set_to_none=False keeps it, as torch keeps the zeroed .grad tensors;
//     - begin_step(): one all-reduce (MAX, one byte per parameter and one byte
//       "this rank missed some parameter"; counted as stats()["comm"]["used_flags"])
//       turns the flags into stepped_[i], the same on every rank, and advances
//       param_steps_[i] of the stepped parameters (with several wrapped optimizers,
//       advance_steps() per optimizer as it steps);
//     - that all-reduce is the one collective per step beyond the reduce(-scatter)
//       and the gather, a launch and a latency on NCCL; as DDP without
//       find_unused_parameters, most models never need it. opts_.agree_unused
//       (find_unused_parameters) says when it runs: 1 every step; 2 ("auto") at the
//       first step, and on only while some rank missed some parameter: once every
//       rank had every gradient, no later step pays it; 0 never. Without it every
//       parameter had a gradient on every rank (stepped_ = all), which each rank
//       checks locally for free: the optimizer raises before begin_step(), naming
//       locally_unused(), rather than step a parameter that maybe no rank used.
//       Under the sequence check (Note [Collective sequence check]) a rank that
//       misses a gradient first exchanges its digest (Engine::sequence_sync): if
//       every rank missed it too (a branch no rank took) they meet there and all
//       raise alike; if not, that rank waits there while the others block in the
//       step's collectives, and the check names the divergent rank everywhere (a
//       rank that skipped its backward is the usual cause). A step with no
//       backward since the last one (an optimizer.step() after zero_grad() alone,
//       as to apply an edit) needs no agreement either: no gradient arrived on any
//       rank, so the stepped parameters are this rank's used_ flags, as at one rank
//       (a rank that alone skipped its backward is a script bug that DDP does not
//       catch either; the sequence check names it);
//     - step_runs(b): the stretches of bucket b's owned slice to update. When all
//       of the slice's parameters are stepped with one step count (the usual
//       case) it is the whole slice, padding included, as a single kernel call;
//       otherwise maximal runs of adjacent fragments with one step count, and
//       the fragments of unstepped parameters are left untouched.
//   Reductions are unchanged: every rank still reduces every bucket (unused
//   parameters contribute zeros), so nothing hangs.
#include "engine/engine.h"

#include "engine/check.h"      // defines: zx_check

#include <algorithm>
#include <cstring>

namespace zx {

void Engine::note_grad(int64_t i) {
    if (used_.empty()) used_.assign(params_.size(), 0);
    used_[(size_t)i] = 1;
    grads_since_step_ = true;
}

void Engine::forget_grads() { std::fill(used_.begin(), used_.end(), (uint8_t)0); }

void Engine::ensure_step_tables() {
    const size_t n = params_.size();
    if (used_.empty()) used_.assign(n, 0);
    if (param_steps_.empty()) param_steps_.assign(n, 0);
    if (stepped_.empty()) stepped_.assign(n, 0);
    if (!my_frags_.empty() || buckets_.empty()) return;
    // This rank's fragments per bucket, in slice order.
    my_frags_.resize(buckets_.size());
    std::vector<zx_fragment> fr;
    const int32_t r = (int32_t)(parts_ > 1 ? rank_ : 0);
    for (int64_t b = 0; b < (int64_t)buckets_.size(); b++) {
        int64_t count = 0;
        zx_plan_fragments(plan_, b, r, nullptr, 0, &count);
        fr.resize((size_t)count);
        zx_check(zx_plan_fragments(plan_, b, r, fr.data(), count, &count), "reading the plan");
        for (const auto &f : fr) my_frags_[(size_t)b].push_back({f.param, f.slice_offset, f.numel, 0});
        std::sort(my_frags_[(size_t)b].begin(), my_frags_[(size_t)b].end(),
                  [](const StepRun &a, const StepRun &c) { return a.offset < c.offset; });
    }
}

std::vector<StepRun> Engine::mixed_runs(int64_t b) const {
    // Note [Cut parameters]: the element-granular pieces of a mixed bucket, as runs
    // of adjacent fragments with one param group and one step count.
    TORCH_CHECK(step_begun_, "zero_ext: internal: a fused step ran without begin_step()");
    std::vector<StepRun> runs;
    for (const auto &f : my_frags_[(size_t)b]) {
        if (zx_plan_owner(plan_, f.param) >= 0 || !stepped_[(size_t)f.param]) continue;
        const int64_t s = param_steps_[(size_t)f.param];
        const StepRun *last = runs.empty() ? nullptr : &runs.back();
        if (last && last->step == s && last->offset + last->numel == f.offset &&
            group_of_[(size_t)last->param] == group_of_[(size_t)f.param])
            runs.back().numel += f.numel;
        else
            runs.push_back({f.param, f.offset, f.numel, s});
    }
    return runs;
}

bool Engine::agrees_unused() const {
    return world_ > 1 && opts_.agree_unused != 0 && agree_used_;
}

void Engine::begin_step(bool advance) {
    ensure_step_tables();
    if (sec_) sec_->drop_all();   // the masters change (Note [Hierarchical partitioning])
    const int64_t n = (int64_t)used_.size();
    if (agrees_unused()) {
        at::Tensor t = at::empty({n + 1}, at::kByte);
        std::memcpy(t.data_ptr<uint8_t>(), used_.data(), (size_t)n);
        t.data_ptr<uint8_t>()[n] = std::find(used_.begin(), used_.end(), (uint8_t)0) != used_.end();
        t = t.to(dev_);
        comm_.all_reduce_max_blocking(t, comm_.c_used_flags, "unused-parameter flags all-reduce");
        t = t.cpu();
        std::memcpy(stepped_.data(), t.data_ptr<uint8_t>(), (size_t)n);
        const bool missed = t.data_ptr<uint8_t>()[n] != 0;   // some rank missed some parameter
        if (opts_.agree_unused == 2) {   // "auto": the first step decides; a missed one later turns it back on
            if (!agree_decided_ || missed) agree_used_ = missed;
            agree_decided_ = true;
        }
    } else if (world_ > 1 && grads_since_step_) {
        std::fill(stepped_.begin(), stepped_.end(), (uint8_t)1);   // checked by the caller: locally_unused() is empty
    } else {   // one rank, or no backward since the last step (every rank alike)
        stepped_ = used_;
    }
    step_begun_ = true;
    grads_since_step_ = false;
    if (advance) advance_steps();
}

void Engine::advance_steps() {
    TORCH_CHECK(step_begun_, "zero_ext: internal: advance_steps() without begin_step()");
    for (size_t i = 0; i < stepped_.size(); i++)
        if (stepped_[i] && active_param((int64_t)i)) param_steps_[i]++;
}

std::vector<StepRun> Engine::step_runs(int64_t b) const {
    TORCH_CHECK(step_begun_, "zero_ext: internal: a fused step ran without begin_step()");
    std::vector<StepRun> runs;
    const auto &frags = my_frags_[(size_t)b];
    if (frags.empty()) return runs;
    bool uniform = true;
    const int64_t first = frags[0].param;
    for (const auto &f : frags)
        uniform = uniform && stepped_[(size_t)f.param] && param_steps_[(size_t)f.param] == param_steps_[(size_t)first];
    if (uniform) {
        runs.push_back({-1, 0, buckets_[(size_t)b].slice_numel, param_steps_[(size_t)first]});
        return runs;
    }
    for (const auto &f : frags) {
        if (!stepped_[(size_t)f.param]) continue;
        const int64_t s = param_steps_[(size_t)f.param];
        if (!runs.empty() && runs.back().step == s && runs.back().offset + runs.back().numel == f.offset)
            runs.back().numel += f.numel;
        else
            runs.push_back({f.param, f.offset, f.numel, s});
    }
    return runs;
}

std::vector<int64_t> Engine::param_steps() {
    ensure_step_tables();
    return param_steps_;
}

void Engine::set_param_steps(const std::vector<int64_t> &steps) {
    ensure_step_tables();
    TORCH_CHECK(steps.size() == param_steps_.size(), "zero_ext: ", steps.size(), " step counts for ",
                param_steps_.size(), " parameters; pass one step count per trainable parameter");
    param_steps_ = steps;
    bw_.steps = steps.empty() ? 0 : *std::max_element(steps.begin(), steps.end());   // Note [Step in backward]
}

std::vector<int64_t> Engine::locally_unused() const {
    std::vector<int64_t> out;
    for (size_t i = 0; i < params_.size(); i++)
        if (i >= used_.size() || !used_[i]) out.push_back((int64_t)i);
    return out;
}

std::vector<bool> Engine::stepped_params() const {
    std::vector<bool> out(params_.size(), false);
    for (size_t i = 0; i < stepped_.size(); i++) out[i] = stepped_[i] != 0;
    return out;
}

}  // namespace zx
