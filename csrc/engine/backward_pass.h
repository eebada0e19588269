// backward_pass.h — where the current backward pass stands (reducer.cpp): which
// parameters' gradients are in, the next bucket to launch (launches go strictly in
// bucket order, so every rank issues the same collectives), whether this pass reduces at
// all (no_sync: Note [Local accumulation]), and two counters the glue reads: passes
// whose gradients were reduced, and a generation that changes whenever gradients do.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace zx {

class BackwardPass {
public:
    void resize(int64_t params) { ready_.assign((size_t)params, 0); }

    bool ready(int64_t i) const { return ready_[i] != 0; }
    void set_ready(int64_t i) { ready_[i] = 1; }

    // launch(b) for each bucket from the next one on while done(b) (its gradients are in).
    template <class Done, class Launch>
    void launch_in_order(int64_t buckets, Done &&done, Launch &&launch) {
        while (next_launch_ < buckets && done(next_launch_)) launch(next_launch_++);
    }

    // The pass reduced its gradients: ready for the next one.
    void reduced() {
        std::fill(ready_.begin(), ready_.end(), 0);
        next_launch_ = 0;
        reductions_++;
        generation_++;
    }
    void gradients_changed() { generation_++; }

    bool require_sync() const { return require_sync_; }
    void set_require_sync(bool sync) { require_sync_ = sync; }
    int64_t reductions() const { return reductions_; }
    int64_t generation() const { return generation_; }

private:
    std::vector<char> ready_;      // per parameter: its gradient is in (this pass)
    int64_t next_launch_ = 0;      // the first bucket not launched yet
    bool require_sync_ = true;     // false under no_sync: gradients accumulate locally
    int64_t reductions_ = 0;       // backward passes whose gradients were reduced
    int64_t generation_ = 0;       // changes when the gradients do
};

}  // namespace zx
