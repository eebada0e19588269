// unit_store.h — stage 3's units on the engine's side (Note [Stage 3 parameter
// lifetime]): which buckets make up each unit, what each parameter is while its unit is
// gathered (a view into its bucket's flat_param), with offload the device copy of this
// rank's slices in param_dtype that the gathers read (Note [Optimizer offload]), the bytes
// of gathered parameters held, the frozen parameters sharded per unit (Note [Stage 3 frozen
// parameters]) and, with node_size, the node-local parts (Note [Hierarchical partitioning]).
// The gathers, releases, commits and openings run here too (units.cpp; the frozen side:
// frozen.cpp), on what the engine lends for one call (UnitWork): the one place a unit's
// buckets are gathered and released.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/bucket.h"          // defines: Bucket, GatherGroup
#include "engine/comm.h"            // defines: Communicator
#include "engine/frozen_params.h"   // defines: FrozenParams
#include "engine/gather_meter.h"    // defines: GatherMeter
#include "engine/kernels.h"         // defines: KernelTables
#include "engine/param_gather.h"    // defines: ParamGather
#include "engine/params.h"          // defines: Params
#include "engine/secondary.h"       // defines: Secondary
#include "engine/stepper.h"         // defines: Stepper, ShardView

namespace zx {

// What UnitStore is lent for one call (Engine::unit_work()); it owns none of it.
struct UnitWork {
    std::vector<Bucket> &buckets;   // the trainable buckets (the frozen ones are the store's)
    Params &params;
    Communicator &comm;
    KernelTables &kernels;
    ParamGather &gather;            // the gather kind: param_quant's or exact
    Stepper step;                   // its ShardView: where the slices lie; offload: upload()

    ShardView &shard() { return step.shard; }
    const Layout &layout() const { return step.shard.layout; }
};

class UnitStore {
public:
    int64_t count() const { return (int64_t)buckets_.size(); }
    void ensure(int64_t u) {   // units 0..u exist (some may have frozen parameters only)
        if (count() <= u) buckets_.resize(u + 1);
    }
    void add(int64_t u, int64_t bucket) {
        ensure(u);
        buckets_[u].push_back(bucket);
    }
    const std::vector<int64_t> &buckets(int64_t u) const {
        TORCH_CHECK(u >= 0 && u < count(), "zero_ext: internal: no unit ", u);
        return buckets_[u];
    }
    // Everything a gather of unit u brings: its trainable buckets (of `all`, the engine's),
    // then its frozen one.
    std::vector<Bucket *> members(int64_t u, std::vector<Bucket> &all) { return members_of(*this, u, all); }
    std::vector<const Bucket *> members(int64_t u, const std::vector<Bucket> &all) const {
        return members_of(*this, u, all);
    }

    // --- units (units.cpp; Note [Stage 3 parameter lifetime]) ---
    // Make unit u's parameters whole: launch its all-gather if it is neither gathered nor in
    // flight, and with wait block until it is done. Returns true when the gather had already
    // been launched (prefetched).
    bool gather_unit(UnitWork w, int64_t u, bool wait);
    // Launch the gathers of the given units' buckets that are neither gathered nor in flight,
    // as few collectives as possible (Note [Coalesced unit gathers]).
    void gather_units(UnitWork w, const std::vector<int64_t> &units);
    // Free the unit's full parameters (storage resized to 0). keep: a backward follows, so with
    // node_size each rank first keeps its node part (Note [Hierarchical partitioning]).
    void release_unit(UnitWork w, int64_t u, bool keep);
    void release_bucket(UnitWork w, Bucket &bk);   // the one place full parameters are freed
    // Note [Hierarchical partitioning] (node_size): node_pg, this rank's node group, keeps parts
    // for backward gathers (secondary); once, right after construction.
    void enable_hierarchy(UnitWork w, ProcessGroupPtr node_pg);
    void release_pass(UnitWork w);   // every bucket, the frozen ones, node parts (after a backward, a load)
    // After the gathered unit u was edited on rank src (group rank): broadcast its buckets from
    // src and write every rank's owned slice back into its shard. With a low param_dtype an edit
    // only replaces the master elements whose low-precision value changed, so untouched ones
    // keep their fp32 bits.
    void commit_unit(UnitWork w, int64_t u, int64_t src);
    // Initialization: point unit u's parameters at fp32 buffers holding the unit's current fp32
    // values (full precision even when param_dtype is low; the masters are all-gathered);
    // commit_unit then shards them.
    void open_unit_fp32(UnitWork w, int64_t u);
    // Note [Reading alone]: this rank's part of unit u's gather (each member bucket's slice in
    // the dtype it travels), in tensors of its own, for the shard server to send.
    std::vector<at::Tensor> unit_part(UnitWork w, int64_t u);
    // Unit u made whole from every rank's part (parts[r][m]: rank r's part of member bucket m),
    // without a collective: the gather of a rank that reads alone.
    void install_unit(UnitWork w, int64_t u, const std::vector<std::vector<at::Tensor>> &parts);
    bool unit_gathered(const std::vector<Bucket> &all, int64_t u) const;
    bool unit_requested(const std::vector<Bucket> &all, int64_t u) const;   // every bucket gathered or in flight
    int64_t unit_numel(const std::vector<Bucket> &all, int64_t u) const;    // elements a gather brings (padded)

    // --- frozen parameters (frozen.cpp; Note [Stage 3 frozen parameters]) ---
    // Shard these requires_grad=False parameters, one bucket per unit, gathered and released
    // with the unit. names: as EngineOptions::param_names, for the frozen ones (empty: by index).
    void add_frozen(UnitWork w, std::vector<at::Tensor> params, std::vector<int64_t> units,
                    std::vector<std::string> names);
    void release_frozen(UnitWork w, int64_t u);   // after the unit's backward: its frozen weights
    void release_all_frozen(UnitWork w);

    std::vector<at::Tensor> param_views;   // param i's view into its bucket's flat_param
    at::Tensor param_shard;                // offload: this rank's slices in param_dtype, on the device
    GatherMeter meter;                     // bytes of gathered parameters held, and the peak
    FrozenParams frozen;                   // stage 3's frozen parameters, one bucket per unit
    std::unique_ptr<Secondary> secondary;  // node_size (1 <= L < world): the node-local parts, else null

private:
    void wait_gather(UnitWork &w, Bucket &bk);
    void finish_group(UnitWork &w, const std::shared_ptr<GatherGroup> &g);   // a coalesced gather's rows out
    void launch_gather(UnitWork &w, Bucket &bk);   // storage back; one all-gather
    void mark_gathered(UnitWork &w, Bucket &bk);   // parameters point at the full bucket again
    // bk's slice in param_dtype: its shard, or (low param_dtype) its master cast into dst
    at::Tensor gather_source(UnitWork &w, Bucket &bk, at::Tensor dst);
    int64_t subject_of(UnitWork &w, const Bucket &bk) const;   // its index for the sequence check
    void commit_frozen(UnitWork &w, int64_t u, int64_t src);
    void open_frozen_fp32(UnitWork &w, int64_t u);

    template <class Self, class Buckets>   // members(), const or not
    static auto members_of(Self &self, int64_t u, Buckets &all) -> std::vector<decltype(&all[0])> {
        std::vector<decltype(&all[0])> out;
        for (int64_t b : self.buckets(u)) out.push_back(&all[(size_t)b]);
        if (auto *f = self.frozen.of_unit(u)) out.push_back(f);
        return out;
    }
    std::vector<std::vector<int64_t>> buckets_;   // unit -> its buckets
};

}  // namespace zx
