// secondary.h — stage 3 hierarchical partitioning (node_size): a unit's backward
// gather stays inside the node.
//
// Note [Hierarchical partitioning]
//   The process group's N ranks form N/L nodes of L consecutive ranks (torchrun
//   numbers each node's ranks contiguously); node g is the group of ranks
//   [g*L, (g+1)*L), created in Python as a second process group. When Python
//   releases a unit after its forward and a backward will follow
//   (release_unit(u, keep=true)), each rank first copies its node rank l's part
//   of every gathered bucket of the unit,
//       part = flat_param[l*P, (l+1)*P),   P = padded_numel / L
//   (padded_numel = N * slice_numel, so L divides it) into a secondary buffer.
//   The next gather of that bucket is an all-gather of the L parts inside the
//   node group straight into flat_param: the very bytes the forward gather
//   produced (with param_quant, the dequantized values), so the result is
//   bit-identical to a world gather and never crosses a node. The part is freed
//   when that gather completes; a later release with keep copies it again (a
//   recomputed unit under activation checkpointing, a second forward).
//   Frozen buckets (Note [Stage 3 frozen parameters]) are treated the same way.
//   A gather from a secondary is never coalesced (Note [Coalesced unit gathers]);
//   forward gathers still are.
//   Staleness: a part is only valid while the master shards are unchanged, so
//   every part is dropped by begin_step (any optimizer step), publish_params
//   (checkpoint load), commit_unit and open_unit_fp32 (edits, initialization),
//   by finalize_backward (end of the pass: nothing is needed any more) and by a
//   release without keep. Memory: buffer_bytes.secondary (now) and
//   peak_secondary: at most (unit's padded bytes) / L per unit between its
//   forward and its backward, i.e. the full model's parameters / L at peak.
//
// Note [Per-group byte counters]
//   stats()["comm_groups"] splits every counted byte (logical `bytes` and
//   `wire_bytes`) into "intra" (exchanged with ranks of the own node) and
//   "inter" (exchanged with ranks of other nodes), per collective kind:
//     - a collective on the node group is all intra;
//     - a collective on the whole group of N ranks counting B bytes (its full
//       buffer: the gathered bucket, the reduce-scattered bucket, the reduced
//       tensor) splits by whose slices they are: (N-L)/N of B belongs to ranks of
//       other nodes and must cross the node boundary (inter), L/N is the own
//       node's, the own slice included (intra). So intra + inter = all bytes.
//   For a ring all-gather this is the share every rank must receive from off
//   its node whatever the algorithm; the ratio between two runs (exact vs
//   quantized and hierarchical) is what the counters are for.
#pragma once

#include <ATen/ATen.h>

#include <map>

#include "engine/comm.h"    // defines: Communicator, CommCounter, WorkPtr
#include "engine/stats.h"   // defines: CommGroupStats

namespace zx {

class Secondary {
public:
    // node_pg: this rank's node group (L ranks); world: ranks of the whole group.
    Secondary(ProcessGroupPtr node_pg, int64_t world);

    int64_t node_size() const { return node_comm_.world(); }
    // Keep this rank's part of subject s's gathered bucket (flat: padded_numel elements).
    void keep(int64_t s, const at::Tensor &flat);
    bool has(int64_t s) const { return node_parts_.count(s) > 0; }
    // All-gather the node's parts of s into flat (asynchronous); the part moves
    // to in-flight until finish(s).
    WorkPtr launch(int64_t s, at::Tensor flat);
    bool in_flight(int64_t s) const { return inflight_.count(s) > 0; }
    void finish(int64_t s);            // after the wait: free s's part
    void drop(int64_t s);              // forget s's part (not one in flight)
    void drop_all();

    int64_t bytes() const { return bytes_; }
    int64_t peak_bytes() const { return peak_bytes_; }
    // stats()["comm_groups"]: world_comm's counters split into intra and inter, and the
    // node group's (Note [Per-group byte counters]).
    CommGroupStats group_stats(const Communicator &world_comm) const;
    const Communicator &comm() const { return node_comm_; }
    Communicator &comm() { return node_comm_; }

private:
    Communicator node_comm_;                        // the node group; its own counters
    int64_t world_ = 1;
    std::map<int64_t, at::Tensor> node_parts_;      // subject -> (padded_numel / L,) param_dtype
    std::map<int64_t, at::Tensor> inflight_;   // parts a node all-gather is reading
    int64_t bytes_ = 0, peak_bytes_ = 0;
};

}  // namespace zx
