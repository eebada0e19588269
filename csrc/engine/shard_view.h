// shard_view.h — ShardView: this rank's shard seen bucket by bucket. Where a bucket's slice of
// each buffer lies (the owned slice of a full buffer, the gradient sums, the fp32 master, the
// low-precision copy a step writes), the optimizer states and step_in_backward's landing made
// on first use. A view over the engine's Layout, ShardBuffers and Offload that owns none of
// them: the engine makes one per call (Engine::view()), and the Stepper steps through it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "engine/bucket.h"          // defines: Bucket, BucketShape
#include "engine/layout.h"          // defines: Layout
#include "engine/offload.h"         // defines: Offload
#include "engine/shard_buffers.h"   // defines: ShardBuffers

namespace zx {

struct ShardView {
    const Layout &layout;
    ShardBuffers &buffers;
    Offload *offload;   // offload="cpu" (Note [Optimizer offload]), else null

    // Where the master, the states and the gradient shard live: the device, or the host with offload
    // (asked of the options: the construction makes the master before the Offload's rings).
    at::TensorOptions on_shard(at::ScalarType dt) const {
        return layout.opts.offload ? Offload::host(dt) : layout.on_device(dt);
    }

    // This rank's slice of a bucket-sized buffer (flat_param, flat_grad, a gathered copy).
    at::Tensor owned(const at::Tensor &flat, const BucketShape &bk) const {
        const int64_t r = layout.opts.stage == 0 ? 0 : layout.rank;
        return flat.narrow(0, r * bk.slice_numel, bk.slice_numel);
    }
    // The gradient sums of bk's slice: stages 0-1 the owned slice of flat_grad, stages 2-3 the
    // gradient shard's (made at the first use); offload: the host's, every landing done.
    at::Tensor grad(Bucket &bk);
    at::Tensor host_grad(const BucketShape &bk);   // offload: bk's slice of the host gradient shard
    // The fp32 master of bk's slice. A split master must be joined first (Engine::master_slice
    // joins; Note [Split master in the engine]).
    at::Tensor master(Bucket &bk);
    float *master_data(Bucket &bk) { return master(bk).data_ptr<float>(); }
    at::Tensor lp(Bucket &bk);   // stages 0-2: the owned slice of flat_param (param_dtype)
    // Where a step writes the low-precision copy: lp(bk) when param_dtype is low in stages 0-2;
    // else null (stage 3 casts at each gather: Note [Stage 3 parameter lifetime]).
    void *lp_out(Bucket &bk) { return layout.dtypes.low() && layout.opts.stage < 3 ? lp(bk).data_ptr() : nullptr; }
    uint16_t *hi_bits(Bucket &bk) { return (uint16_t *)lp(bk).data_ptr(); }   // lp(bk) as bf16 bits (split master)

    // A flat per-element optimizer state over the state windows, zero-filled when first asked for
    // (Note [State windows]; exp_avg / exp_avg_sq in bf16 with state_dtype="bf16").
    at::Tensor state(const std::string &name);
    // step_in_backward, all-to-all: where a bucket's received slices are summed (numel elements).
    at::Tensor landing(int64_t numel);
};

// Stages 0-1 (Note [Bucket gradient lifetime], shard_view.cpp): bk.flat_grad with bytes, given
// back zeroed where zero_grad(set_to_none=True) released them; every reader goes through it.
at::Tensor &bucket_grad(Bucket &bk);
void release_bucket_grad(Bucket &bk);     // its bytes go, the tensor and its views stay
bool bucket_grad_held(const Bucket &bk);  // made, with bytes

}  // namespace zx
