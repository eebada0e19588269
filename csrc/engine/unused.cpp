// unused.cpp — StepBook (step_book.h): parameters that got no gradient, which ones,
// agreed across ranks with one small all-reduce when needed (the engine runs it:
// Engine::begin_step, engine.cpp), per-parameter step counts, and the runs of this
// rank's fragments that a fused step updates.
//
// Note [Unused parameters]
//   torch's optimizers skip a parameter whose .grad is None: no weight decay, no
//   moment update, and its step count (Adam's bias correction) does not advance.
//   Under DDP(find_unused_parameters=True) a parameter keeps .grad None exactly
//   when no rank produced a gradient for it since the last zero_grad(set_to_none=
//   True); a gradient on any rank makes it a (zero-padded) average on all ranks.
//   The engine reproduces this:
//     - used_[i] (StepBook, step_book.h): parameter i got a gradient on this rank (its accumulation hook
//       fired) since the last zero_grad(set_to_none=True); zero_grad with
//       set_to_none=False keeps it, as torch keeps the zeroed .grad tensors;
//     - begin_step(): one all-reduce (MAX, one byte per parameter and one byte
//       "this rank missed some parameter"; counted as stats()["comm"]["used_flags"])
//       turns the flags into stepped_[i], the same on every rank, and advances
//       param_steps_[i] of the stepped parameters (with several wrapped optimizers,
//       advance_steps(groups) per optimizer as it steps, Note [Groups as an argument]);
//     - that all-reduce is the one collective per step beyond the reduce(-scatter)
//       and the gather, a launch and a latency on NCCL; as DDP without
//       find_unused_parameters, most models never need it. layout_.opts.agree_unused
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
//     - Stepper::runs(bk): the stretches of bucket bk's owned slice to update. When all
//       of the slice's parameters are stepped with one step count (the usual
//       case) it is the whole slice, padding included, as a single kernel call;
//       otherwise maximal runs of adjacent fragments with one step count, and
//       the fragments of unstepped parameters are left untouched.
//   Reductions are unchanged: every rank still reduces every bucket (unused
//   parameters contribute zeros), so nothing hangs.
#include "engine/step_book.h"

#include "engine/check.h"      // defines: zx_check, plan_fragments

#include <algorithm>
#include <cstring>

namespace zx {

// --- StepBook (step_book.h) ---

void StepBook::forget_grads() { std::fill(used_.begin(), used_.end(), (uint8_t)0); }

std::vector<int64_t> StepBook::locally_unused() const {
    std::vector<int64_t> out;
    for (size_t i = 0; i < used_.size(); i++)
        if (!used_[i]) out.push_back((int64_t)i);
    return out;
}

std::vector<uint8_t> StepBook::agreement_flags() const {
    std::vector<uint8_t> f(used_);
    f.push_back(std::find(used_.begin(), used_.end(), (uint8_t)0) != used_.end());
    return f;
}

void StepBook::begin(const uint8_t *agreed) {
    const size_t n = used_.size();
    if (agreed) {
        std::memcpy(stepped_.data(), agreed, n);
        const bool missed = agreed[n] != 0;   // some rank missed some parameter
        if (agree_ == 2) {   // "auto": the first step decides; a missed one later turns it back on
            if (!agree_decided_ || missed) agree_used_ = missed;
            agree_decided_ = true;
        }
    } else if (ranks_ > 1 && grads_since_step_) {
        std::fill(stepped_.begin(), stepped_.end(), (uint8_t)1);   // checked by the caller: locally_unused() is empty
    } else {   // one rank, or no backward since the last step (every rank alike)
        stepped_ = used_;
    }
    begun_ = true;
    grads_since_step_ = false;
}

std::vector<bool> StepBook::stepped_params() const {
    std::vector<bool> out(stepped_.size(), false);
    for (size_t i = 0; i < stepped_.size(); i++) out[i] = stepped_[i] != 0;
    return out;
}

void StepBook::set_steps(const std::vector<int64_t> &steps) {
    TORCH_CHECK(steps.size() == steps_.size(), "zero_ext: ", steps.size(), " step counts for ", steps_.size(),
                " parameters; pass one step count per trainable parameter");
    steps_ = steps;
    // Note [Step in backward]: its count goes on from the largest
    backward.steps = steps.empty() ? 0 : *std::max_element(steps.begin(), steps.end());
}

void StepBook::end_backward() {
    if (!backward.stepped) return;
    backward.stepped = false;
    backward.steps++;
    std::fill(steps_.begin(), steps_.end(), backward.steps);
}

void StepBook::read_fragments(const zx_plan *plan, int64_t num_buckets, int32_t rank) {
    frags_.assign((size_t)num_buckets, {});
    for (int64_t b = 0; b < num_buckets; b++) {
        for (const auto &f : plan_fragments(plan, b, rank)) frags_[(size_t)b].push_back({f.param, f.slice_offset, f.numel, 0});
        std::sort(frags_[(size_t)b].begin(), frags_[(size_t)b].end(),
                  [](const StepRun &x, const StepRun &y) { return x.offset < y.offset; });
    }
}

std::vector<StepRun> StepBook::runs(int64_t b, int64_t slice_numel) const {
    TORCH_CHECK(begun_, "zero_ext: internal: a fused step ran without begin_step()");
    std::vector<StepRun> out;
    const auto &frags = frags_[(size_t)b];
    if (frags.empty()) return out;
    bool uniform = true;
    const int64_t first = frags[0].param;
    for (const auto &f : frags)
        uniform = uniform && stepped_[(size_t)f.param] && steps_[(size_t)f.param] == steps_[(size_t)first];
    if (uniform) {
        out.push_back({-1, 0, slice_numel, steps_[(size_t)first]});
        return out;
    }
    for (const auto &f : frags) {
        if (!stepped_[(size_t)f.param]) continue;
        const int64_t s = steps_[(size_t)f.param];
        if (!out.empty() && out.back().step == s && out.back().offset + out.back().numel == f.offset)
            out.back().numel += f.numel;
        else
            out.push_back({f.param, f.offset, f.numel, s});
    }
    return out;
}

std::vector<StepRun> StepBook::mixed_runs(int64_t b, const zx_plan *plan, const std::vector<int64_t> &group_of) const {
    // Note [Cut parameters]: the element-granular pieces of a mixed bucket, as runs
    // of adjacent fragments with one param group and one step count.
    TORCH_CHECK(begun_, "zero_ext: internal: a fused step ran without begin_step()");
    std::vector<StepRun> out;
    for (const auto &f : frags_[(size_t)b]) {
        if (zx_plan_owner(plan, f.param) >= 0 || !stepped_[(size_t)f.param]) continue;
        const int64_t s = steps_[(size_t)f.param];
        const StepRun *last = out.empty() ? nullptr : &out.back();
        if (last && last->step == s && last->offset + last->numel == f.offset &&
            group_of[(size_t)last->param] == group_of[(size_t)f.param])
            out.back().numel += f.numel;
        else
            out.push_back({f.param, f.offset, f.numel, s});
    }
    return out;
}

}  // namespace zx
