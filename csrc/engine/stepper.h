// stepper.h — Stepper: the fused optimizer steps over this rank's shard (Note [One fused
// step], stepper.cpp), and what a generic optimizer, clipping and loss scaling do to it
// bucket by bucket: shard views, gradient scaling and norm, the low-precision copy of the
// master. It keeps no state between calls: the engine lends it the buckets, the shard's
// view, the kernels and the step book for one call (Engine::stepper()); the engine's side
// (waiting for reductions and gathers, settling a split master, the norm's all-reduce) comes
// before and after.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "core/zx_core.h"
#include "engine/bucket.h"          // defines: Bucket
#include "engine/fragment_view.h"   // defines: FragmentView
#include "engine/fused_ops.h"       // defines: AdamOp, SgdOp
#include "engine/groups.h"          // defines: Groups
#include "engine/kernels.h"         // defines: Kernels, KernelTables
#include "engine/shard_view.h"      // defines: ShardView
#include "engine/step_book.h"       // defines: StepBook, StepRun, BackwardStep

namespace zx {

struct Stepper {
    std::vector<Bucket> &buckets;
    ShardView shard;
    KernelTables &kernels;
    const StepBook &book;
    at::Tensor param_shard;   // stage 3 with offload: where upload() writes (the units' parameter shard)

    // Step the groups' buckets with Op (steps: per-group step counts; ctl: Note [Step control]).
    template <class Op>
    void step(const std::vector<typename Op::Hparams> &hps, const Groups &groups, const at::Tensor &ctl,
              const at::Tensor &steps);
    // step_in_backward (backward_step.cpp): bk's whole slice, on its reduced gradient grad, with
    // the armed optimizer (Note [Step in backward]).
    void land(const BackwardStep &armed, Bucket &bk, const at::Tensor &grad);
    // Offload: bk's master slice, as the device computes with it, into the device's copy.
    void upload(Bucket &bk);

    std::vector<at::Tensor> masters(const Groups &groups);   // the groups' buckets' master slices
    std::vector<at::Tensor> grads(const Groups &groups);     // ... and gradient slices
    std::vector<int64_t> bucket_groups(const Groups &groups);
    // Note [Fragment views]: this rank's fragments of the groups' buckets, with views of the
    // master unless masters is false (a split master joined first).
    std::vector<FragmentView> fragment_views(bool masters, const Groups &groups);
    // atomic.cpp: the groups' whole tensors this rank owns: (param index, master view, gradient
    // view), shaped as the parameter (a split master joined first: there is none with them)
    std::vector<std::tuple<int64_t, at::Tensor, at::Tensor>> owned_tensors(const Groups &groups);
    void scale_grads(double factor, const Groups &groups);   // cut parameters: the step tables read
    // This rank's sum of squares of the gradient shard (times scale) and inf/nan count, added in.
    void grad_sumsq(double scale, double *sumsq, int64_t *nonfinite);
    void grad_sumsq_into(const at::Tensor &out2);   // the same, into a float32 [sumsq, nonfinite] on the device
    void cast_masters(const Groups &groups);        // the master into the low-precision copy (or up, offload)

private:
    AdamOp op(const std::vector<zx_adam_hparams> &hps);   // the states' pointers (made on demand)
    SgdOp op(const std::vector<zx_sgd_hparams> &hps);
    // The stretch [lo, lo + n) of bk's slice (grad: the whole slice's; lp: its low-precision
    // parameters, or null), with kernels k.
    template <class Op>
    void range(Kernels &k, Bucket &bk, int64_t lo, int64_t n, const at::Tensor &grad, const Op &op, char *lp,
               const typename Op::Hparams &hp, const double *ctl, const int64_t *step);
    // Note [Unused parameters]: the stretches of bk's slice that step (mixed: one per parameter piece)
    std::vector<StepRun> runs(const Bucket &bk) const;
    int64_t index(const Bucket &bk) const { return &bk - buckets.data(); }
    // f(bk) of each bucket of the groups, in bucket order (what param_shards() and its siblings list)
    template <class F>
    auto per_bucket(const Groups &groups, F &&f) -> std::vector<decltype(f(buckets[0]))> {
        std::vector<decltype(f(buckets[0]))> out;
        for (auto &bk : buckets)
            if (groups.has(bk.group)) out.push_back(f(bk));
        return out;
    }
};

}  // namespace zx
