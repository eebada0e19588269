"""torch_utils.py — torch's gradient-clipping utilities on a zeroified model's parameters.

Note [torch's clipping utilities]
  DDP scripts clip with torch.nn.utils.clip_grad_norm_(model.parameters(), c). On a
  zeroified model that would be silently wrong. In stages 2-3 p.grad is None (the
  gradient lives reduced and sharded in the engine), so torch clips nothing. In stage 1
  p.grad is this rank's unreduced gradient. With loss scaling every p.grad is scaled.
  So `import zero_ext` wraps torch's clip_grad_norm_, clip_grad_value_ and
  clip_grads_with_norm_, under both names torch exports them.
  - A call over none of a zeroified model's parameters runs torch's own.
  - A call over a zeroified model's trainable parameters (frozen ones may be included)
    runs the optimizer's clip_grad_norm_ (the global norm of the sharded gradients,
    folded into the next step), or clamps the gradient shards: what DDP + torch compute.
  - A call over part of a model, or over two models, raises ZeroUsageError naming
    optimizer.clip_grad_norm_: never a silent no-op.
  `foreach` only picks torch's kernels: accepted and ignored. A script that bound the
  function before importing zero_ext keeps torch's own. torch.nn.utils.get_total_norm
  needs no routing: p.grad answers its own norm (Note [Sharded gradients] in
  sharded_grad.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.utils as nn_utils
from torch.nn.utils import clip_grad as clip_grad_module

from .changes import ZeroUsageError
from .gather import OWNER_ATTR

# torch's functions (the module's own, even should this module be imported twice)
_ORIGINAL = {name: getattr(clip_grad_module, name) for name in ("clip_grad_norm_", "clip_grad_value_")}
if hasattr(nn_utils, "clip_grads_with_norm_"):      # torch >= 2.6
    _ORIGINAL["clip_grads_with_norm_"] = nn_utils.clip_grads_with_norm_
_ORIGINAL = {name: getattr(fn, "_zero_ext_torch", fn) for name, fn in _ORIGINAL.items()}


def _optimizer_for(params: list, what: str):
    """The zeroified optimizer that owns `params`, or None when none of them is a
    zeroified model's; raises for a partial or mixed set."""
    owners = {}
    for p in params:
        owner = getattr(p, OWNER_ATTR, None)
        if owner is not None and owner[0]() is not None:
            owners[id(owner[0]())] = owner[0]()
    if not owners:
        return None
    fix = (f"call optimizer.clip_grad_norm_(max_norm, norm_type) on the optimizer zeroify() returned (it clips "
           f"the global norm of the sharded gradients), or pass {what} all of model.parameters()")
    if len(owners) > 1:
        raise ZeroUsageError(f"zero_ext: torch.nn.utils.{what} over the parameters of {len(owners)} zeroified "
                             f"models at once: their gradients are sharded separately; {fix}, once per model")
    wrapped = next(iter(owners.values()))
    opt = wrapped.optimizer
    if opt is None:
        raise ZeroUsageError(f"zero_ext: torch.nn.utils.{what} on a zeroified model whose optimizer is gone; {fix}")
    given = {id(p) for p in params}
    trainable = opt.engine_params
    missing = [p for p in trainable if id(p) not in given]
    if missing:
        guard = opt.guard
        left = ", ".join(repr(guard.name_of(p)) if guard is not None else f"of shape {tuple(p.shape)}"
                         for p in missing[:3])
        raise ZeroUsageError(
            f"zero_ext: torch.nn.utils.{what} over {len(given)} tensors that leave out {len(missing)} of the "
            f"zeroified model's {len(trainable)} trainable parameters ({left}{', ...' if len(missing) > 3 else ''})"
            f": a zeroified model's gradients are sharded and clipped as a whole; {fix}")
    return opt


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.clip_grad_norm_, right on zeroified parameters (Note [torch's clipping utilities])."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    opt = _optimizer_for(params, "clip_grad_norm_")
    if opt is None:
        return _ORIGINAL["clip_grad_norm_"](params, max_norm, norm_type=norm_type,
                                           error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    total = opt.clip_grad_norm_(max_norm, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           f"non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                           f"by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return total


def clip_grad_value_(parameters, clip_value, foreach=None):
    """torch.nn.utils.clip_grad_value_, right on zeroified parameters (Note [torch's clipping utilities])."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    opt = _optimizer_for(params, "clip_grad_value_")
    if opt is None:
        return _ORIGINAL["clip_grad_value_"](params, clip_value, foreach=foreach)
    clip_value = float(clip_value)
    if not math.isfinite(clip_value) or clip_value < 0:
        raise ValueError(f"zero_ext: clip_grad_value_: clip_value={clip_value}; pass a finite value >= 0")
    opt.clip_grad_value_(clip_value)


def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
    """torch.nn.utils.clip_grads_with_norm_ (torch's second half of clip_grad_norm_), right on
    zeroified parameters: the factor is folded into the optimizer's next step."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    opt = _optimizer_for(params, "clip_grads_with_norm_")
    if opt is None:
        return _ORIGINAL["clip_grads_with_norm_"](params, max_norm, total_norm, foreach=foreach)
    opt.clip_by_total_norm_(float(max_norm), float(total_norm))


clip_grad_norm_._zero_ext_torch = _ORIGINAL["clip_grad_norm_"]
clip_grad_value_._zero_ext_torch = _ORIGINAL["clip_grad_value_"]
if "clip_grads_with_norm_" in _ORIGINAL:
    clip_grads_with_norm_._zero_ext_torch = _ORIGINAL["clip_grads_with_norm_"]


def install() -> None:
    """Route torch's clipping functions through this module (idempotent)."""
    for module in (nn_utils, clip_grad_module):
        module.clip_grad_norm_ = clip_grad_norm_
        module.clip_grad_value_ = clip_grad_value_
    if "clip_grads_with_norm_" in _ORIGINAL:
        nn_utils.clip_grads_with_norm_ = clip_grads_with_norm_
