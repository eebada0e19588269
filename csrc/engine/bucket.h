// bucket.h — one bucket of the plan as tensors (Bucket: its fixed BucketShape and StateWindow,
// its buffers, stage 3's FullParams), and a coalesced all-gather of several small ones in
// flight (GatherGroup). Plain data: the engine's owners fill and read them (build.cpp builds
// them from the plan).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <utility>
#include <vector>

#include "engine/comm.h"   // defines: WorkPtr

namespace zx {

// Note [Gradient layout]
//   stage 0/1: flat_grad; param.grad is a view of it, so autograd
//              accumulates straight into the bucket (DDP's gradient_as_bucket_view).
//              Its bytes are held from a step's first gradient to zero_grad(set_to_none=
//              True): read it through bucket_grad (Note [Bucket gradient lifetime]).
//   stage 2:   no flat_grad; each gradient is copied into a ring slot as it
//              arrives, the slot is reduce-scattered into shard_.grad and reused.
//   Mixed precision (Note [Mixed precision]): flat_param holds param_dtype,
//   flat_grad / ring / shard_.grad hold reduce_dtype; when the two differ,
//   stage 0/1 gradients are added into flat_grad by the hook (not views).
struct GatherGroup;

// Note [State windows] (fill.cpp): this rank's window of a slice that has per-element
// optimizer state, and where it starts in the flat states.
struct StateWindow {
    int64_t lo = 0, numel = 0;         // inside the slice
    int64_t offset = 0;                // inside the flat states
    uint64_t counter = 0;              // Note [bf16 optimizer states]: the slice's element 0's rounding counter
};

// What a bucket is, fixed once the plan is turned into tensors (build.cpp; the state
// window: fill.cpp).
struct BucketShape {
    int64_t group = 0;                 // param group index
    std::vector<int64_t> params;       // engine parameter index of each piece, layout order
    int64_t numel = 0;                 // elements of parameters (unpadded)
    int64_t gap_numel = 0;             // padding between parameters (Note [Aligned pieces], core/zx_core.h)
    int64_t padded_numel = 0;          // numel padded to partitions*align
    int64_t slice_numel = 0;           // padded_numel / partitions: one rank's share
    int64_t shard_offset = 0;          // where this bucket's slice sits in a shard
    bool atomic = false;               // tensor-atomic: each slice holds whole tensors
    bool mixed = false;                // atomic and filled with element-granular pieces (Note [Cut parameters])
    std::vector<int64_t> groups;       // mixed: every param group with a piece inside
    std::vector<std::pair<int64_t, int64_t>> gaps;  // padding (offset, numel): zeroed before reduction
    StateWindow window;
    int64_t unit = 0;                  // stage 3: the unit whose parameters this bucket holds
    bool frozen = false;               // stage 3: a unit's frozen parameters (frozen.cpp)
};

// Stage 3 (Note [Stage 3 parameter lifetime]): whether the bucket's full parameters are
// here, and the gather bringing them.
struct FullParams {
    bool gathered = false;             // flat_param holds the full parameters
    WorkPtr work;                      // the all-gather in flight, if any
    std::shared_ptr<GatherGroup> group;   // the coalesced all-gather in flight, if any
    at::Tensor fp32_values;            // low precision: full fp32 values while initializing

    bool requested() const { return gathered || work || group; }   // gathered or in flight
};

// One bucket of the plan, as tensors: its shape and what changes as it runs.
struct Bucket : BucketShape {
    at::Tensor flat_param;             // (padded_numel,) param_dtype; parameters are views
    at::Tensor flat_grad;              // (padded_numel,) reduce_dtype in stage 0/1, else undefined
    at::Tensor local_grad;             // stages 2-3 under no_sync: (padded_numel,) reduce_dtype, else undefined
    int64_t pending = 0;               // parameters not yet ready in this backward
    int64_t slot = -1;                 // ring slot held (stage 2 / all-to-all), or -1
    std::vector<char> stepped;         // mixed: per entry of groups, stepped since the last gather
    FullParams full;                   // stage 3
};

// Note [Coalesced unit gathers] (units.cpp): several small buckets all-gathered
// by one collective through a staging pair; `members` are (bucket, offset in a slice).
struct GatherGroup {
    WorkPtr work;
    at::Tensor in, out;                // (slice,) this rank's slices; (N * slice,) everyone's
    std::vector<std::pair<Bucket *, int64_t>> members;
};

}  // namespace zx
