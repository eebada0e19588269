// shard_view.cpp — ShardView (shard_view.h): bucket bk's slices of this rank's shard, and
// the buffers made on first use.
#include "engine/shard_view.h"

namespace zx {

// Note [Gradient shard lifetime]
//   Stages 2-3 hold the gradient shard from the first reduce of a step until
//   zero_grad(set_to_none=True), as FSDP2 holds its gradients; no longer. Releasing frees
//   the storage's bytes but keeps the tensor and every view of it (the torch optimizers'
//   .grad over shard views, a whole tensor's .grad): views read their storage's pointer
//   when used. The next reader through ShardView::grad (a reduce, a step, a norm) gives the
//   storage new bytes, unwritten, and each bucket's slice is zeroed when first read, so the
//   values are those zero_() gave before. The pages of a slice are touched when its bucket
//   first reduces: on the CPU a step's resident gradient grows bucket by bucket, as FSDP2's
//   per-unit gradients do (a GPU's caching allocator counts the whole block at once).
//   Python code that reads those views directly goes through the engine first
//   (scale_grads, grad_shards).
static bool released(const at::Tensor &t) { return t.defined() && t.numel() > 0 && t.storage().nbytes() == 0; }

static void drop_bytes(const at::Tensor &t) {
    c10::StorageImpl *s = t.storage().unsafeGetStorageImpl();
    s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
    s->set_nbytes(0);
}

static void give_bytes(const at::Tensor &t) {   // unwritten: the caller zeroes
    c10::StorageImpl *s = t.storage().unsafeGetStorageImpl();
    const size_t nbytes = (size_t)t.numel() * t.element_size();
    s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
    s->set_nbytes(nbytes);
}

bool grad_shard_held(const ShardBuffers &buffers) { return buffers.grad.defined() && !released(buffers.grad); }

void release_grad_shard(ShardBuffers &buffers) {
    if (grad_shard_held(buffers)) drop_bytes(buffers.grad);
}

// The shard, its bytes given (back) where it has none; its slice at `offset` zeroed when first read.
static at::Tensor grad_slice(ShardBuffers &b, int64_t numel, at::TensorOptions options, int64_t offset, int64_t n) {
    if (!b.grad.defined()) {
        b.grad = at::empty({numel}, options);
        b.grad_lazy = true, b.grad_zeroed.clear();
    } else if (released(b.grad)) {
        give_bytes(b.grad);
        b.grad_lazy = true, b.grad_zeroed.clear();
    }
    at::Tensor slice = b.grad.narrow(0, offset, n);
    if (n > 0 && b.grad_lazy && b.grad_zeroed.insert(offset).second) slice.zero_();   // (slices are disjoint)
    return slice;
}

// Note [Bucket gradient lifetime]
//   Stages 0-1 keep a full gradient per bucket (flat_grad; .grad are views of it, Note
//   [Gradient layout]). As the shard of stages 2-3 (Note [Gradient shard lifetime]) it
//   holds bytes only from the first gradient of a step to zero_grad(set_to_none=True),
//   as torch's and FSDP2's gradients do, so the loss-time peak (activations) does not
//   hold it. The bucket starts without bytes (build.cpp), release_bucket_grad frees them
//   and keeps the tensor and every view (grads_.views, .grad, cut copies' narrows made
//   later); bucket_grad gives them back, zeroed (the values zero_() gave before), and is
//   the one way to reach a bucket's gradient: the backward's first gradient into the
//   bucket (ensure_grad_view), its reduction, a step, a norm. Resident gradient memory
//   grows bucket by bucket through backward. Not released: set_to_none=False, a zero_grad
//   of some groups only, offload and step_in_backward (as for the shard). A stage-0 .grad
//   a script keeps across zero_grad(set_to_none=True) has no bytes until the next backward
//   (torch's would keep its old values): clone it.
bool bucket_grad_held(const Bucket &bk) { return bk.flat_grad.defined() && !released(bk.flat_grad); }

void release_bucket_grad(Bucket &bk) {
    if (bucket_grad_held(bk)) drop_bytes(bk.flat_grad);
}

at::Tensor &bucket_grad(Bucket &bk) {
    if (released(bk.flat_grad)) {
        give_bytes(bk.flat_grad);
        bk.flat_grad.zero_();
    }
    return bk.flat_grad;
}

at::Tensor ShardView::grad(Bucket &bk) {
    if (offload) {   // every landing done: readers see the whole host shard
        offload->drain();
        return host_grad(bk);
    }
    if (layout.opts.stage >= 2)
        return grad_slice(buffers, layout.shard_numel, layout.on_device(layout.dtypes.reduce), bk.shard_offset,
                          bk.slice_numel);
    return owned(bucket_grad(bk), bk);
}

at::Tensor ShardView::host_grad(const BucketShape &bk) {   // (offload: never released, Note [Optimizer offload])
    if (!buffers.grad.defined()) buffers.grad = at::zeros({layout.shard_numel}, on_shard(layout.dtypes.reduce));
    return buffers.grad.narrow(0, bk.shard_offset, bk.slice_numel);
}

at::Tensor ShardView::master(Bucket &bk) {
    if (buffers.master.defined()) return buffers.master.narrow(0, bk.shard_offset, bk.slice_numel);
    TORCH_CHECK(!buffers.split, "zero_ext: internal: the split master must be joined before its slices are read");
    return owned(bk.flat_param, bk);
}

at::Tensor ShardView::lp(Bucket &bk) {
    TORCH_CHECK(layout.opts.stage < 3, "zero_ext: internal: stage 3 keeps no low-precision shard");
    return owned(bk.flat_param, bk);
}

at::Tensor ShardView::state(const std::string &name) {
    // Note [bf16 optimizer states] (stepper.cpp): Adam's two moments in bf16 when asked; others stay fp32.
    const bool low = layout.opts.state_dtype == "bf16" && (name == "exp_avg" || name == "exp_avg_sq");
    return buffers.states.get(name, on_shard(low ? at::kBFloat16 : at::kFloat));   // Note [Optimizer offload]
}

at::Tensor ShardView::landing(int64_t numel) {
    at::Tensor &land = buffers.land;
    if (!land.defined() || land.numel() < numel)
        land = at::empty({layout.max_padded / layout.partitions}, layout.on_device(layout.dtypes.reduce));
    return land.narrow(0, 0, numel);
}

}  // namespace zx
