// layout.h — what is decided once when the engine is built (Layout::make, layout.cpp) and never changed
// after: the options it was given, the parameters' device and dtypes, the C plan
// (core/zx_plan.c: buckets, slices, fragments, state), this rank's place in the world, and
// each parameter's group, shape and bucket. Plain data: no tensors, no communicator (the
// plan itself is built and tested without a process group: csrc/core/tests/test_plan.c).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/zx_core.h"
#include "engine/options.h"   // defines: EngineOptions, Dtypes

namespace zx {

// The C plan, freed with the last Layout holding it (an Engine whose constructor throws leaks
// none); it reads as the zx_plan * the C core's calls take.
struct Plan {
    std::shared_ptr<zx_plan> owner;
    operator zx_plan *() const { return owner.get(); }
};

struct Layout {
    // The layout of parameters of these shapes (in the engine's order) and param groups (stage 3:
    // units), for this rank of world: the dtypes parsed and the plan made.
    static Layout make(const EngineOptions &opts, at::Device dev, std::vector<std::vector<int64_t>> shapes,
                       const std::vector<int64_t> &groups, const std::vector<int64_t> &units, int64_t rank,
                       int64_t world);

    EngineOptions opts;                         // as given (stage, bucket sizes, dtypes by name, ...)
    at::Device dev = at::kCPU;                  // the parameters' device: every buffer lives there
    Dtypes dtypes;                              // param_dtype and reduce_dtype (Note [Mixed precision])
    Plan plan;                                  // the engine's plan
    int64_t rank = 0, world = 1;                // this rank of world
    int64_t partitions = 1;                     // ranks a bucket is sharded over: world, or 1 (stage 0)
    int64_t shard_numel = 0;                    // elements of this rank's shard (its slices together)
    int64_t max_padded = 0;                     // elements of the largest bucket, padded: a ring slot's size
    std::vector<int64_t> group_of;              // each parameter's param group
    std::vector<int64_t> bucket_of, offset_of;  // each parameter's bucket and offset in it (its first piece)
    std::vector<std::vector<int64_t>> shapes;   // each parameter's logical shape

    // Where rank r's shard holds pieces of parameters: (param index, offset in the flattened
    // parameter, offset in the flat shard, numel).
    std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> fragments(int64_t r) const;
    // The same bucket by bucket, the offset in the bucket's slice instead of the flat shard.
    std::vector<std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>> bucket_fragments(int64_t r) const;
    std::string describe() const;   // the plan, printable
    std::vector<int64_t> owners() const;   // each parameter's owner rank (-1: element-granular)
    // A buffer on the parameters' device: every buffer of the engine lives there (offload's host ones aside).
    at::TensorOptions on_device(at::ScalarType dt) const { return at::TensorOptions().dtype(dt).device(dev); }
    int64_t part() const { return partitions > 1 ? rank : 0; }   // this rank's partition (stage 0: the one)
    double grad_divisor() const { return opts.stage == 0 ? 1.0 : (double)world; }   // what shard gradients sum over

    // "parameter 'blocks.0.attn.weight'" (or "parameter 12" without names), for messages
    // (Note [Parameter names in messages], layout.cpp).
    std::string pname(int64_t i) const { return pname_in(opts.param_names, i); }
    static std::string pname_in(const std::vector<std::string> &names, int64_t i) {   // before a Layout exists
        if (i >= 0 && i < (int64_t)names.size()) return "parameter '" + names[i] + "'";
        return "parameter " + std::to_string(i);
    }
};

}  // namespace zx
