"""An optimizer zeroify() was not given (`model = zeroify(model, stage=S)`, then
`opt = torch.optim.AdamW(model.parameters())`), and the guard naming any other torch
optimizer that steps a zeroified model's parameters.

Note [Adopted optimizers]
  zeroify(model) without an optimizer returns a pending model: the module, unwrapped,
  until its first forward with autograd (one without autograd runs the module). At that
  forward every rank finds the torch optimizers over the module's parameters (in the
  garbage collector's live objects) and zeroifies the module with shallow copies of
  them. The pending model becomes the ZeroModel, and each optimizer its ZeroOptimizer,
  in place: the script, its LR scheduler and GradScaler keep their references.
  The step guard, a global step pre-hook, refuses by name a torch optimizer stepping a
  zeroified model's parameters without zero_ext knowing; zero_ext's own pass at once.
"""
from __future__ import annotations

import contextlib
import gc
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .changes import ZeroUsageError, is_retired
from .gather import OWNER_ATTR

PENDING_ATTR = "_zero_ext_pending"   # on the module's parameters: a weak reference to its PendingModel
MANAGED_ATTR = "managed_by_zero_ext"  # class attribute of the optimizers zeroify returns


class PendingModel(nn.Module):
    """zeroify(model) without an optimizer, until its first forward with autograd."""

    def __init__(self, module: nn.Module, build):
        super().__init__()
        self.module = module
        self._build = build   # build(module, optimizers, into, error): zeroify with the options given
        self._sync = True     # require_backward_grad_sync set before adoption
        ref = weakref.ref(self)
        for p in module.parameters():
            setattr(p, PENDING_ATTR, ref)
        install_step_guard()

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        # disabled here, not at import: importing dynamo costs a second
        torch.compiler.disable(_adopt)(self)
        return type(self).forward(self, *args, **kwargs)   # ZeroModel's now

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    @property
    def require_backward_grad_sync(self) -> bool:
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync = bool(value)

    @contextlib.contextmanager
    def no_sync(self):
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old   # (the ZeroModel's setter, once adopted inside)


def _optimizers_over(module: nn.Module) -> tuple[list, str | None]:
    """The live torch optimizers over the module's parameters, ordered by their first one (the same
    on every rank), and what is wrong with them."""
    order = {id(p): i for i, p in enumerate(module.parameters())}
    gc.collect()   # an optimizer the script dropped is not a candidate
    found = []
    for o in gc.get_objects():
        if issubclass(type(o), torch.optim.Optimizer) and not getattr(type(o), MANAGED_ATTR, False) \
                and not is_retired(o):
            at = [order[id(p)] for g in o.param_groups for p in g["params"] if id(p) in order]
            if at:
                found.append((min(at), o))
    optimizers = [o for _, o in sorted(found, key=lambda t: t[0])]
    if not optimizers:
        return [], ("zeroify(model) was given no optimizer, and no torch optimizer over model.parameters() exists "
                    "at the model's first forward with autograd; build it before training: "
                    "`model = zero_ext.zeroify(model, stage=S)`, then `opt = torch.optim.AdamW(model.parameters())`, "
                    "or pass it: `model, opt = zero_ext.zeroify(model, opt, stage=S)`")
    seen: dict = {}
    for k, o in enumerate(optimizers):
        for g in o.param_groups:
            for p in g["params"]:
                if seen.setdefault(id(p), k) != k:
                    return [], (f"{len(optimizers)} torch optimizers ({', '.join(type(x).__name__ for x in optimizers)}) "
                                f"hold the same parameter (shape {tuple(p.shape)}), so zero_ext cannot tell which one "
                                f"trains it; drop the one you do not step before the first forward, or pass the one "
                                f"you step to zeroify(model, opt, stage=S)")
    return optimizers, None


def _adopt(pending: PendingModel) -> None:
    """Every rank, at the first forward with autograd (Note [Adopted optimizers])."""
    module, build, sync, training = pending.module, pending._build, pending._sync, pending.training
    del pending._build, pending._sync   # not carried into the ZeroModel (become)
    optimizers, error = _optimizers_over(module)
    for p in module.parameters():
        if getattr(p, PENDING_ATTR, None) is not None:
            delattr(p, PENDING_ATTR)
    copies = [_shallow_copy(o) for o in optimizers]
    build(module, copies if len(copies) != 1 else (copies[0] if copies else None),
          (pending, optimizers), error)
    pending.train(training)
    pending.require_backward_grad_sync = sync


def _shallow_copy(optimizer):
    clone = type(optimizer).__new__(type(optimizer))
    torch.optim.Optimizer.__setstate__(clone, {"defaults": optimizer.defaults, "state": optimizer.state,
                                               "param_groups": optimizer.param_groups})
    return clone


def become(obj, cls, *args, **kwargs):
    """obj turned, in place, into cls(*args, **kwargs), keeping its other attributes; an LR
    scheduler's step wrapper is renewed."""
    old = dict(obj.__dict__)
    obj.__dict__.clear()
    obj.__class__ = cls
    cls.__init__(obj, *args, **kwargs)
    for k, v in old.items():
        if k == "step":
            if getattr(v, "_wrapped_by_lr_sched", False):   # torch's LRScheduler counts the steps so
                obj.step = _counted_step(obj)
        elif k in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks") and k in obj.__dict__:
            obj.__dict__[k].update(v)
        elif k not in obj.__dict__:
            obj.__dict__[k] = v
    return obj


def _counted_step(opt):
    ref = weakref.ref(opt)

    def step(*args, **kwargs):
        o = ref()
        o._opt_called = True
        return type(o).step(o, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    return step


_GUARD = []


def install_step_guard() -> None:
    if not _GUARD:
        _GUARD.append(register_optimizer_step_pre_hook(_check_step))


def _check_step(optimizer, args, kwargs) -> None:
    if getattr(type(optimizer), MANAGED_ATTR, False):
        return
    for g in optimizer.param_groups:
        for p in g["params"]:
            owner = getattr(p, OWNER_ATTR, None)
            wrapper = owner[0]() if owner is not None else None
            if wrapper is not None and wrapper.owns_parameter(p):
                raise ZeroUsageError(
                    f"zero_ext: this {type(optimizer).__name__} steps parameters of a zeroified model (shape "
                    f"{tuple(p.shape)}) that zero_ext keeps in its shards, but zeroify() was not given it, so its "
                    f"step would be lost. Step the optimizer zeroify() returned; or build this one before the "
                    f"model's first forward: `model = zero_ext.zeroify(model, stage=S)`, then "
                    f"`opt = torch.optim.{type(optimizer).__name__}(model.parameters(), ...)`; or pass it: "
                    f"`model, opt = zero_ext.zeroify(model, opt, stage=S)`")
            pending = getattr(p, PENDING_ATTR, None)
            if pending is not None and pending() is not None:
                raise ZeroUsageError(
                    f"zero_ext: this {type(optimizer).__name__} steps parameters of a model given to zeroify() "
                    f"that has not run a forward with autograd yet, so zero_ext has not reduced their gradients; "
                    f"run the forward through the model zeroify() returned (`model = zero_ext.zeroify(model, ...)`; "
                    f"`loss = model(x)`), not through the module inside it")
