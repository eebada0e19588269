// optimizer_states.h — the fused optimizer's per-element states (exp_avg, exp_avg_sq,
// max_exp_avg_sq, momentum_buffer): one flat tensor per name over this rank's state
// windows (Note [State windows], fill.cpp), each made on first use. Which dtype a state
// has is the engine's choice (ShardView::state: Note [bf16 optimizer states]).
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>

namespace zx {

class OptimizerStates {
public:
    void set_numel(int64_t n) { numel_ = n; }
    int64_t numel() const { return numel_; }   // elements of every state: the windows' total

    // name's state; made as numel() zeros with `made` when there is none yet.
    at::Tensor get(const std::string &name, const at::TensorOptions &made) {
        auto it = by_name_.find(name);
        if (it != by_name_.end()) return it->second;
        return by_name_[name] = at::zeros({numel_}, made);
    }
    std::map<std::string, at::Tensor> &all() { return by_name_; }
    int64_t bytes() const {
        int64_t n = 0;
        for (const auto &kv : by_name_) n += kv.second.nbytes();
        return n;
    }

private:
    std::map<std::string, at::Tensor> by_name_;
    int64_t numel_ = 0;
};

}  // namespace zx
