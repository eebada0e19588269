"""Optimizers that need whole tensors (torch.optim.Muon, torch.optim.Adafactor).

Their update of an element depends on the whole tensor (Newton-Schulz on a
matrix, factored second moments), so an element-granular shard cannot run them.
The planner gives each of their tensors whole to one rank (Note [Tensor-atomic
buckets] in csrc/core/zx_core.h), balanced by update cost, inside equal bucket
slices: gradients still arrive by one reduce-scatter and parameters leave by one
all-gather per bucket. The owner runs the user's torch optimizer class over
its whole tensors (fp32 master views shaped as the parameters); the state exists
only there.

Several torch optimizers given to zeroify() together (the Muon recipe: Muon
over the hidden matrices, AdamW over the rest) share one engine; zeroify returns
one ZeroOptimizerPart per optimizer, each stepping its own param groups.
"""
from __future__ import annotations

import torch

# zx_update_kind (csrc/core/zx_core.h): what one tensor's update costs.
UPDATE_FACTORED, UPDATE_ORTHOGONALIZED = 1, 2
WHOLE = {cls: kind for cls, kind in ((getattr(torch.optim, "Muon", None), UPDATE_ORTHOGONALIZED),
                                     (getattr(torch.optim, "Adafactor", None), UPDATE_FACTORED)) if cls is not None}


def update_kind(cls) -> int:
    """0 for an elementwise optimizer class, else its zx_update_kind."""
    for c, kind in WHOLE.items():
        if issubclass(cls, c):
            return kind
    return 0


_STATE_PER_ELEMENT: dict = {}


def state_bytes_per_element(cls, hyper: dict, shape) -> float:
    """Optimizer state bytes per element of a parameter of `shape` under torch
    optimizer class `cls` with group hyperparameters `hyper`, as torch itself
    allocates it: one step on a zero tensor (meta device when the class allows,
    else CPU), counting every state tensor of one or more dimensions (a scalar
    step count is per tensor, not per element). Muon: 4 (momentum), AdamW: 8,
    Adafactor on an m x n matrix: 4 (m + n) / (m n). The planner balances this
    (Note [Filling atomic buckets] in csrc/core/zx_core.h)."""
    shape = tuple(int(d) for d in shape)
    opts = {k: v for k, v in hyper.items() if k not in ("params", "fused", "foreach", "differentiable")}
    key = (cls, shape, repr(sorted(opts.items())))
    if key not in _STATE_PER_ELEMENT:
        numel = 1
        for d in shape:
            numel *= d
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
    """Per trainable parameter, the optimizer state bytes per element that the
    planner balances by filling the padding of tensor-atomic buckets with pieces of
    element-granular parameters (Note [Filling atomic buckets] in csrc/core/zx_core.h,
    Note [Cut parameters] in csrc/engine/fill.cpp); [] when nothing is filled:
    stage 0 or 3, one rank, no whole-tensor optimizer, or an elementwise one that
    runs as a torch optimizer over shard views rather than as a fused kernel."""
    if stage not in (1, 2) or world < 2:
        return []
    if not any(p.kind == "whole" for p in parts) or any(p.kind == "shard" for p in parts):
        return []
    cls_of = {gi: part.cls for part in parts for gi in part.groups}
    return [state_bytes_per_element(cls_of[g], {k: v for k, v in group_dicts[g].items() if k != "params"},
                                    p.shape) for p, g in zip(params, groups)]


def owned_states(zopt) -> dict:
    """engine parameter index -> a CPU copy of the state of each whole tensor this rank owns.
    Keyed by index, not name: a rank serving it may have dropped its model already."""
    return {i: {k: t.detach().cpu().clone() if torch.is_tensor(t) else t
                for k, t in part.opt.state.get(view, {}).items()}
            for part in zopt._parts if part.kind == "whole" for i, view in part.owned}


def build_whole_optimizer(zopt, part, owned: list) -> None:
    """The inner torch optimizer of a 'whole' part: the part's class over this
    rank's whole tensors (owned: the engine's owned_tensors() of the part's groups,
    fp32 master views with their gradient views), one inner group per param group
    of which this rank owns a tensor."""
    by_group: dict[int, list] = {}
    for i, master, grad in owned:
        master.grad = grad
        by_group.setdefault(zopt._param_group_of[i], []).append((i, master))
    part.inner_ids = sorted(by_group)
    part.owned = [t for gi in part.inner_ids for t in by_group[gi]]
    groups = [dict(zopt._hyper(gi), params=[m for _, m in by_group[gi]]) for gi in part.inner_ids]
    part.opt = part.cls(groups) if groups else None


class ZeroOptimizerPart(torch.optim.Optimizer):
    """One of several torch optimizers given to zeroify() together: its own
    param_groups (the user's dicts, live for LR schedulers), step() over its own
    groups; zero_grad, clip_grad_norm_ (one global norm over every part), stats()
    and the state dicts are the shared ZeroOptimizer's."""

    managed_by_zero_ext = True   # the step guard lets it through (Note [Adopted optimizers])

    def __init__(self, core, optimizer: torch.optim.Optimizer, index: int):
        self._core = None
        # copies, as ZeroOptimizer's: the user's groups and defaults stay as they were
        torch.optim.Optimizer.__init__(self, [dict(g) for g in optimizer.param_groups], dict(optimizer.defaults))
        self.param_groups = optimizer.param_groups
        self._core = core
        self._index = index
        self.wrapped_class = type(optimizer)

    def add_param_group(self, param_group: dict) -> None:
        if self._core is None:                           # Optimizer.__init__ adds the groups
            return super().add_param_group(param_group)
        return self._core.add_param_group(param_group)   # raises, naming the fix

    @torch.no_grad()
    def step(self, closure=None):
        out = self._core._step_parts([self._index], closure)
        if self._core._server is not None:   # Note [Shard server]
            self._core._server[0].step_done(self._core._server[1])
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """This optimizer's gradients only, as torch's zero_grad (the other parts'
        optimizers may still step with theirs)."""
        self._core._zero_grad_part(self._index, set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self._core.clip_grad_norm_(max_norm, norm_type)

    @property
    def _step_supports_amp_scaling(self) -> bool:   # Note [GradScaler on sharded gradients] (zero_ext/amp.py)
        return self._core._step_supports_amp_scaling

    def state_dict(self) -> dict:
        """This optimizer's complete state in torch's format, on every rank (collective;
        Note [Complete optimizer state] in zero_ext/optim_state.py): the state dict the
        plain torch optimizer would hold."""
        from . import optim_state
        return optim_state.state_dict(self._core, self._index)

    def load_state_dict(self, state_dict: dict) -> None:
        """This optimizer's complete state (state_dict() or a plain torch optimizer's), or
        the shared ZeroOptimizer's sharded_state_dict()."""
        if isinstance(state_dict, dict) and "zero_ext" in state_dict:
            return self._core.load_state_dict(state_dict)
        from . import optim_state
        optim_state.load_state_dict(self._core, state_dict, self._index)

    def sharded_state_dict(self) -> dict:
        """This rank's state of every part (the shared ZeroOptimizer's sharded_state_dict)."""
        return self._core.sharded_state_dict()

    def stats(self) -> dict:
        return self._core.stats()

    def synchronize(self) -> None:
        self._core.synchronize()

    @property
    def zero_optimizer(self):
        """The ZeroOptimizer shared by every part (for checkpoints: save/load take it or a part)."""
        return self._core
