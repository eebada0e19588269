// options.h — what the engine is asked for (EngineOptions, set from zeroify's arguments by
// the binding) and the dtypes it computes, gathers and reduces in (Dtypes). Both are fixed
// when the engine is built; Layout holds the engine's copies.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "core/zx_core.h"

namespace zx {

struct EngineOptions {
    int64_t stage = 2;                 // 0 (DDP), 1, 2, 3
    int64_t bucket_bytes = 16 << 20;   // cap per bucket
    int64_t first_bucket_bytes = 1 << 20;
    int64_t align = 16;                // slice alignment, elements
    int64_t param_align_bytes = 16;    // each parameter's start in its bucket (Note [Aligned pieces], core/zx_core.h)
    // What the planner is given: with align = 1 (the default beyond 64 ranks) pieces pack tight,
    // since aligned slices would pad every bucket by world_size x 8 elements.
    int64_t piece_align_bytes() const { return align > 1 ? param_align_bytes : 0; }
    bool alltoall_reduce_scatter = false;  // reduce-scatter = all-to-all + local sum (gloo)
    int64_t grad_ring_buckets = 2;     // stage 2: staging buffers in the ring
    std::string isa = "auto";          // kernel ISA: auto/scalar/avx2/avx512
    bool copy_params = true;           // false: parameters hold no values yet (stage 3,
                                       // materialized unit by unit afterwards)
    std::string param_dtype = "fp32";  // what parameters compute in and are gathered as: fp32/bf16/fp16
    std::string reduce_dtype = "fp32"; // what gradients accumulate and are reduced in
    int64_t grad_quant_bits = 0;       // 0: exact; 8/4: Note [Quantized gradient reduction]
    bool grad_quant_error_feedback = false;
    int64_t quant_block_numel = 256;   // elements per quantization scale
    int64_t param_quant_bits = 0;      // 0: exact; 8: Note [Quantized parameter gather]
    // Per param group, a zx_update_kind: 0 elementwise (element-granular layout),
    // 1 factored (Adafactor), 2 orthogonalized (Muon): those groups' tensors are
    // owned whole by one rank (Note [Tensor-atomic buckets], core/zx_core.h).
    std::vector<int64_t> group_update_kind;
    // Per parameter, optimizer state bytes per element (empty: none given). With
    // tensor-atomic groups, element-granular pieces fill the atomic buckets' padding
    // so that state balances (Note [Filling atomic buckets], core/zx_core.h;
    // Note [Cut parameters] in fill.cpp). Stages 1-2 only.
    std::vector<double> param_state;
    // Note [Unused parameters]: when the ranks agree on which parameters got a gradient:
    // 0 never (a missing gradient is the caller's error), 1 every step, 2 at the first
    // step, and on only if some rank missed some parameter there.
    int64_t agree_unused = 2;
    // Per parameter, its name in the model ('blocks.0.attn.weight'), so that errors
    // name it (Note [Parameter names in messages], layout.cpp); empty: by index.
    std::vector<std::string> param_names;
    // Note [Optimizer offload] (offload.h): the fp32 master, optimizer states and gradient
    // shard in host memory, stepped by the CPU kernels (stages 1-3).
    bool offload = false;
    // Note [Step in backward] (backward_step.cpp): each bucket takes its fused optimizer step
    // as soon as its reduced gradient lands, and keeps no gradient shard.
    bool step_in_backward = false;
    // Note [bf16 optimizer states] (stepper.cpp): "bf16" keeps the fused Adam/AdamW's
    // exp_avg and exp_avg_sq in bfloat16 with stochastic rounding (2 bytes per element
    // each instead of 4); "fp32" (default) keeps them exact.
    std::string state_dtype = "fp32";
    // Stage 3: buckets this small (elements, all ranks' slices together) have their
    // gradients reduced together, one collective for several (Note [Coalesced gradient
    // reductions], reducer.cpp); 0: each alone.
    int64_t coalesce_numel = 0;
};

// param_dtype and reduce_dtype (Note [Mixed precision] in csrc/engine/layout.cpp): what parameters
// compute in and are gathered as, what gradients accumulate and are reduced in.
struct Dtypes {
    at::ScalarType param = at::kFloat, reduce = at::kFloat;
    zx_dtype param_zx = ZX_F32, reduce_zx = ZX_F32;   // the same, for the C kernels
    bool low() const { return param != at::kFloat; }   // parameters are not fp32
};

}  // namespace zx
