// unit_store.h — stage 3's units on the engine's side (Note [Stage 3 parameter
// lifetime]): which buckets make up each unit, what each parameter is while its unit is
// gathered (a view into its bucket's flat_param), with offload the device copy of this
// rank's slices in param_dtype that the gathers read (Note [Optimizer offload]), the bytes
// of gathered parameters held, the frozen parameters sharded per unit (Note [Stage 3 frozen
// parameters]) and, with node_size, the node-local parts (Note [Hierarchical partitioning]).
// The gathers and releases themselves are the engine's (units.cpp), over members(u).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "engine/frozen_params.h"   // defines: FrozenParams
#include "engine/gather_meter.h"    // defines: GatherMeter
#include "engine/secondary.h"       // defines: Secondary

namespace zx {

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

    std::vector<at::Tensor> param_views;   // param i's view into its bucket's flat_param
    at::Tensor param_shard;                // offload: this rank's slices in param_dtype, on the device
    GatherMeter meter;                     // bytes of gathered parameters held, and the peak
    FrozenParams frozen;                   // stage 3's frozen parameters, one bucket per unit
    std::unique_ptr<Secondary> secondary;  // node_size (1 <= L < world): the node-local parts, else null

private:
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
