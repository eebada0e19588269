// fragment_view.h — FragmentView: one piece of a parameter in this rank's shard, as Python
// asks for it (Stepper::fragment_views; the stage-3 frozen ones: FrozenParams::fragment_views).
//
// Note [Fragment views]
//   Python code that reads or writes this rank's share of a parameter (checkpoint
//   save and load, model.load_state_dict, edits folded into the master, the generic
//   step's unstepped elements) asks the engine where it lies, instead of rebuilding
//   the shard layout from param_shards() offsets and fragments() itself: each view
//   names the parameter, where the piece starts in it, its bucket (an index into
//   param_shards(), so a caller can find the generic optimizer's tensor) and where it
//   starts in that bucket's slice, and carries a view of the master over exactly the
//   piece. Only the buckets of the groups asked for are listed (Note [Groups as an
//   argument]), as param_shards() lists them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace zx {

struct FragmentView {
    int64_t param;                     // engine parameter index (frozen: frozen index)
    int64_t param_offset;              // first element inside the flattened parameter
    int64_t bucket;                    // its bucket: index into param_shards() (frozen: -1)
    int64_t slice_offset;              // first element inside that bucket's shard slice (frozen: the frozen shard)
    int64_t numel;
    at::Tensor master;                 // (numel,) view: the fp32 master (frozen: the param_dtype shard)
};

}  // namespace zx
