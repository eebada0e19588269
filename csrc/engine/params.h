// params.h — the engine's trainable parameters: the tensors the user's model holds, and
// where each lies in the buckets (Note [Cut parameters], fill.cpp): its pieces as the plan
// gives them, one when it lies whole in one bucket. A cut parameter (more than one piece)
// owns storage instead of being a view, so its values are copied out after a gather
// (`stale` until then) and in before a step.
#pragma once

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "core/zx_core.h"
#include "engine/check.h"   // defines: plan_pieces

namespace zx {

struct Bucket;   // bucket.h

class Params {
public:
    explicit Params(std::vector<at::Tensor> tensors) : tensors_(std::move(tensors)) {}

    // --- the tensors, in the order the engine was given them ---
    size_t size() const { return tensors_.size(); }
    at::Tensor &operator[](int64_t i) { return tensors_[(size_t)i]; }
    const at::Tensor &operator[](int64_t i) const { return tensors_[(size_t)i]; }
    std::vector<at::Tensor> &tensors() { return tensors_; }
    auto begin() { return tensors_.begin(); }
    auto end() { return tensors_.end(); }

    // --- where each lies: reads every parameter's pieces from the plan ---
    void read_pieces(const zx_plan *plan) {
        pieces_.assign(tensors_.size(), {});
        for (size_t i = 0; i < tensors_.size(); i++) {
            pieces_[i] = plan_pieces(plan, (int64_t)i);
            any_cut_ = any_cut_ || pieces_[i].size() > 1;
        }
    }
    const std::vector<zx_piece> &pieces(int64_t i) const { return pieces_[(size_t)i]; }
    bool cut(int64_t i) const { return pieces_[(size_t)i].size() > 1; }
    bool any_cut() const { return any_cut_; }

    std::vector<int64_t> cut_list() const;   // the cut parameters' indices (fill.cpp)

    // A gather landed new values in the buckets: cut parameters must copy them out.
    void gathered() { stale_ = stale_ || any_cut_; }
    bool stale() const { return stale_; }
    // into_params: cut parameters := their pieces in the buckets (no longer stale); else the
    // pieces := the cut parameters (their edits). fill.cpp, Note [Cut parameters].
    void copy_cut(std::vector<Bucket> &buckets, bool into_params);

private:
    std::vector<at::Tensor> tensors_;
    std::vector<std::vector<zx_piece>> pieces_;   // per parameter
    bool any_cut_ = false;
    bool stale_ = false;   // a gather landed since cut parameters were last copied out
};

}  // namespace zx
