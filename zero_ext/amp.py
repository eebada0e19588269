"""torch.amp.GradScaler on a zeroified model.

Note [GradScaler on sharded gradients]
  GradScaler.unscale_ hands each p.grad to torch._amp_foreach_non_finite_check_and_unscale_;
  step() skips optimizer.step() where found_inf is set. Stage 0's p.grad is DDP's. In
  stages 1-3 p.grad is a ShardedGrad (Note [Sharded gradients] in zero_ext/sharded_grad.py),
  which calls unscale_sharded_: the kernel unscales this rank's gradient shards in place and
  the verdict is all-reduced (MAX), as torch's ShardedGradScaler does: an inf lands only in
  its owner's shard. The all-reduce follows the sequence check's mark (Note [Collective
  sequence check] in csrc/engine/sequence.h), so a rank calling unscale_ alone is named.
  A clip factor for a step GradScaler skipped is dropped with its gradients (ZeroOptimizer
  keeps it while grad_generation is unchanged). Refused by name before any collective
  (scaler_conflict, through optimizer._step_supports_amp_scaling): zero_ext's own loss
  scaling (the loss would be scaled twice), and step_in_backward=True.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._C import PHASE_GRAD_STATS
from .changes import ZeroUsageError


def scaler_conflict(config) -> str | None:
    """Why a torch GradScaler cannot drive an optimizer zeroified with `config`; None when it can."""
    if config.step_in_backward:
        return ("with step_in_backward=True each bucket steps inside backward, on the scaled gradients, before "
                "GradScaler sees them; drop the GradScaler and train in bf16 (autocast, or param_dtype='bf16'), or "
                "zeroify with step_in_backward=False")
    if config.resolved_loss_scale() is not None:
        why = ("param_dtype='fp16' turns on zero_ext's own dynamic loss scaling" if config.loss_scale == "auto"
               else f"loss_scale={config.loss_scale!r} turns on zero_ext's own loss scaling")
        return (f"{why}, so the loss would be scaled twice; either drop the GradScaler (call "
                f"optimizer.backward(loss), then optimizer.step()), or keep it with fp32 parameters and fp16 "
                f"autocast (zeroify without param_dtype='fp16' and loss_scale)")
    return None


def check_scaler(config, via: str | None = None, error=ZeroUsageError) -> None:
    """Raise `error` when a GradScaler cannot drive an optimizer with `config`; via: what brings it in."""
    why = scaler_conflict(config)
    if why is not None:
        who = f"{via} steps through a torch GradScaler, which" if via else "a torch GradScaler"
        raise error(f"zero_ext: {who} cannot drive this zeroified optimizer: {why}")


def unscale_sharded_(grads: list, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """torch._amp_foreach_non_finite_check_and_unscale_ over ShardedGrads (collective)."""
    grads = list(grads)
    if not grads:
        return
    stats = getattr(grads[0], "zx_stats", None)
    if stats is None or any(getattr(g, "zx_stats", None) is not stats for g in grads):
        raise ZeroUsageError("zero_ext: torch._amp_foreach_non_finite_check_and_unscale_ over gradients of "
                             "several zeroified models, or of a zeroified model and plain tensors: each model's "
                             "gradients are sharded on their own; unscale with GradScaler.unscale_(optimizer), "
                             "one zeroified optimizer at a time")
    opt = stats.optimizer()
    check_scaler(opt.config)
    given = {g.zx_index for g in grads}
    groups = sorted({opt.param_group_of[i] for i in given})
    wanted = [i for i, gi in enumerate(opt.param_group_of) if gi in set(groups)]
    if len(given) != len(grads) or len(given) != len(wanted):
        raise ZeroUsageError(f"zero_ext: torch._amp_foreach_non_finite_check_and_unscale_ over {len(grads)} of the "
                             f"{len(wanted)} gradients of param group(s) {groups}: a zeroified model's gradients are "
                             f"sharded by bucket and unscaled a whole param group at a time; unscale with "
                             f"GradScaler.unscale_(optimizer) (every gradient of the optimizer)")
    eng = opt.engine
    eng.sequence_mark(PHASE_GRAD_STATS)
    eng.wait_reductions()
    shards = eng.grad_shards()
    pieces = shards if len(groups) == len(opt.param_groups) else [   # one of several optimizers: its pieces
        shards[f.bucket].narrow(0, f.slice_offset, f.numel) for f in eng.fragment_views(masters=False, groups=groups)]
    by_dtype: dict = {}
    for t in pieces:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    comm = opt.comm
    found = torch.zeros((), dtype=torch.float32, device=comm.device)
    for ts in by_dtype.values():
        here = torch.zeros((), dtype=torch.float32, device=ts[0].device)   # offload: the host shard
        torch._amp_foreach_non_finite_check_and_unscale_(ts, here, inv_scale.to(ts[0].device))
        found = torch.maximum(found, here.to(comm.device))
    if comm.world > 1 and eng.partitions > 1:
        comm.all_reduce_(found, op=dist.ReduceOp.MAX)
    found_inf.copy_(torch.maximum(found_inf, found.to(found_inf.device)))
    stats.invalidate()
