// step_book.h — which parameters got a gradient, which parameters a step updates (agreed
// across ranks when needed), their step counts, and the runs of this rank's fragments that
// a fused step updates (Note [Unused parameters] in unused.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "core/zx_core.h"

namespace zx {

// A stretch of this rank's shard slice of one bucket that a fused step updates
// with one step count (Note [Unused parameters] in unused.cpp); also a fragment.
struct StepRun {
    int64_t param;                     // the (first) parameter, or -1 for a whole slice
    int64_t offset;                    // first element inside the bucket's owned slice
    int64_t numel;
    int64_t step;                      // step count after this step's increment
};

// Note [Step in backward] (backward_step.cpp): the step armed for the coming backwards and its count.
struct BackwardStep {
    std::vector<zx_adam_hparams> adam;   // one per param group, or empty
    std::vector<zx_sgd_hparams> sgd;     // one per param group, or empty
    int64_t steps = 0;                   // optimizer steps taken in backward
    bool stepped = false;                // some bucket stepped in this backward
};

// Per parameter of one engine. The engine runs the collective (its all-reduce of
// agreement_flags()); everything else about these flags and counts happens here.
class StepBook {
public:
    // agree: EngineOptions::agree_unused (0 never, 1 every step, 2 decided at the first
    // step); ranks: the world size (one rank never agrees).
    StepBook() = default;
    StepBook(size_t num_params, int64_t agree, int64_t ranks)
        : used_(num_params, 0), stepped_(num_params, 0), steps_(num_params, 0), agree_(agree), ranks_(ranks) {}

    // --- gradients since the last step ---
    void note_grad(int64_t i) {
        used_[(size_t)i] = 1;
        grads_since_step_ = true;
    }
    void forget_grad(int64_t i) { used_[(size_t)i] = 0; }   // zero_grad(set_to_none=True) of one group
    void forget_grads();                                     // ... of every group
    bool grads_since_step() const { return grads_since_step_; }
    std::vector<int64_t> locally_unused() const;             // no gradient on this rank

    // --- the step ---
    bool agrees() const { return ranks_ > 1 && agree_ != 0 && agree_used_; }
    // what begin() all-reduces (MAX) when agrees(): the used flags and "this rank missed one"
    std::vector<uint8_t> agreement_flags() const;
    // agreed: the all-reduced agreement_flags() when agrees(), else null
    void begin(const uint8_t *agreed);
    bool begun() const { return begun_; }
    template <class Active>
    void advance(Active &&active) {   // the step counts of the stepped parameters active(i)
        for (size_t i = 0; i < stepped_.size(); i++)
            if (stepped_[i] && active((int64_t)i)) steps_[i]++;
    }
    bool stepped(int64_t i) const { return stepped_[(size_t)i] != 0; }
    std::vector<bool> stepped_params() const;
    const std::vector<int64_t> &steps() const { return steps_; }
    void set_steps(const std::vector<int64_t> &steps);       // (backward.steps: the largest)
    // Note [Step in backward]: the armed step and the steps taken in backward; end_backward():
    // a reducing backward ended, and if some bucket stepped in it, every parameter took a step
    BackwardStep backward;
    void end_backward();

    // --- this rank's fragments ---
    // read once from the plan: per bucket, in slice order (rank: this rank's partition)
    void read_fragments(const zx_plan *plan, int64_t num_buckets, int32_t rank);
    bool has_fragments() const { return !frags_.empty(); }
    const std::vector<StepRun> &fragments(int64_t b) const { return frags_[(size_t)b]; }
    // the runs of bucket b's slice (slice_numel elements) to step: the whole slice when
    // every fragment steps with one count, else maximal runs of adjacent fragments
    std::vector<StepRun> runs(int64_t b, int64_t slice_numel) const;
    // Note [Cut parameters]: a mixed bucket's element-granular pieces (not owned whole,
    // owner(param) < 0), as runs with one param group (group_of) and one step count
    std::vector<StepRun> mixed_runs(int64_t b, const zx_plan *plan, const std::vector<int64_t> &group_of) const;

private:
    std::vector<uint8_t> used_, stepped_;   // got a gradient here / updated by this step (agreed)
    std::vector<int64_t> steps_;            // optimizer steps taken, per parameter
    int64_t agree_ = 2, ranks_ = 1;
    bool agree_used_ = true;                // begin() all-reduces the used flags
    bool agree_decided_ = false;            // agree == 2: the first step has decided agree_used_
    bool grads_since_step_ = false;         // some gradient arrived on this rank since the last begin()
    bool begun_ = false;                    // begin() has run
    std::vector<std::vector<StepRun>> frags_;
};

}  // namespace zx
