// stats.h — what the engine reports about itself (Engine::stats()), as plain data.
//
// Note [Engine stats]
//   The engine counts bytes, copies and collectives into these structs and knows
//   nothing of Python; the binding (csrc/stats_binding.cpp) turns them into the
//   nested dicts that engine.stats() returns and zero_ext reads (optimizer.stats(),
//   estimate_memory's comparisons, the tests). Each struct is one dict: its fields
//   are the dict's keys, in the dict's order, with the same value types (int64_t: int,
//   double: float, std::string: str, std::vector: list); an empty std::optional is a
//   key left out (comm_groups) or an empty dict (offload). A field added here is a
//   key added there.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace zx {

struct Bucket;   // bucket.h
struct Layout;   // layout.h
// the engine's owners, which EngineStats::of reads (stats.cpp)
class Communicator;
class GradReducer;
struct KernelTables;
class Offload;
class ParamGather;
class Params;
struct ShardBuffers;
class UnitStore;

// Cumulative counters of one collective kind. numel/bytes are the size of the
// collective's full (unsharded) buffer: a reduce-scatter of a bucket counts the
// bucket, an all-gather counts the gathered bucket, an all-reduce its tensor.
struct CommCounter {
    int64_t calls = 0;
    int64_t numel = 0;
    int64_t bytes = 0;
    int64_t wire_bytes = 0;   // what the collectives carried: `bytes`, or codes + scales (grad_quant, param_quant)
    // wire < 0: the collective carried its logical bytes
    void add(int64_t n, int64_t elem_bytes, int64_t wire = -1) {
        calls++;
        numel += n;
        bytes += n * elem_bytes;
        wire_bytes += wire < 0 ? n * elem_bytes : wire;
    }
};

// stats()["comm"]: one counter per collective kind of a Communicator (engine/comm.h).
struct CommStats {
    CommCounter all_reduce, reduce_scatter, all_gather, broadcast;
    CommCounter used_flags;   // Note [Unused parameters]: one byte per parameter per step
};
// Every kind, in the dict's order.
inline constexpr CommCounter CommStats::*kCommKinds[] = {&CommStats::all_reduce, &CommStats::reduce_scatter,
                                                        &CommStats::all_gather, &CommStats::broadcast,
                                                        &CommStats::used_flags};

// stats()["comm_groups"] with node_size (Note [Per-group byte counters], engine/secondary.h):
// {"intra": {kind: counters, ..., "node_all_gather": counters}, "inter": {kind: counters},
//  "node_size": L}.
struct CommGroupStats {
    CommStats intra, inter;
    CommCounter node_all_gather;   // intra only: the node group's backward gathers
    int64_t node_size = 0;
};

// stats()["model_state_bytes"]: this rank's persistent model state.
struct ModelStateBytes {
    int64_t parameters = 0;
    int64_t gradients = 0;
    int64_t master_weights = 0;   // 0 with fp32 parameters (the owned slice is the master) unless param_quant
    int64_t optimizer_states = 0;
    int64_t total = 0;
};

// stats()["held_bytes"]: what of the step's gradients and ring this rank holds now: both go at
// zero_grad(set_to_none=True) and come back in the next backward (Note [Gradient shard lifetime];
// stages 0-1's buckets: Note [Bucket gradient lifetime]).
struct HeldBytes {
    int64_t gradients = 0;                // model_state_bytes' gradients, as held now
    int64_t grad_ring = 0;                // buffer_bytes' grad_ring, as held now
};

// stats()["buffer_bytes"]: working buffers, now and at peak.
struct BufferBytes {
    int64_t grad_ring = 0;
    int64_t grad_landing = 0;             // Note [Step in backward]: all-to-all sums
    int64_t ring_slots = 0;
    int64_t gathered_params = 0;          // stage 3: full units held now
    int64_t peak_gathered_params = 0;     // stage 3: most held at once
    int64_t quant_buffers = 0;            // grad_quant: codes/scales send + receive
    int64_t quant_residual = 0;           // grad_quant_error_feedback: fp32 residuals
    int64_t quant_gather_buffers = 0;     // param_quant: records of the gathers in flight
    int64_t peak_quant_gather_buffers = 0;
    int64_t kernel_scratch = 0;           // e.g. CUDA: fp32 copy of a low-precision gradient slice
    int64_t split_master_scratch = 0;     // Note [Split master in the engine]: one fp32 chunk
    int64_t secondary = 0;                // node_size: this rank's parts kept for backward gathers
                                          // (Note [Hierarchical partitioning])
    int64_t peak_secondary = 0;
    int64_t total = 0;
};

// stats()["atomic"] (atomic.cpp): tensor-atomic buckets and the balance of their owners.
struct AtomicStats {
    int64_t tensors = 0;                  // whole tensors owned by one rank
    int64_t buckets = 0;
    int64_t numel = 0;                    // elements of those tensors
    int64_t padding = 0;                  // padding of the atomic buckets, elements
    std::vector<double> cost_per_rank;    // update cost of each rank's whole tensors
    std::vector<int64_t> numel_per_rank;
    double cost_balance = 1.0;            // max / mean (1.0 = perfect balance)
    double numel_balance = 1.0;
    int64_t filled_numel = 0;             // pieces of element-granular parameters in the padding
    int64_t cut_params = 0;               // Note [Cut parameters] (fill.cpp)
    std::vector<double> state_bytes_per_rank;   // planned: whole tensors' + element-granular state
    double state_balance = 1.0;

    // From the plan, its buckets and the parameters (atomic.cpp).
    static AtomicStats of(const Layout &layout, const std::vector<Bucket> &buckets, const Params &params);
};

// stats()["offload"] with offload="cpu" (Note [Optimizer offload], engine/offload.h): host bytes and copies.
struct OffloadStats {
    std::string device = "cpu";
    int64_t master_weights = 0;
    int64_t optimizer_states = 0;
    int64_t gradients = 0;
    int64_t pinned_ring = 0;              // pinned only on a device with streams
    int64_t total = 0;
    int64_t down_copies = 0;
    int64_t down_bytes = 0;
    int64_t up_copies = 0;
    int64_t up_bytes = 0;
};

// stats(): the whole report.
struct EngineStats {
    int64_t stage = 0;
    int64_t world_size = 1;
    int64_t rank = 0;
    std::string isa;
    std::string device;
    std::string kernels;
    int64_t num_params = 0;
    int64_t padded_numel = 0;
    int64_t alignment_padding_numel = 0;  // of padded_numel - num_params: between parameters (Note [Aligned pieces])
    int64_t shard_numel = 0;
    int64_t num_buckets = 0;
    std::string param_dtype;
    std::string reduce_dtype;
    std::string reduce_scatter_impl;      // native, alltoall, alltoall-int8, alltoall-int4
    std::string param_gather_impl;        // allgather, allgather-int8
    ModelStateBytes model_state_bytes;
    BufferBytes buffer_bytes;
    HeldBytes held_bytes;
    CommStats comm;
    // Seconds the host was blocked waiting for collectives (exposed communication on the
    // CPU; on CUDA the waits are stream waits and this stays near 0).
    double comm_wait_s = 0.0;
    double comm_delay_ms = 0.0;
    std::optional<CommGroupStats> comm_groups;   // node_size only (the key is absent without)
    int64_t reductions = 0;
    int64_t num_units = 0;
    int64_t frozen_shard_bytes = 0;       // stage 3: this rank's slices of frozen parameters
    AtomicStats atomic;
    std::optional<OffloadStats> offload;  // offload="cpu" only (an empty dict without)

    // What the engine's owners report (stats.cpp); Engine::stats() lends them.
    struct Sources {
        const Layout &layout;
        const std::vector<Bucket> &buckets;
        const Params &params;
        const ShardBuffers &shard;
        const Offload *offload;   // offload="cpu", else null
        const GradReducer &reducer;
        const ParamGather &gather;
        const UnitStore &units;
        const KernelTables &kernels;
        const Communicator &comm;
    };
    static EngineStats of(const Sources &s);
};

}  // namespace zx
