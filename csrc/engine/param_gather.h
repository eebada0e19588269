// param_gather.h — how parameters are all-gathered from the owned slices, one owner (its
// callers in engine.cpp and units.cpp): the gather kind, exact or param_quant's int8 (chosen
// once at construction, Note [Quantized parameter gather]), the stage 1-2 gathers in
// flight, waited for bucket by bucket (Note [Gathers waited per module]) or all at once,
// and which stage 1-2 buckets a step leaves to gather (gatherer.cpp).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "engine/bucket.h"         // defines: Bucket
#include "engine/comm.h"           // defines: Communicator, WorkPtr
#include "engine/groups.h"         // defines: Groups
#include "engine/quant_gather.h"   // defines: QuantGather

namespace zx {

class ParamGather {
public:
    // quant: param_quant's gather (world > 1), else null. queued_finish: stages 1-2, where the
    // waits below finish the quantized gathers (stage 3 finishes each unit's as it waits).
    void configure(std::unique_ptr<QuantGather> quant, bool queued_finish) {
        quant_ = std::move(quant);
        queued_finish_ = queued_finish;
    }
    bool quantized() const { return quant_ != nullptr; }
    QuantGather *quant() const { return quant_.get(); }

    // One gather: full := every rank's owned slice (owned: this rank's, a view of full); a
    // quantized one travels as int8 records of master() (the exact fp32 slice).
    template <class Master>
    WorkPtr start(Communicator &comm, int64_t subject, const at::Tensor &full, const at::Tensor &owned,
                  Master &&master) {
        return quant_ ? quant_->launch(comm, subject, master(), full) : comm.all_gather(full, owned);
    }
    // Stages 1-2: bucket b's gather, started and queued.
    template <class Master>
    void launch(Communicator &comm, int64_t b, const at::Tensor &full, const at::Tensor &owned, Master &&master) {
        works_.emplace_back(b, start(comm, b, full, owned, master));
    }
    // Stages 1-2: wait for the queued gathers of these buckets only, or for all of them.
    void wait(Communicator &comm, const std::vector<int64_t> &buckets) {
        for (size_t k = 0; k < works_.size();) {
            const int64_t b = works_[k].first;
            if (std::find(buckets.begin(), buckets.end(), b) == buckets.end()) {
                k++;
                continue;
            }
            WorkPtr work = std::move(works_[k].second);
            works_.erase(works_.begin() + (std::ptrdiff_t)k);
            comm.watch(work, "parameter all-gather");
            if (quant_ && queued_finish_) quant_->finish(b);
        }
    }
    void wait_all(Communicator &comm) {
        for (auto &w : works_) comm.watch(w.second, "parameter all-gather");
        works_.clear();
        if (quant_ && queued_finish_) quant_->finish_all();
    }
    // Stages 1-2, after the groups stepped: the buckets to gather now, last first (buckets fill
    // in gradient order, so the first layers, which the next forward needs first, come first);
    // a mixed bucket once every group inside has stepped (Note [Cut parameters]). gatherer.cpp.
    static std::vector<int64_t> due(std::vector<Bucket> &buckets, const Groups &groups);
    // The mixed buckets some of whose groups stepped since their last gather (flush_params
    // gathers them with what did step); their stepped flags are cleared. gatherer.cpp.
    static std::vector<int64_t> pending(std::vector<Bucket> &buckets);
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
    std::unique_ptr<QuantGather> quant_;
    bool queued_finish_ = true;
    std::vector<std::pair<int64_t, WorkPtr>> works_;   // stages 1-2: (bucket, its gather in flight)
};

}  // namespace zx
