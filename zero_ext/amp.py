"""amp.py — torch.amp.GradScaler on a zeroified model.

Note [GradScaler on sharded gradients]
  The AMP recipe DDP scripts use is `scaler.scale(loss).backward()`, optionally
  `scaler.unscale_(optimizer)` and torch's clip_grad_norm_, then `scaler.step(optimizer)`
  and `scaler.update()`. GradScaler.unscale_ (which step() calls when the script did not)
  hands every p.grad of the optimizer's param groups, per device and dtype, to
  torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale); step()
  calls optimizer.step() only where found_inf is 0, and update() moves the scale and its
  growth tracker by found_inf.
  - Stage 0: p.grad is DDP's (the reduced bucket views, complete when backward returns),
    so torch's own kernel runs on them as under DDP; nothing here.
  - Stages 1-3: p.grad is a ShardedGrad (Note [Sharded gradients] in
    zero_ext/sharded_grad.py), which hands the call to unscale_sharded_ below: torch's
    same kernel runs over this rank's reduced gradient shards of those param groups,
    unscaling them in place as it would DDP's p.grad (the shards hold the sum over ranks,
    which the step divides: the product is the same), and this rank's verdict is
    all-reduced (MAX) before it is written into found_inf. The verdict must be global
    there and then: a reduce-scatter puts an inf only into its owner's shard, and a
    verdict made global only inside step() would leave each rank's update() with its own,
    so skipped steps and scales would drift apart (torch's ShardedGradScaler all-reduces
    found_inf_per_device for the same reason). So every rank skips the same steps, and
    scale and growth tracker stay equal on every rank, as under DDP. Being collective,
    the all-reduce runs on a tensor of the engine's device through the communication
    layer (Note [One communication layer] in zero_ext/comm.py), after the sequence
    check's mark for reductions of sharded gradients, so a rank that calls unscale_ alone
    is named, not hung (Note [Collective sequence check] in csrc/engine/sequence.h). A
    GradScaler step so costs two small collectives that DDP's does not have: that mark's
    digest exchange (one all-gather of kDigest integers on the side group; NCCL exchanges at
    every phase anyway) and the verdict's one-float all-reduce.
  - Nothing is folded: once unscaled, the shards are what the step, clip_grad_norm_
    and p.grad's reductions read. GradScaler.step skips optimizer.step() after an
    overflow, so a clip factor that torch's clip_grad_norm_ folded for that iteration
    belongs to gradients that are gone: ZeroOptimizer keeps it only while the gradients
    it was computed from are there (the engine's grad_generation).
  - Refused by name, before any collective (every rank has the same options): a
    GradScaler with zero_ext's own loss scaling (param_dtype="fp16", loss_scale=...: the
    loss would be scaled twice), and with step_in_backward=True (each bucket steps inside
    backward, before GradScaler sees a gradient). GradScaler.step reads
    optimizer._step_supports_amp_scaling first: the property raises there
    (scaler_conflict), as unscale_sharded_ does, and the integrations (Lightning's
    "16-mixed", Accelerate's and the HF Trainer's fp16) check it at set-up. (An explicit
    unscale_ of fp16 parameters' gradients meets GradScaler's own refusal first,
    "Attempting to unscale FP16 gradients", as a DDP model in fp16 does.)
  - The integrations: Lightning's MixedPrecision calls unscale_ and step itself. Accelerate
    and the HF Trainer never see the zeroified model, so what accelerator.prepare(model)
    would have done is done by zero_ext/integrations/accelerate.py: the forward runs under
    autocast, the optimizer's AcceleratedOptimizer gets the scaler, and
    accelerator.clip_grad_norm_'s unscale_gradients() also unscales the optimizers
    prepare() zeroified (they are not in accelerator._optimizers: their checkpoint is
    zero_ext.save's, not optimizer.bin).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._C import PHASE_GRAD_STATS
from .changes import ZeroUsageError


def scaler_conflict(config) -> str | None:
    """Why a torch GradScaler cannot drive an optimizer zeroified with `config` (a ZeroConfig),
    naming the fix; None when it can."""
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


def check_scaler(config) -> None:
    """Raise ZeroUsageError when a GradScaler cannot drive an optimizer with `config`."""
    why = scaler_conflict(config)
    if why is not None:
        raise ZeroUsageError("zero_ext: a torch GradScaler cannot drive this zeroified optimizer: " + why)


def unscale_sharded_(grads: list, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """torch._amp_foreach_non_finite_check_and_unscale_ over ShardedGrads (Note [GradScaler
    on sharded gradients]): unscale this rank's shards of their param groups, and set
    found_inf to 1 when any rank's shard holds an inf or nan (collective)."""
    grads = list(grads)
    if not grads:
        return
    stats = getattr(grads[0], "_zx_stats", None)   # a ShardedGrad's model (zero_ext/sharded_grad.py)
    if stats is None or any(getattr(g, "_zx_stats", None) is not stats for g in grads):
        raise ZeroUsageError("zero_ext: torch._amp_foreach_non_finite_check_and_unscale_ over gradients of "
                             "several zeroified models, or of a zeroified model and plain tensors: each model's "
                             "gradients are sharded on their own; unscale with GradScaler.unscale_(optimizer), "
                             "one zeroified optimizer at a time")
    opt = stats.optimizer()
    check_scaler(opt._config)
    given = {g._zx_index for g in grads}
    groups = sorted({opt._param_group_of[i] for i in given})
    wanted = [i for i, gi in enumerate(opt._param_group_of) if gi in set(groups)]
    if len(given) != len(grads) or len(given) != len(wanted):
        raise ZeroUsageError(f"zero_ext: torch._amp_foreach_non_finite_check_and_unscale_ over {len(grads)} of the "
                             f"{len(wanted)} gradients of param group(s) {groups}: a zeroified model's gradients are "
                             f"sharded by bucket and unscaled a whole param group at a time; unscale with "
                             f"GradScaler.unscale_(optimizer) (every gradient of the optimizer)")
    eng = opt._engine
    eng.sequence_mark(PHASE_GRAD_STATS)
    eng.wait_reductions()
    shards = eng.grad_shards()
    if len(groups) < len(opt.param_groups):
        # one of several optimizers: its parameters' pieces only (a bucket may hold several groups'
        # pieces, Note [Cut parameters] in csrc/engine/fill.cpp)
        pieces = [shards[f.bucket].narrow(0, f.slice_offset, f.numel)
                  for f in eng.fragment_views(masters=False, groups=groups)]
    else:
        pieces = shards
    by_dtype: dict = {}
    for t in pieces:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    comm = opt._comm
    found = torch.zeros((), dtype=torch.float32, device=comm.device)
    for ts in by_dtype.values():
        here = torch.zeros((), dtype=torch.float32, device=ts[0].device)   # offload: the host shard
        torch._amp_foreach_non_finite_check_and_unscale_(ts, here, inv_scale.to(ts[0].device))
        found = torch.maximum(found, here.to(comm.device))
    if comm.world > 1 and eng.partitions > 1:
        comm.all_reduce_(found, op=dist.ReduceOp.MAX)
    found_inf.copy_(torch.maximum(found_inf, found.to(found_inf.device)))
    stats.invalidate()      # p.grad's reductions read the unscaled shards from now on
