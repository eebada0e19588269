// gatherer.cpp — parameters every rank computes with, stages 0-2: the all-gather of the
// owned slices after a step (launched, flushed, waited per bucket), edits folded back into
// the master, a checkpoint's masters published. Stage 3's units: units.cpp.
#include "engine/engine.h"

#include <algorithm>

namespace zx {

void Engine::publish_params() {
    wait_params();
    cast_masters();
    if (layout_.opts.stage == 3) {
        // Gathered units hold stale values: release them; the next gather reads the shards.
        if (units_.secondary) units_.secondary->drop_all();
        for (auto &bk : buckets_) release_bucket(bk);
        release_all_frozen();
        return;
    }
    all_gather_params();
    wait_params();
}

void Engine::absorb_param_edits() {
    TORCH_CHECK(layout_.opts.stage <= 2,
                "zero_ext: internal: absorb_param_edits is for stages 0-2 (stage 3: commit_unit)");
    wait_params();
    // Note [Cut parameters]: their edits live in their own storage
    if (params_.any_cut()) params_.copy_cut(buckets_, false);
    if (!layout_.dtypes.low() && !gather_.quantized() && !off_) return;   // the owned slice is the master
    // Note [Split master in the engine]: without a joined master the edits already are its top halves
    if (shard_.split && !shard_.master.defined()) return;
    for (auto &bk : buckets_)
        gather_.absorb(master_slice(bk), view().owned(bk.flat_param, bk), layout_.dtypes.param);
}

void Engine::all_gather_params(const std::vector<int64_t> &groups) {
    const Groups cover(groups);
    if (layout_.partitions == 1 || layout_.opts.stage == 3) {   // stage 3 gathers per unit, on demand
        if (params_.any_cut()) params_.copy_cut(buckets_, true);
        return;
    }
    wait_params();
    // Last bucket first: buckets fill in gradient order (the model's last layers first),
    // so the first layers' parameters, which the next forward needs first, are gathered first.
    for (int64_t b = (int64_t)buckets_.size() - 1; b >= 0; b--) {
        Bucket &bk = buckets_[b];
        if (bk.mixed) {
            // Note [Cut parameters]: gathered once every group inside has stepped.
            bool all = true;
            for (size_t k = 0; k < bk.groups.size(); k++) {
                if (cover.has(bk.groups[k])) bk.stepped[k] = 1;
                all = all && bk.stepped[k];
            }
            if (!all) continue;
            std::fill(bk.stepped.begin(), bk.stepped.end(), 0);
        } else if (!cover.has(bk.group)) {
            continue;
        }
        launch_param_gather(b);
    }
}

void Engine::launch_param_gather(int64_t b) {
    Bucket &bk = buckets_[b];
    at::Tensor in = view().owned(bk.flat_param, bk);   // in place: the owned slice of the output
    comm_.seq.subject(b, -1);
    gather_.launch(comm_, b, bk.flat_param, in, [&] { return master_slice(bk); });
    params_.gathered();
}

void Engine::flush_params(bool wait) {
    // Note [Cut parameters]: a mixed bucket some of whose optimizers did not step this
    // iteration is gathered now, with what did step (the same buckets on every rank).
    std::vector<int64_t> pending;
    for (int64_t b = 0; b < (int64_t)buckets_.size(); b++) {
        std::vector<char> &st = buckets_[b].stepped;
        if (std::find(st.begin(), st.end(), 1) == st.end()) continue;
        std::fill(st.begin(), st.end(), 0);
        pending.push_back(b);
    }
    if (!pending.empty()) {
        wait_params();
        for (int64_t b : pending) launch_param_gather(b);
    }
    if (wait) wait_params();
}

void Engine::wait_param_buckets(const std::vector<int64_t> &buckets) {
    if (params_.any_cut()) {   // a cut parameter is copied out once all of its buckets have arrived
        wait_params();
        return;
    }
    gather_.wait(comm_, buckets);
}

void Engine::wait_params() {
    gather_.wait_all(comm_);
    if (params_.stale()) params_.copy_cut(buckets_, true);
}

void Engine::broadcast_tensors(std::vector<at::Tensor> tensors, int64_t src) {
    for (auto &t : tensors) comm_.broadcast(t, src);
}

}  // namespace zx
