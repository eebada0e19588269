// gatherer.cpp — ParamGather (param_gather.h), the parameters every rank computes with in
// stages 1-2: which buckets are all-gathered after a step and which are still owed one, their
// gathers launched in place, waited for, and cut parameters copied out. The engine folds
// edits back into the master and publishes a checkpoint's masters (engine.cpp). Stage 3's
// units: units.cpp.
#include "engine/param_gather.h"

#include <algorithm>

namespace zx {

std::vector<int64_t> ParamGather::due(std::vector<Bucket> &buckets, const Groups &groups) {
    std::vector<int64_t> out;
    for (int64_t b = (int64_t)buckets.size() - 1; b >= 0; b--) {
        Bucket &bk = buckets[b];
        if (bk.mixed) {
            // Note [Cut parameters]: gathered once every group inside has stepped.
            bool all = true;
            for (size_t k = 0; k < bk.groups.size(); k++) {
                if (groups.has(bk.groups[k])) bk.stepped[k] = 1;
                all = all && bk.stepped[k];
            }
            if (!all) continue;
            std::fill(bk.stepped.begin(), bk.stepped.end(), 0);
        } else if (!groups.has(bk.group)) {
            continue;
        }
        out.push_back(b);
    }
    return out;
}

std::vector<int64_t> ParamGather::pending(std::vector<Bucket> &buckets) {
    std::vector<int64_t> out;
    for (int64_t b = 0; b < (int64_t)buckets.size(); b++) {
        std::vector<char> &st = buckets[b].stepped;
        if (std::find(st.begin(), st.end(), 1) == st.end()) continue;
        std::fill(st.begin(), st.end(), 0);
        out.push_back(b);
    }
    return out;
}

void ParamGather::gather_stepped(GatherWork w, const Groups &groups) {
    const Layout &layout = w.shard.layout;
    if (layout.partitions == 1 || layout.opts.stage == 3) {   // stage 3 gathers per unit, on demand
        if (w.params.any_cut()) w.params.copy_cut(w.buckets, true);
        return;
    }
    wait_params(w);
    for (int64_t b : due(w.buckets, groups)) launch(w, b);
}

void ParamGather::launch(GatherWork &w, int64_t b) {
    Bucket &bk = w.buckets[b];
    w.comm.seq.subject(b, -1);
    // In place: the owned slice of the output. A quantized gather sends the exact master,
    // which is never split (master_remainder excludes param_quant).
    works_.emplace_back(b, start(w.comm, b, bk.flat_param, w.shard.owned(bk.flat_param, bk),
                                 [&] { return w.shard.master(bk); }));
    w.params.gathered();
}

void ParamGather::flush(GatherWork w, bool wait) {
    // Note [Cut parameters]: a mixed bucket some of whose optimizers did not step this
    // iteration is gathered now, with what did step (the same buckets on every rank).
    const std::vector<int64_t> owed = pending(w.buckets);
    if (!owed.empty()) {
        wait_params(w);
        for (int64_t b : owed) launch(w, b);
    }
    if (wait) wait_params(w);
}

void ParamGather::wait_buckets(GatherWork w, const std::vector<int64_t> &buckets) {
    if (w.params.any_cut()) {   // a cut parameter is copied out once all of its buckets have arrived
        wait_params(w);
        return;
    }
    wait(w.comm, buckets);
}

void ParamGather::wait_params(GatherWork w) {
    wait_all(w.comm);
    if (w.params.stale()) w.params.copy_cut(w.buckets, true);
}

void ParamGather::wait(Communicator &comm, const std::vector<int64_t> &buckets) {
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

void ParamGather::wait_all(Communicator &comm) {
    for (auto &w : works_) comm.watch(w.second, "parameter all-gather");
    works_.clear();
    if (quant_ && queued_finish_) quant_->finish_all();
}

}  // namespace zx
