// param_pieces.h — where each parameter lies in the buckets (Note [Cut parameters],
// fill.cpp): its pieces as the plan gives them, one when it lies whole in one bucket.
// A cut parameter (more than one piece) owns storage instead of being a view, so its
// values are copied out after a gather (`stale` until then) and in before a step.
#pragma once

#include <vector>

#include "core/zx_core.h"
#include "engine/check.h"   // defines: zx_check

namespace zx {

class ParamPieces {
public:
    // Reads the pieces of parameters [0, n) from the plan.
    void read(const zx_plan *plan, int64_t n) {
        pieces_.assign((size_t)n, {});
        for (int64_t i = 0; i < n; i++) {
            int64_t count = 0;
            zx_plan_param_pieces(plan, i, nullptr, 0, &count);
            pieces_[i].resize((size_t)count);
            zx_check(zx_plan_param_pieces(plan, i, pieces_[i].data(), count, &count), "reading the plan");
            any_cut_ = any_cut_ || count > 1;
        }
    }

    const std::vector<zx_piece> &of(int64_t i) const { return pieces_[i]; }
    bool cut(int64_t i) const { return pieces_[i].size() > 1; }
    bool any_cut() const { return any_cut_; }
    int64_t size() const { return (int64_t)pieces_.size(); }

    // A gather landed new values in the buckets: cut parameters must copy them out.
    void gathered() { stale_ = stale_ || any_cut_; }
    bool stale() const { return stale_; }
    void copied_out() { stale_ = false; }

private:
    std::vector<std::vector<zx_piece>> pieces_;   // per parameter
    bool any_cut_ = false;
    bool stale_ = false;   // a gather landed since cut parameters were last copied out
};

}  // namespace zx
