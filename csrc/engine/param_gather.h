// param_gather.h — how parameters are all-gathered from the owned slices, one owner: the
// gather kind, exact or param_quant's int8 (chosen once at construction, Note [Quantized
// parameter gather]; stage 3's UnitStore starts its gathers through it too), and stages 1-2's
// gathers (gatherer.cpp): which buckets a step leaves to gather, launched in place, in flight,
// waited for bucket by bucket (Note [Gathers waited per module]) or all at once, on what the
// engine lends for one call (GatherWork).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "engine/bucket.h"         // defines: Bucket
#include "engine/comm.h"           // defines: Communicator, WorkPtr
#include "engine/groups.h"         // defines: Groups
#include "engine/params.h"         // defines: Params
#include "engine/quant_gather.h"   // defines: QuantGather
#include "engine/shard_view.h"     // defines: ShardView

namespace zx {

// What ParamGather is lent for one stage 1-2 call (Engine::gather_work()); it owns none of it.
struct GatherWork {
    std::vector<Bucket> &buckets;
    Params &params;        // cut parameters are copied out of the buckets once their gathers land
    Communicator &comm;
    ShardView shard;       // the owned slices; the exact master a quantized gather sends
};

class ParamGather {
public:
    // The gather kind, chosen once from the options: param_quant's (world > 1; device: its
    // kernels) or exact (build.cpp).
    void configure(const Layout &layout, Kernels *device);
    bool quantized() const { return quant_ != nullptr; }
    QuantGather *quant() const { return quant_.get(); }

    // One gather: full := every rank's owned slice (owned: this rank's, a view of full); a
    // quantized one travels as int8 records of master() (the exact fp32 slice).
    template <class Master>
    WorkPtr start(Communicator &comm, int64_t subject, const at::Tensor &full, const at::Tensor &owned,
                  Master &&master) {
        return quant_ ? quant_->launch(comm, subject, master(), full) : comm.all_gather(full, owned);
    }

    // --- stages 1-2 (gatherer.cpp) ---
    // After the groups stepped: launch the gathers of the buckets they leave to gather (all the
    // groups' but mixed buckets some of whose groups have not stepped yet: Note [Cut parameters]).
    void gather_stepped(GatherWork w, const Groups &groups);
    // Parameters are needed now: launch the gathers of mixed buckets some of whose groups
    // stepped, with what did step; then wait for every gather unless wait is false.
    void flush(GatherWork w, bool wait);
    // Wait for these buckets' gathers only (all of them when some parameter is cut).
    void wait_buckets(GatherWork w, const std::vector<int64_t> &buckets);
    void wait_params(GatherWork w);   // every gather in flight; cut parameters copied out
    // At teardown: wait for what is in flight (its works hold the buffers), or drop it after a divergence.
    void drain(bool diverged) {
        if (diverged) works_.clear();
        for (auto &w : works_) w.second->wait();
    }

    // The values a gather of master brings (in dtype): what an edit is compared with.
    at::Tensor as_gathered(const at::Tensor &master, at::ScalarType dtype) const {
        return quant_ ? quant_->roundtrip(master, dtype) : master.to(dtype);
    }
    // Edits of gathered parameters (lp_in, in dtype) folded into their fp32 master: only the
    // elements whose gathered value changed take the new value (offload: a host master).
    void absorb(at::Tensor master, const at::Tensor &lp_in, at::ScalarType dtype) const {
        const at::Tensor lp_new = lp_in.device() == master.device() ? lp_in : lp_in.to(master.device());
        const at::Tensor changed = lp_new.ne(as_gathered(master, dtype));
        master.copy_(at::where(changed, lp_new.to(at::kFloat), master));
    }

private:
    void launch(GatherWork &w, int64_t b);   // bucket b's gather, in place, queued
    void wait(Communicator &comm, const std::vector<int64_t> &buckets);
    void wait_all(Communicator &comm);
    // The buckets to gather now, last first (buckets fill in gradient order, so the first
    // layers, which the next forward needs first, come first); a mixed bucket once every
    // group inside has stepped (Note [Cut parameters]).
    static std::vector<int64_t> due(std::vector<Bucket> &buckets, const Groups &groups);
    // The mixed buckets some of whose groups stepped since their last gather; their stepped
    // flags are cleared.
    static std::vector<int64_t> pending(std::vector<Bucket> &buckets);

    std::unique_ptr<QuantGather> quant_;
    bool queued_finish_ = true;
    std::vector<std::pair<int64_t, WorkPtr>> works_;   // stages 1-2: (bucket, its gather in flight)
};

}  // namespace zx
