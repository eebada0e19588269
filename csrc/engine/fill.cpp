// fill.cpp — tensor-atomic buckets filled with element-granular pieces: the
// parameters cut into pieces (own storage, refreshed from and scattered into
// their buckets) and the windows of each slice that hold per-element optimizer
// state (Note [Filling atomic buckets] in core/zx_core.h decides the layout).
#include "engine/engine.h"

#include "engine/check.h"      // defines: zx_check, plan_fragments

namespace zx {

// Note [State windows]
//   The fused steps keep per-element state (exp_avg, ...) only where they step:
//   every element of an element-granular bucket's slice (padding included, so a
//   slice is stepped by one kernel call), and in a tensor-atomic bucket the
//   stretch of this rank's slice holding element-granular pieces (the fillers of
//   Note [Cut parameters]; the whole tensors sit first, the fillers after them), or
//   nothing. Whole tensors' state belongs to the torch optimizer that steps them
//   (zero_ext/whole.py). The flat states are these windows back to back; before,
//   they spanned the whole shard, so Muon + AdamW held AdamW moments for every
//   Muon element too.
void Engine::plan_state_windows() {
    const int64_t r = layout_.opts.stage == 0 ? 0 : layout_.rank;
    int64_t at = 0;
    uint64_t before = 0;   // unpadded elements of the buckets before (Note [bf16 optimizer states])
    for (int64_t b = 0; b < (int64_t)buckets_.size(); b++) {
        Bucket &bk = buckets_[b];
        bk.window.counter = before + (uint64_t)(r * bk.slice_numel);
        before += (uint64_t)bk.numel;
        bk.window.lo = 0;
        bk.window.numel = bk.slice_numel;
        if (bk.atomic) {
            int64_t lo = INT64_MAX, hi = 0;
            for (const auto &f : plan_fragments(layout_.plan, b, (int32_t)r)) {
                if (zx_plan_owner(layout_.plan, f.param) >= 0) continue;
                lo = std::min(lo, f.slice_offset);
                hi = std::max(hi, f.slice_offset + f.numel);
            }
            bk.window.lo = hi > 0 ? lo : 0;
            bk.window.numel = hi > 0 ? hi - lo : 0;
        }
        bk.window.offset = at;
        at += bk.window.numel;
    }
    shard_.states.set_numel(at);
}

std::vector<std::tuple<int64_t, int64_t, int64_t>> Engine::state_windows() const {
    std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
    for (const auto &bk : buckets_) out.emplace_back(bk.window.lo, bk.window.numel, bk.window.offset);
    return out;
}

// Note [Cut parameters]
//   With Muon/Adafactor beside an elementwise optimizer, the planner fills the
//   padding of tensor-atomic buckets with pieces of element-granular parameters
//   (Note [Filling atomic buckets], core/zx_core.h), so a parameter may lie in
//   several buckets. Such a parameter cannot be a view of one bucket: it keeps
//   storage of its own (param_dtype), which copy_cut_params(true) fills from its
//   pieces after every parameter gather; its gradient is copied piece by piece
//   into each bucket (stage 1: added into flat_grad, no param.grad kept; stage 2:
//   staged into each bucket's ring slot), and each piece counts toward its
//   bucket's readiness. An in-place edit of it reaches the buckets through
//   copy_cut_params(false) (absorb_param_edits; the Python guard tracks versions
//   when any parameter is cut). A mixed bucket (atomic + pieces) is stepped by
//   both optimizers: the whole tensors by the torch one, its pieces by the fused
//   elementwise step with the piece's own param group; it is gathered once, after
//   every group inside it stepped (all_gather_params) or, if some optimizer was
//   not stepped, when parameters are next needed (flush_params). Stages 1-2.
void Engine::copy_cut_params(bool into_params) {
    at::NoGradGuard ng;
    for (size_t i = 0; i < params_.size(); i++) {
        if (!params_.cut(i)) continue;
        // variable_data(): a write that leaves the version counter alone, so the
        // Python guard sees only the user's edits (Note [Edits outside gathered_parameters]).
        at::Tensor flat = params_[i].variable_data().view(-1);
        for (const zx_piece &pc : params_.pieces(i)) {
            at::Tensor mine = flat.narrow(0, pc.param_offset, pc.numel);
            at::Tensor in_bucket = buckets_[pc.bucket].flat_param.narrow(0, pc.offset, pc.numel);
            (into_params ? mine : in_bucket).copy_(into_params ? in_bucket : mine);
        }
    }
    if (into_params) params_.copied_out();
}

std::vector<int64_t> Engine::cut_params() const {
    std::vector<int64_t> out;
    for (int64_t i = 0; i < (int64_t)params_.size(); i++)
        if (params_.cut(i)) out.push_back(i);
    return out;
}

}  // namespace zx
