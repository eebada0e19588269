// gatherer.cpp — parameters every rank computes with: the stage 0-2
// all-gather of the owned slices after a step, and stage-3 units gathered on
// demand, released after use, edited and committed back into the shards.
#include "engine/engine.h"

#include "kernels_binding.h"   // defines: zx_check, parse_isa

namespace zx {

// Note [Stage 3 parameter lifetime]
//   Only master_shard_ (this rank's slices; and lp_shard_, their low-precision
//   copy, with a low param_dtype) persists. Each bucket's flat_param
//   keeps its tensor and storage object, but the storage is resized to 0 bytes
//   when released and back to full size when gathered, as FSDP2 does: the
//   parameters stay views of it and autograd's saved tensors stay aliases, so a
//   unit gathered again before its backward is seen by them. A bucket is
//   gathered before its unit's forward, released after it (Python hooks),
//   gathered again before its backward, and released as soon as its last
//   gradient is staged (mark_ready). The root unit (0) stays gathered from its
//   forward to the end of backward. While released, the parameters themselves
//   point at a 0-element tensor (set_data), so reading one outside forward gives
//   an empty tensor rather than reading freed memory; gathering points them back.

void Engine::absorb(at::Tensor master, const at::Tensor &lp_new) {
    // Only elements whose low-precision (param_quant: dequantized) value changed take the new value.
    at::Tensor changed = lp_new.ne(qgather_ ? qgather_->roundtrip(master, pdt_) : master.to(pdt_));
    master.copy_(at::where(changed, lp_new.to(at::kFloat), master));
}

void Engine::publish_params() {
    wait_params();
    cast_masters();
    if (opts_.stage == 3) {
        // Gathered units hold stale values: release them; the next gather reads the shards.
        for (auto &bk : buckets_) release_bucket(bk);
        return;
    }
    all_gather_params();
    wait_params();
}

void Engine::absorb_param_edits() {
    TORCH_CHECK(opts_.stage <= 2, "zero_ext: absorb_param_edits is for stages 0-2 (stage 3: commit_unit)");
    wait_params();
    if (!lp_ && !qgather_) return;   // the owned slice is the master
    for (auto &bk : buckets_) absorb(master_slice(bk), owned_slice(bk.flat_param, bk));
}

void Engine::all_gather_params() {
    if (parts_ == 1 || opts_.stage == 3) return;   // stage 3 gathers per unit, on demand
    wait_params();
    for (int64_t b = 0; b < (int64_t)buckets_.size(); b++) {
        Bucket &bk = buckets_[b];
        if (!active(bk)) continue;
        at::Tensor in = owned_slice(bk.flat_param, bk);   // in place: the owned slice of the output
        comm_.seq.subject(b, -1);
        gather_works_.push_back(qgather_ ? qgather_->launch(comm_, b, master_slice(bk), bk.flat_param)
                                         : comm_.all_gather(bk.flat_param, in));
    }
}

void Engine::wait_params() {
    for (auto &w : gather_works_) comm_.watch(w, "parameter all-gather");
    gather_works_.clear();
    if (qgather_ && opts_.stage < 3) qgather_->finish_all();   // stage 3: wait_gather finishes its own
}

void Engine::broadcast_tensors(std::vector<at::Tensor> tensors, int64_t src) {
    for (auto &t : tensors) comm_.broadcast(t, src);
}

void Engine::wait_gather(Bucket &bk) {
    if (bk.gather_work) {
        auto work = std::move(bk.gather_work);
        bk.gather_work.reset();
        comm_.watch(work, "unit all-gather");
        if (qgather_) qgather_->finish(&bk - buckets_.data());
    }
}

void Engine::release_bucket(Bucket &bk) {
    wait_gather(bk);
    const bool staged = bk.staging.defined();
    if (!staged && !bk.gathered) return;   // the common case after backward: nothing held
    if (staged) {
        gathered_bytes_ -= bk.staging.nbytes();
        bk.staging = at::Tensor();
    }
    if (bk.gathered) {
        kern_->resize_storage(bk.flat_param, 0);
        gathered_bytes_ -= bk.flat_param.numel() * bk.flat_param.element_size();
        bk.gathered = false;
    }
    const at::Tensor empty = at::empty({0}, bk.flat_param.options());
    for (int64_t i : bk.params) params_[i].set_data(empty);
}

void Engine::mark_gathered(Bucket &bk) {
    wait_gather(bk);
    if (bk.gathered) return;
    bk.gathered = true;
    for (int64_t i : bk.params) params_[i].set_data(param_views_[i]);
}

bool Engine::gather_unit(int64_t u, bool wait) {
    TORCH_CHECK(opts_.stage == 3, "zero_ext: gather_unit is a stage-3 operation");
    TORCH_CHECK(u >= 0 && u < (int64_t)unit_buckets_.size(), "zero_ext: no unit ", u);
    bool prefetched = true;
    for (int64_t b : unit_buckets_[u]) {
        Bucket &bk = buckets_[b];
        if (bk.gathered) continue;
        if (!bk.gather_work) {
            prefetched = false;
            const int64_t bytes = bk.flat_param.numel() * bk.flat_param.element_size();
            kern_->resize_storage(bk.flat_param, bytes);
            gathered_bytes_ += bytes;
            peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_);
            at::Tensor in = lp_slice(bk);
            if (world_ == 1) {
                bk.flat_param.copy_(in);
                mark_gathered(bk);
                continue;
            }
            comm_.seq.subject(b, u);
            bk.gather_work = qgather_ ? qgather_->launch(comm_, b, master_slice(bk), bk.flat_param)
                                      : comm_.all_gather(bk.flat_param, in);
        }
        if (wait) mark_gathered(bk);
    }
    return prefetched;
}

void Engine::release_unit(int64_t u) {
    TORCH_CHECK(u >= 0 && u < (int64_t)unit_buckets_.size(), "zero_ext: no unit ", u);
    for (int64_t b : unit_buckets_[u]) release_bucket(buckets_[b]);
}

void Engine::commit_unit(int64_t u, int64_t src) {
    TORCH_CHECK(u >= 0 && u < (int64_t)unit_buckets_.size(), "zero_ext: no unit ", u);
    for (int64_t b : unit_buckets_[u]) {
        Bucket &bk = buckets_[b];
        if (bk.staging.defined()) {   // open_unit_fp32: full-precision values
            comm_.seq.subject(b, u);
            broadcast_tensors({bk.staging}, src);
            master_slice(bk).copy_(owned_slice(bk.staging, bk));
            if (lp_) lp_slice(bk).copy_(owned_slice(bk.staging, bk));
            release_bucket(bk);
            continue;
        }
        TORCH_CHECK(bk.gathered, "zero_ext: commit_unit needs unit ", u, " gathered");
        comm_.seq.subject(b, u);
        broadcast_tensors({bk.flat_param}, src);
        const at::Tensor owned = owned_slice(bk.flat_param, bk);
        if (lp_ || qgather_) {
            absorb(master_slice(bk), owned);
            if (lp_) lp_slice(bk).copy_(owned);
        } else {
            master_slice(bk).copy_(owned);
        }
    }
}

void Engine::open_unit_fp32(int64_t u) {
    TORCH_CHECK(opts_.stage == 3, "zero_ext: open_unit_fp32 is a stage-3 operation");
    TORCH_CHECK(u >= 0 && u < (int64_t)unit_buckets_.size(), "zero_ext: no unit ", u);
    if (!lp_) {
        gather_unit(u, true);
        return;
    }
    for (int64_t b : unit_buckets_[u]) {
        Bucket &bk = buckets_[b];
        release_bucket(bk);
        // The current fp32 masters (zeros before the first commit), so a unit opened
        // again after a commit keeps what was written to it.
        bk.staging = at::empty({bk.padded_numel}, on_device(at::kFloat));
        at::Tensor in = master_slice(bk);
        if (world_ == 1) {
            bk.staging.copy_(in);
        } else {
            comm_.seq.subject(b, u);
            comm_.watch(comm_.all_gather(bk.staging, in), "unit all-gather");
        }
        gathered_bytes_ += bk.staging.nbytes();
        peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_);
        for (int64_t i : bk.params)
            params_[i].set_data(bk.staging.narrow(0, offset_of_[i], param_views_[i].numel())
                                    .view(param_views_[i].sizes()));
    }
}

bool Engine::unit_gathered(int64_t u) const {
    for (int64_t b : unit_buckets_.at(u))
        if (!buckets_[b].gathered) return false;
    return true;
}

}  // namespace zx
