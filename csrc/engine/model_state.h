// model_state.h — estimate_memory's model state (Note [What estimate_memory counts] in
// zero_ext/estimate.py) from the bucket plan, and stage="auto"'s world-size search. No torch:
// tested row by row in csrc/core/tests/test_model_state.cpp (make -C csrc/core test).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace zx {

// What the estimate knows besides the plan. Bytes are per element.
struct ModelStateInputs {
    int64_t stage = 0, world = 1, param_bytes = 4, reduce_bytes = 4;
    int64_t state_bytes = 4;                 // per optimizer state element: 4, or 2 with state_dtype bf16
    std::vector<int64_t> states_per_group;   // per-element state tensors of each param group (>= 1 group)
    bool fused = false;                      // one optimizer stepped by the C kernels over the whole shard
    bool adam = false;                       // Adam/AdamW: one pass steps the split master
    bool param_quant = false, grad_quant = false, offload = false;
    bool alltoall = false;                   // the reduce-scatter by all-to-all
    bool master_remainder = false;           // ZeroConfig.master_remainder_applies
    bool on_gpu = false, step_in_backward = false;
};

// Device bytes of the model state, what offload keeps on the host, and two buffers.
struct ModelState {
    int64_t parameters = 0, gradients = 0, master_weights = 0, optimizer_states = 0;
    bool offloaded = false;                  // offload="cpu": the host_* fields and pinned_ring hold
    int64_t host_master = 0, host_states = 0, host_gradients = 0, pinned_ring = 0;
    int64_t split_scratch = 0;               // Note [Split master in the engine]: one fp32 chunk on a GPU
    int64_t grad_landing = 0;                // Note [Step in backward]: the all-to-all's summed slice
};

// bucket_group, bucket_padded, bucket_shard: per bucket, from the planner. Throws
// std::invalid_argument on inconsistent numbers.
ModelState model_state_bytes(const std::vector<int64_t> &bucket_group, const std::vector<int64_t> &bucket_padded,
                             const std::vector<int64_t> &bucket_shard, const ModelStateInputs &in);

// The smallest n in (world, max_world] with fits(n), or 0 when none: doubling from world,
// then bisecting, so fits must hold from some n on (more ranks, less per rank). fits(world)
// is taken as false and not asked. Throws std::invalid_argument unless 1 <= world.
int64_t smallest_world(int64_t world, int64_t max_world, const std::function<bool(int64_t)> &fits);

}  // namespace zx
