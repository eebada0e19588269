"""Optimizers that need whole tensors (torch.optim.Muon, torch.optim.Adafactor).

Their update of an element depends on the whole tensor, so the planner gives each tensor
whole to one rank (Note [Tensor-atomic buckets] in csrc/core/zx_core.h), balanced by update
cost. The owner runs the user's torch optimizer over its fp32 master views.
"""
from __future__ import annotations

import math

import torch

from ._C import UPDATE_FACTORED, UPDATE_ORTHOGONALIZED   # zx_update_kind: what one tensor's update costs
WHOLE = {cls: kind for cls, kind in ((getattr(torch.optim, "Muon", None), UPDATE_ORTHOGONALIZED),
                                     (getattr(torch.optim, "Adafactor", None), UPDATE_FACTORED)) if cls is not None}


def update_kind(cls) -> int:
    """0 for an elementwise optimizer class, else its zx_update_kind."""
    return next((kind for c, kind in WHOLE.items() if issubclass(cls, c)), 0)


_STATE_PER_ELEMENT: dict = {}


def state_bytes_per_element(cls, hyper: dict, shape) -> float:
    """Optimizer state bytes per element of a parameter of `shape` under `cls` with group
    hyperparameters `hyper`, as torch allocates it in one step on a zero tensor (meta device
    when the class allows, else CPU). Muon: 4, AdamW: 8, Adafactor on m x n: 4 (m + n) / (m n)."""
    shape = tuple(int(d) for d in shape)
    opts = {k: v for k, v in hyper.items() if k not in ("params", "fused", "foreach", "differentiable")}
    key = (cls, shape, repr(sorted(opts.items())))
    if key not in _STATE_PER_ELEMENT:
        numel = math.prod(shape)
        for device in ("meta", "cpu"):
            p = torch.zeros(shape, device=device, requires_grad=True)
            p.grad = torch.zeros(shape, device=device)
            opt = cls([dict(opts, params=[p])])    # a group: takes any key a group may hold
            try:
                opt.step()
            except RuntimeError:
                if device == "cpu":
                    raise
                continue
            state = opt.state[p]
            _STATE_PER_ELEMENT[key] = sum(v.numel() * v.element_size() for v in state.values()
                                          if torch.is_tensor(v) and v.dim() > 0) / max(numel, 1)
            break
    return _STATE_PER_ELEMENT[key]


def fill_state_sizes(parts, group_dicts: list, params: list, groups: list, stage, world: int) -> list:
    """Per trainable parameter, the state bytes per element the planner balances (Note [Filling
    atomic buckets] in csrc/core/zx_core.h); [] when nothing is filled: stage 0 or 3, one rank,
    no whole-tensor optimizer, or a 'shard' one."""
    if stage not in (1, 2) or world < 2 or not any(p.kind == "whole" for p in parts) \
            or any(p.kind == "shard" for p in parts):
        return []
    cls_of = {gi: part.cls for part in parts for gi in part.groups}
    return [state_bytes_per_element(cls_of[g], {k: v for k, v in group_dicts[g].items() if k != "params"},
                                    p.shape) for p, g in zip(params, groups)]


def owned_states(parts) -> dict:
    """engine parameter index -> a CPU copy of the state of each whole tensor this rank owns (by
    index: a rank serving it may have dropped its model)."""
    return {i: {k: t.detach().cpu().clone() if torch.is_tensor(t) else t
                for k, t in part.opt.state.get(view, {}).items()}
            for part in parts if part.kind == "whole" for i, view in part.owned}

