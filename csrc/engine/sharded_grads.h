// sharded_grads.h — what each parameter's .grad is: in stages 0-1 between backwards, a view
// into its bucket's gradient; and Note [Sharded gradients] (zero_ext/sharded_grad.py) on
// the engine's side: after a backward whose gradients were reduced, each parameter's .grad
// is the wrapper Python made for it (it answers as DDP's gradient would); the next forward
// puts the engine's own gradient back, unless the user replaced the wrapper meanwhile.
#pragma once

#include <ATen/ATen.h>

#include <utility>
#include <vector>

namespace zx {

class ShardedGrads {
public:
    // Stages 0-1: what param.grad is between backwards. views[i]: parameter i's view into
    // its bucket's flat_grad; views_ok: .grad may be that view (false with a reduce_dtype
    // other than param_dtype: the gradient is added into the view and .grad stays empty;
    // Note [Mixed precision]).
    std::vector<at::Tensor> views;
    bool views_ok = true;

    void set(std::vector<at::Tensor> wrappers) { wrappers_ = std::move(wrappers); }

    void show(std::vector<at::Tensor> &params) {
        if (wrappers_.empty()) return;
        for (size_t i = 0; i < params.size(); i++) params[i].mutable_grad() = wrappers_[i];
        shown_ = true;
    }

    // own(i): parameter i's gradient when no wrapper is shown.
    template <class F>
    void hide(std::vector<at::Tensor> &params, F &&own) {
        if (!shown_) return;
        shown_ = false;
        for (size_t i = 0; i < params.size(); i++) {
            at::Tensor &p = params[i];
            if (!p.grad().defined() || !p.grad().is_same(wrappers_[i])) continue;   // replaced meanwhile
            p.mutable_grad() = own((int64_t)i);
        }
    }

private:
    std::vector<at::Tensor> wrappers_;   // parameter i's, or empty (not installed)
    bool shown_ = false;                 // params' .grad are the wrappers
};

}  // namespace zx
