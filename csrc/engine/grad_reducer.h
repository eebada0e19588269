// grad_reducer.h — backward's reductions, one owner (its code in reducer.cpp): what .grad
// shows (ShardedGrads), where the pass stands (BackwardPass), the ring of gradient slots (GradRing), the reductions in
// flight in launch order, stage 3's coalesced groups (ReduceGroups), and the reduce kind,
// chosen once at construction: every launch and every landing goes through it, so no
// other code asks which collective sums the gradients. Its pass (mark_ready, finalize,
// wait, zero_grad) runs on what the engine lends it for one call (ReduceWork), as DDP's
// reducer runs on its parameters and process group; the stage-3 releases and the steps in
// backward it reaches through ReducerHooks.
#pragma once

#include <ATen/ATen.h>

#include <deque>
#include <memory>
#include <utility>

#include "engine/backward_pass.h"   // defines: BackwardPass
#include "engine/bucket.h"          // defines: Bucket
#include "engine/comm.h"            // defines: Communicator, WorkPtr
#include "engine/grad_ring.h"       // defines: GradRing, Slot
#include "engine/groups.h"          // defines: Groups
#include "engine/kernels.h"         // defines: Kernels, KernelTables
#include "engine/params.h"          // defines: Params
#include "engine/quant_reduce.h"    // defines: QuantReduce
#include "engine/reduce_groups.h"   // defines: ReduceGroups, ReduceGroup
#include "engine/shard_view.h"      // defines: ShardView, Layout, Offload
#include "engine/sharded_grads.h"   // defines: ShardedGrads
#include "engine/step_book.h"       // defines: StepBook

namespace zx {

enum class ReduceKind {
    kAllReduce,       // stage 0: each bucket averaged by a SUM all-reduce of bucket / N, as DDP
    kReduceScatter,   // the process group's reduce-scatter (SUM)
    kAllToAll,        // Note [Reduce-scatter on gloo]: all-to-all, then the slices summed locally
    kQuantized,       // Note [Quantized gradient reduction]: two all-to-alls of codes and scales
};

// What a pass calls back into (the engine implements it): stage 3 frees a bucket's full
// parameters when its backward is over, and frees the rest when the pass is; step_in_backward
// steps a bucket on its reduced gradient as it lands (Note [Step in backward]).
class ReducerHooks {
public:
    virtual void release_bucket(Bucket &bk) = 0;
    virtual void release_pass() = 0;   // stage 3, the pass over: every bucket, the frozen ones, node parts
    virtual void step_landed(Bucket &bk, const at::Tensor &grad) = 0;

protected:
    ~ReducerHooks() = default;
};

// What GradReducer is lent for one call (Engine::reduce_work()); it owns none of it.
struct ReduceWork {
    std::vector<Bucket> &buckets;
    Params &params;
    Communicator &comm;
    KernelTables &kernels;
    ShardView shard;       // where the sums land: the gradient shard, the host's with offload
    StepBook &book;
    ReducerHooks &hooks;

    const Layout &layout() const { return shard.layout; }
    Offload *off() const { return shard.offload; }
    int64_t stage() const { return shard.layout.opts.stage; }
};

class GradReducer {
public:
    // The reduce kind, chosen once from the options, and what it needs: grad_quant's reducer
    // (device: its kernels), the ring's slots, stage 3's coalesced groups (build.cpp).
    void configure(const Layout &layout, Kernels *device);
    ReduceKind kind() const { return kind_; }
    bool quantized() const { return kind_ == ReduceKind::kQuantized; }
    const QuantReduce *quant() const { return quant_.get(); }
    // what the collective leaves in a slot's recv: every rank's slices (all-to-alls) or this rank's
    int64_t recv_numel(int64_t padded) const {
        return kind_ == ReduceKind::kAllToAll || kind_ == ReduceKind::kQuantized ? padded : padded / partitions_;
    }

    // --- the pass (reducer.cpp) ---
    // param i's gradient is final for this backward: in param.grad, or given (any shape of
    // its numel: stage 3's compiled backward, Note [Stage 3 collectives in the graph])
    void mark_ready(ReduceWork w, int64_t i, const at::Tensor &grad = {});
    void finalize(ReduceWork w);                // end of backward: unused params, launch the rest, wait
    void wait_all(ReduceWork w);                // block until every launched reduction has landed
    // Clear (set_to_none) or zero the groups' gradients (the caller made the step tables when
    // groups do not cover all: its fragments).
    void zero_grad(ReduceWork w, bool set_to_none, const Groups &groups);
    void hide_grads(ReduceWork w);              // Note [Sharded gradients]: the plain gradients again

    ShardedGrads &grads() { return grads_; }   // what .grad shows (Note [Sharded gradients])
    BackwardPass &pass() { return pass_; }
    const BackwardPass &pass() const { return pass_; }
    GradRing &ring() { return ring_; }
    const GradRing &ring() const { return ring_; }
    ReduceGroups &groups() { return groups_; }

    // Bucket b's reduction of send (padded elements, slice of them this rank's) launched and
    // queued; slot: its ring slot (stages 1-3), whose recv the collective writes.
    void launch(Communicator &comm, int64_t b, const at::Tensor &send, int64_t padded, int64_t slice, int64_t slot);
    // Note [Coalesced gradient reductions]: the group being filled, launched and queued.
    void launch_group(Communicator &comm);

    bool idle() const { return inflight_.empty(); }
    int64_t oldest() const { return inflight_.front().first; }
    int64_t newest() const { return inflight_.back().first; }
    // The oldest reduction, waited for (the watch names it): the bucket the queue named.
    int64_t wait_oldest(Communicator &comm);
    // At teardown: wait for what is in flight (its works hold the buffers), or drop it after a divergence.
    void drain(bool diverged) {
        if (diverged) inflight_.clear();
        for (auto &w : inflight_) w.second->wait();
    }

    // recv, as an exact collective left it (padded elements for the all-to-all, else slice),
    // into dst: the slices summed (all-to-all) or the slice taken, added when accumulate.
    void finish(int64_t padded, int64_t slice, const at::Tensor &recv, at::Tensor dst, bool accumulate,
                Kernels &k) const;
    // What slot's collective left, into dst, as finish() (or dequantized and summed).
    void land(int64_t slot, int64_t padded, int64_t slice, at::Tensor dst, bool accumulate, Kernels &k);
    // The part of slot's recv an exact collective wrote (all-to-all: every rank's slices).
    at::Tensor recv(int64_t slot, int64_t padded, int64_t slice) {
        return recv_of(slot).narrow(0, 0, kind_ == ReduceKind::kAllToAll ? padded : slice);
    }
    // Note [Narrow gradient wire]: 16-bit slots (wire_ is param_dtype), or reduce_dtype
    bool narrow() const { return wire_ != reduce_.dtype().toScalarType(); }
    // Slot's buffers as its bucket uses them: the wide pair once widen() made it.
    at::Tensor &send_of(int64_t slot) { return ring_[slot].wide_send.defined() ? ring_[slot].wide_send : ring_[slot].send; }
    at::Tensor &recv_of(int64_t slot) { return ring_[slot].wide_recv.defined() ? ring_[slot].wide_recv : ring_[slot].recv; }
    // Slot's reduced slice as a tensor: where the reduce-scatter left it, else summed into
    // landing(slice) (Note [Step in backward]).
    template <class Landing>
    at::Tensor reduced(int64_t slot, int64_t padded, int64_t slice, Landing &&landing, Kernels &k) {
        if (kind_ == ReduceKind::kReduceScatter) return ring_[slot].recv.narrow(0, 0, slice);
        at::Tensor dst = landing(slice);
        land(slot, padded, slice, dst, false, k);
        return dst;
    }

private:
    void ensure_grad_view(ReduceWork &w, int64_t i);   // stage 0/1: param i's grad is its bucket view
    void stage_grad(ReduceWork &w, int64_t i);         // stage 2: param i's grad copied into its bucket's slot
    void accumulate_local(ReduceWork &w, int64_t i);   // stages 2-3, sync off: into its bucket's local_grad
    int64_t acquire_slot(ReduceWork &w, int64_t b);
    void release_slot(ReduceWork &w, int64_t b);
    void widen(int64_t slot);                          // Note [Narrow gradient wire]: the bucket in reduce_dtype
    void launch_bucket(ReduceWork &w, int64_t b);      // b's gradients are in: its reduction (or world 1's landing)
    void complete(ReduceWork &w, int64_t b);           // wait for b's reduction (and those before) and land it
    void finish_group(ReduceWork &w, ReduceGroup &g);  // Note [Coalesced gradient reductions]: sums into the shard

    ReduceKind kind_ = ReduceKind::kReduceScatter;
    int64_t world_ = 1, partitions_ = 1;
    at::TensorOptions reduce_;               // reduce_dtype, on the parameters' device
    at::ScalarType wire_ = at::kFloat;       // the ring's dtype (Note [Narrow gradient wire])
    std::unique_ptr<QuantReduce> quant_;     // kQuantized: the codes, scales and residuals
    ShardedGrads grads_;   // what .grad shows: stage 0-1 views, the wrappers after a reducing backward
    BackwardPass pass_;
    GradRing ring_;
    ReduceGroups groups_;
    std::deque<std::pair<int64_t, WorkPtr>> inflight_;   // (bucket, its reduction), launch order
};

}  // namespace zx
