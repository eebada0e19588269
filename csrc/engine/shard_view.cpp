// shard_view.cpp — ShardView (shard_view.h): bucket bk's slices of this rank's shard, and
// the buffers made on first use.
#include "engine/shard_view.h"

namespace zx {

at::Tensor ShardView::grad(const Bucket &bk) {
    if (offload) {   // every landing done: readers see the whole host shard
        offload->drain();
        return host_grad(bk);
    }
    if (layout.opts.stage >= 2) {
        if (!buffers.grad.defined())
            buffers.grad = at::zeros({layout.shard_numel}, layout.on_device(layout.dtypes.reduce));
        return buffers.grad.narrow(0, bk.shard_offset, bk.slice_numel);
    }
    return owned(bk.flat_grad, bk);
}

at::Tensor ShardView::host_grad(const BucketShape &bk) {
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
