// fill.cpp — tensor-atomic buckets filled with element-granular pieces: the
// parameters cut into pieces (own storage, refreshed from and scattered into
// their buckets) and the windows of each slice that hold per-element optimizer
// state (Note [Filling atomic buckets] in core/zx_core.h decides the layout).
#include "engine/check.h"    // defines: zx_check, plan_fragments
#include "engine/fill.h"     // defines: plan_state_windows
#include "engine/params.h"   // defines: Params

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
int64_t plan_state_windows(const Layout &layout, std::vector<Bucket> &buckets) {
    const int64_t r = layout.opts.stage == 0 ? 0 : layout.rank;
    int64_t at = 0;
    uint64_t before = 0;   // unpadded elements of the buckets before (Note [bf16 optimizer states])
    for (int64_t b = 0; b < (int64_t)buckets.size(); b++) {
        Bucket &bk = buckets[b];
        bk.window.counter = before + (uint64_t)(r * bk.slice_numel);
        before += (uint64_t)bk.numel;
        bk.window.lo = 0;
        bk.window.numel = bk.slice_numel;
        if (bk.atomic) {
            int64_t lo = INT64_MAX, hi = 0;
            for (const auto &f : plan_fragments(layout.plan, b, (int32_t)r)) {
                if (zx_plan_owner(layout.plan, f.param) >= 0) continue;
                lo = std::min(lo, f.slice_offset);
                hi = std::max(hi, f.slice_offset + f.numel);
            }
            bk.window.lo = hi > 0 ? lo : 0;
            bk.window.numel = hi > 0 ? hi - lo : 0;
        }
        bk.window.offset = at;
        at += bk.window.numel;
    }
    return at;
}

// Note [Cut parameters]
//   With Muon/Adafactor beside an elementwise optimizer, the planner fills the
//   padding of tensor-atomic buckets with pieces of element-granular parameters
//   (Note [Filling atomic buckets], core/zx_core.h), so a parameter may lie in
//   several buckets. Such a parameter cannot be a view of one bucket: it keeps
//   storage of its own (param_dtype), which Params::copy_cut(true) fills from its
//   pieces after every parameter gather; its gradient is copied piece by piece
//   into each bucket (stage 1: added into flat_grad, no param.grad kept; stage 2:
//   staged into each bucket's ring slot), and each piece counts toward its
//   bucket's readiness. An in-place edit of it reaches the buckets through
//   Params::copy_cut(false) (absorb_param_edits; the Python guard tracks versions
//   when any parameter is cut). A mixed bucket (atomic + pieces) is stepped by
//   both optimizers: the whole tensors by the torch one, its pieces by the fused
//   elementwise step with the piece's own param group; it is gathered once, after
//   every group inside it stepped (all_gather_params) or, if some optimizer was
//   not stepped, when parameters are next needed (flush_params). Stages 1-2.
void Params::copy_cut(std::vector<Bucket> &buckets, bool into_params) {
    at::NoGradGuard ng;
    for (size_t i = 0; i < tensors_.size(); i++) {
        if (!cut(i)) continue;
        // variable_data(): a write that leaves the version counter alone, so the
        // Python guard sees only the user's edits (Note [Edits outside gathered_parameters]).
        at::Tensor flat = tensors_[i].variable_data().view(-1);
        for (const zx_piece &pc : pieces(i)) {
            at::Tensor mine = flat.narrow(0, pc.param_offset, pc.numel);
            at::Tensor in_bucket = buckets[pc.bucket].flat_param.narrow(0, pc.offset, pc.numel);
            (into_params ? mine : in_bucket).copy_(into_params ? in_bucket : mine);
        }
    }
    if (into_params) stale_ = false;
}

std::vector<int64_t> Params::cut_list() const {
    std::vector<int64_t> out;
    for (int64_t i = 0; i < (int64_t)tensors_.size(); i++)
        if (cut(i)) out.push_back(i);
    return out;
}

}  // namespace zx
