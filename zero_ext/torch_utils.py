"""torch's gradient-clipping utilities on a zeroified model's parameters.

Note [torch's clipping utilities]
  torch.nn.utils.clip_grad_norm_(model.parameters(), c) would be silently wrong on a
  zeroified model: p.grad is sharded (stages 1-3) or scaled (loss scaling). So
  `import zero_ext` wraps torch's clip_grad_norm_, clip_grad_value_ and
  clip_grads_with_norm_, under both names torch exports them. A call over none of a
  zeroified model's parameters runs torch's own; over all its trainable ones, the
  optimizer's clipping (what DDP + torch compute); over part of a model, or two
  models, it raises ZeroUsageError. `foreach` is accepted and ignored. A script that
  bound the function before importing zero_ext keeps torch's own.
"""
from __future__ import annotations

import math

import torch
import torch.nn.utils as nn_utils
from torch.nn.utils import clip_grad as clip_grad_module

from .changes import ZeroUsageError
from .gather import OWNER_ATTR

# torch's functions (even should this module be imported twice)
_ORIGINAL = {name: getattr(clip_grad_module, name) for name in ("clip_grad_norm_", "clip_grad_value_")}
if hasattr(nn_utils, "clip_grads_with_norm_"):      # torch >= 2.6
    _ORIGINAL["clip_grads_with_norm_"] = nn_utils.clip_grads_with_norm_
_ORIGINAL = {name: getattr(fn, "_zero_ext_torch", fn) for name, fn in _ORIGINAL.items()}


def _optimizer_for(parameters, what: str):
    """(params, the zeroified optimizer owning them, or None when none is a zeroified model's);
    raises for a partial or mixed set."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = {id(w): w for p in params
              if (owner := getattr(p, OWNER_ATTR, None)) is not None and (w := owner[0]()) is not None}
    if not owners:
        return params, None
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
    return params, opt


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.clip_grad_norm_, right on zeroified parameters (Note [torch's clipping utilities])."""
    params, opt = _optimizer_for(parameters, "clip_grad_norm_")
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
    params, opt = _optimizer_for(parameters, "clip_grad_value_")
    if opt is None:
        return _ORIGINAL["clip_grad_value_"](params, clip_value, foreach=foreach)
    clip_value = float(clip_value)
    if not math.isfinite(clip_value) or clip_value < 0:
        raise ValueError(f"zero_ext: clip_grad_value_: clip_value={clip_value}; pass a finite value >= 0")
    opt.clip_grad_value_(clip_value)


def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
    """torch.nn.utils.clip_grads_with_norm_, right on zeroified parameters."""
    params, opt = _optimizer_for(parameters, "clip_grads_with_norm_")
    if opt is None:
        return _ORIGINAL["clip_grads_with_norm_"](params, max_norm, total_norm, foreach=foreach)
    opt.clip_by_total_norm_(float(max_norm), float(total_norm))


for _fn in (clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_):
    if _fn.__name__ in _ORIGINAL:
        _fn._zero_ext_torch = _ORIGINAL[_fn.__name__]


def install() -> None:
    """Route torch's clipping functions through this module (idempotent)."""
    for module in (nn_utils, clip_grad_module):
        module.clip_grad_norm_ = clip_grad_norm_
        module.clip_grad_value_ = clip_grad_value_
    if "clip_grads_with_norm_" in _ORIGINAL:
        nn_utils.clip_grads_with_norm_ = clip_grads_with_norm_
