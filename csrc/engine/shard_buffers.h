// shard_buffers.h — this rank's tensors over its shard (Note [Mixed precision], layout.cpp):
// the gradient sums, the fp32 master (or the remainders that make it with the bf16
// parameters), and the fused optimizer's states. Each is made when first needed; stats()
// counts their bytes. With offload they live in host memory (Note [Optimizer offload]).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <set>

#include "engine/master_split.h"       // defines: MasterSplit
#include "engine/optimizer_states.h"   // defines: OptimizerStates

namespace zx {

struct ShardBuffers {
    at::Tensor grad;                       // stages 2-3: (shard_numel,) reduce_dtype sums, made at the first backward
    bool grad_lazy = false;                // its slices are zeroed when first read (Note [Gradient shard lifetime])
    std::set<int64_t> grad_zeroed;         // ... those read since it was made, by shard offset
    at::Tensor master;                     // stage 3, low precision, param_quant, offload: (shard_numel,) fp32
    std::unique_ptr<MasterSplit> split;    // master_remainder: the master as remainders (master joined on demand)
    OptimizerStates states;                // the fused optimizer's states, over the state windows
    at::Tensor land;                       // step_in_backward, all-to-all: where a bucket's slices are summed
};

// zero_grad(set_to_none=True): the gradient shard's bytes go, its views stay (Note [Gradient
// shard lifetime], shard_view.cpp); ShardView::grad gives them back, zeroed.
void release_grad_shard(ShardBuffers &buffers);
bool grad_shard_held(const ShardBuffers &buffers);   // made, and not released

}  // namespace zx
