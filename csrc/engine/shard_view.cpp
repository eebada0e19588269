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

bool grad_shard_held(const ShardBuffers &buffers) { return buffers.grad.defined() && !released(buffers.grad); }

void release_grad_shard(ShardBuffers &buffers) {
    if (!grad_shard_held(buffers)) return;
    c10::StorageImpl *s = buffers.grad.storage().unsafeGetStorageImpl();
    s->set_data_ptr_noswap(at::DataPtr(nullptr, buffers.grad.device()));
    s->set_nbytes(0);
}

// The shard, its bytes given (back) where it has none; its slice at `offset` zeroed when first read.
static at::Tensor grad_slice(ShardBuffers &b, int64_t numel, at::TensorOptions options, int64_t offset, int64_t n) {
    if (!b.grad.defined()) {
        b.grad = at::empty({numel}, options);
        b.grad_lazy = true, b.grad_zeroed.clear();
    } else if (released(b.grad)) {
        c10::StorageImpl *s = b.grad.storage().unsafeGetStorageImpl();
        const size_t nbytes = (size_t)b.grad.numel() * b.grad.element_size();
        s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
        s->set_nbytes(nbytes);
        b.grad_lazy = true, b.grad_zeroed.clear();
    }
    at::Tensor slice = b.grad.narrow(0, offset, n);
    if (n > 0 && b.grad_lazy && b.grad_zeroed.insert(offset).second) slice.zero_();   // (slices are disjoint)
    return slice;
}

at::Tensor ShardView::grad(const Bucket &bk) {
    if (offload) {   // every landing done: readers see the whole host shard
        offload->drain();
        return host_grad(bk);
    }
    if (layout.opts.stage >= 2)
        return grad_slice(buffers, layout.shard_numel, layout.on_device(layout.dtypes.reduce), bk.shard_offset,
                          bk.slice_numel);
    return owned(bk.flat_grad, bk);
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
