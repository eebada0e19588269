// unit_schedule.h — UnitSchedule, stage 3: which unit the hooks expect next, which units to
// gather ahead (and whether in one collective), and whether a unit stays gathered after its
// forward. Plain data and integers, no torch: zero_ext/model.py's hooks drive it, estimate_memory
// replays a step through it (replay_peak), csrc/core/tests/test_unit_schedule.cpp checks it.
//
// Note [Stage 3 unit sequence]
//   A pass is one call of the root module and, when gradients flow from it, the
//   backward that follows. Every time a pass needs a unit — its forward, its
//   backward (a hook on its outputs' gradients), its recomputation under
//   activation checkpointing — the unit is appended to the pass's record
//   (backward needs of one unit in a row count once). The record of the last
//   pass of the same kind (with or without autograd) predicts the next one:
//   each need moves a cursor past the unit's next occurrence in the prediction,
//   and the `depth` distinct units after the cursor are gathered ahead. So any
//   order that repeats — encoder-decoders whose encoder's backward waits for the
//   whole decoder, recomputation, modules run in another order than registered —
//   is prefetched exactly from its second pass on. Before a kind of pass has been
//   seen, the prediction is registration order, and backward the reverse of the
//   forward just run. A unit is released after its forward unless the prediction
//   needs it again within `depth` units (the last units of forward are the first
//   of backward); after its backward when its last gradient is staged (engine).
//   The window ahead: the `depth` next units, then more of the same phase while it
//   stays within coalesce_numel elements; a forward's window ends where backward
//   begins (the loss, at the activations' peak, holds no unit fetched early).
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <optional>
#include <vector>

namespace zx {

// One need of a unit: its forward (or recomputation), or its backward.
struct UnitNeed {
    int64_t unit = 0;
    bool backward = false;
    bool operator==(const UnitNeed &o) const { return unit == o.unit && backward == o.backward; }
};

// The units to gather ahead now, and whether in one collective (Note [Coalesced unit gathers]).
struct UnitFetch {
    bool together = false;
    std::vector<int64_t> launch;
};

class UnitSchedule {
public:
    // numel: each unit's padded element count (0 is the root); depth: prefetch_depth.
    UnitSchedule(std::vector<int64_t> numel, int64_t depth, int64_t coalesce_numel);

    // The root's forward begins: the previous pass is learned, the prediction chosen.
    void begin_pass(bool grad_enabled);
    // Unit k is needed now: recorded, the cursor moved past it in the prediction.
    void need(int64_t k, bool in_backward);
    // What to gather after unit k's need: the window's units that `requested` says are not
    // gathered or in flight. Nothing until half the window is missing, unless one of the
    // next `depth` is; small units go together.
    UnitFetch ahead(int64_t k, bool in_backward, const std::function<bool(int64_t)> &requested) const;
    // The root's forward is over: the first pass with autograd guesses its backward as this
    // forward reversed; without a backward to come the pass stops recording.
    void end_forward(bool grad_enabled, bool backward_follows);
    // Whether unit k stays gathered after its forward: in the forward window ahead, or (when
    // prefetching) the unit whose backward comes next.
    bool kept_after_forward(int64_t k) const;
    // A compiled forward: the hooks are inert, this pass is not learned.
    void stop_recording() { recording_ = false; }

    int64_t fetches = 0;        // needs (stats()["unit_fetches"])
    int64_t out_of_order = 0;   // needs whose unit was not prefetched (stats()["out_of_order_fetches"])

private:
    std::vector<int64_t> window(int64_t k, bool phase, int64_t budget) const;
    void check_unit(int64_t k) const;

    std::vector<int64_t> numel_;
    int64_t depth_, budget_;                             // budget: coalesce_numel, 0 without prefetch
    std::optional<std::vector<UnitNeed>> learned_[2];    // by pass kind (grad enabled): its last record
    std::vector<UnitNeed> order_, recorded_;             // this pass's prediction, its record
    size_t cursor_ = 0;                                  // next expected position in order_
    bool recording_ = false, grad_pass_ = false;
};

// Most bytes of non-root units held gathered at once (full buffers, plus a coalesced gather's
// staging pair: slice + world slices) over one training step run in registration order and
// backward in reverse, through a UnitSchedule as the hooks drive it (estimate_memory).
int64_t replay_peak(const std::vector<int64_t> &numel, int64_t elem_bytes, int64_t depth, int64_t coalesce_numel,
                    int64_t world);

// What estimate_memory's buffers and communication come to, from the bucket plan: the
// gradient ring, stage 3's gathered units (replay_peak) and sharded frozen parameters, and
// the collective bytes of one optimizer step (stats()'s convention). Throws
// std::invalid_argument on inconsistent numbers.
struct EstimateInputs {
    int64_t stage = 0, world = 1, param_bytes = 4, reduce_bytes = 4;
    int64_t grad_ring_buckets = 1, depth = 0, coalesce_numel = 0, accum = 1;
    int64_t piece_align = 1, slice_align = 1;   // the planner's (Note [Aligned pieces])
    bool alltoall = false, on_meta = false;
    bool narrow_wire = false;   // CPU, no offload, no grad_quant: Note [Narrow gradient wire] (reducer.cpp)
};
struct EstimateBuffers {
    int64_t ring_slots = 0, grad_ring = 0;
    int64_t gathered_root = 0, gathered_unit = 0, prefetch = 0, peak_gathered = 0;   // stage 3
    int64_t frozen_sharded = 0;   // stage 3's frozen shard, bytes
    int64_t comm = 0;
};
// bucket_unit, bucket_padded: per bucket; frozen: stage 3's (unit, numel) of each frozen parameter.
EstimateBuffers buffer_bytes(const std::vector<int64_t> &bucket_unit, const std::vector<int64_t> &bucket_padded,
                         const std::vector<std::pair<int64_t, int64_t>> &frozen, const EstimateInputs &in);

}  // namespace zx
