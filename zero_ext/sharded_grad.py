"""What p.grad is on a zeroified model in stages 1-3.

Note [Sharded gradients]
  In stages 2-3 p.grad would be None (the gradient lives sharded in the engine); in
  stage 1 the bucket view, zeros outside the owned part. So, as FSDP2's sharded DTensor,
  from the end of each reducing backward until the next forward p.grad is a ShardedGrad:
  the logical shape and dtype, no storage. It answers what DDP's p.grad (averaged, clip
  factor applied, unscaled) would:
  - whole-tensor reductions: norm (any p), sum, mean, max, min, optionally after abs,
    square or pow(k), and torch._foreach_norm (get_total_norm). Collective: the first
    call after a backward reduces every parameter at once (Note [Collective sequence check]).
  - GradScaler.unscale_'s torch._amp_foreach_non_finite_check_and_unscale_
    (Note [GradScaler on sharded gradients] in zero_ext/amp.py).
  - metadata, .data, .detach(), .float(), zero_() (a no-op), requires_grad_(False).
  Anything else raises ZeroUsageError. The engine swaps the tensors in C++
  (Engine::hide_sharded_grads): a step pays no per-parameter Python.
"""
from __future__ import annotations

import math
import weakref

import torch

from ._C import PHASE_GRAD_STATS
from .amp import unscale_sharded_
from .changes import ZeroUsageError


def _norm_p(args, kwargs, pos: int):
    p = kwargs.get("p", kwargs.get("ord", args[pos] if len(args) > pos else 2))
    return 2.0 if p is None or p == "fro" else float(p)


class GradStats:
    """Per model: every parameter's reduction in one collective, kept until the gradients change."""

    def __init__(self, optimizer):
        self._opt = weakref.ref(optimizer)      # Note [No cycles through C++] (model.py)
        self._cache: dict = {}
        self._generation = None

    def optimizer(self):
        opt = self._opt()
        if opt is None:
            raise ZeroUsageError("zero_ext: the optimizer of this zeroified model no longer exists, so its sharded "
                                 "gradients cannot be read")
        return opt

    def invalidate(self) -> None:
        """The shards changed in place (GradScaler's unscale): computed reductions are stale."""
        self._cache, self._generation = {}, None

    def result(self, index: int, ops: tuple, reduce: tuple) -> torch.Tensor:
        opt = self.optimizer()
        key_state = (opt.engine.grad_generation, opt.grad_multiplier())
        if key_state != self._generation:
            self._cache, self._generation = {}, key_state
        key = (ops, reduce)
        if key not in self._cache:
            self._cache[key] = self._compute(opt, ops, reduce)
        return self._cache[key][index]

    @staticmethod
    def _compute(opt, ops: tuple, reduce: tuple) -> torch.Tensor:
        """Every trainable parameter's reduction, the same on every rank (collective)."""
        eng = opt.engine
        eng.sequence_mark(PHASE_GRAD_STATS)
        eng.wait_reductions()
        if opt.step_control is not None:
            raise ZeroUsageError("zero_ext: reductions of p.grad with the step control on the device (a GPU) would "
                                 "read back its clip factor and loss scale; log optimizer.clip_grad_norm_()'s "
                                 "total norm, or zeroify with step_control=False")
        scale = opt.grad_multiplier()
        kind, p = reduce
        if kind == "norm" and math.isinf(p):   # the largest (least) magnitude
            kind, ops = ("max" if p > 0 else "min"), ops + (("abs",),)
        shards = eng.grad_shards()
        acc = torch.full((len(opt.engine_params),), {"max": -math.inf, "min": math.inf}.get(kind, 0.0),
                         dtype=torch.float64)
        for f in eng.fragment_views(masters=False):   # Note [Fragment views] (csrc/engine/fragment_view.h)
            i = f.param
            v = shards[f.bucket].narrow(0, f.slice_offset, f.numel).to(torch.float64).cpu() * scale
            for op in ops:
                v = v.abs() if op == ("abs",) else v.square() if op == ("square",) else v.pow(op[1])
            if kind == "max":
                acc[i] = torch.maximum(acc[i], v.max())
            elif kind == "min":
                acc[i] = torch.minimum(acc[i], v.min())
            elif kind != "norm":   # sum, mean
                acc[i] += v.sum()
            else:
                acc[i] += (v != 0).sum() if p == 0 else v.abs().pow(p).sum()
        comm = opt.comm
        if comm.world > 1 and eng.partitions > 1:
            op = torch.distributed.ReduceOp
            red = {"max": op.MAX, "min": op.MIN}.get(kind, op.SUM)
            acc = torch.tensor(comm.all_reduce(acc.tolist(), op=red), dtype=torch.float64)
        if kind == "mean":
            acc /= torch.tensor([float(math.prod(s)) or 1.0 for s in opt.param_shapes], dtype=torch.float64)
        elif kind == "norm" and not math.isinf(p) and p not in (0.0, 1.0):
            acc = acc.pow(1.0 / p)
        return acc


class ShardedGrad(torch.Tensor):
    """p.grad of a zeroified parameter in stages 1-3 (Note [Sharded gradients])."""

    @staticmethod
    def __new__(cls, shape, dtype, device, stats: GradStats, index: int, name: str, ops: tuple = ()):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device, requires_grad=False)
        t.zx_stats, t.zx_index, t._zx_name, t._zx_ops = stats, index, name, ops
        return t

    def __repr__(self, *, tensor_contents=None):
        return (f"ShardedGrad(parameter={self._zx_name!r}, shape={tuple(self.shape)}, dtype={self.dtype}: the "
                f"gradient lives sharded across the ranks; its norm, sum and max are collective)")

    def _with(self, op) -> "ShardedGrad":
        return ShardedGrad(self.shape, self.dtype, self.device, self.zx_stats, self.zx_index, self._zx_name,
                           self._zx_ops + (op,))

    def _reduce(self, kind: str, p: float = 2.0) -> torch.Tensor:
        value = self.zx_stats.result(self.zx_index, self._zx_ops, (kind, p))
        return value.to(torch.float32 if self.dtype == torch.float32 else self.dtype).to(self.device)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if func is torch._amp_foreach_non_finite_check_and_unscale_:   # GradScaler.unscale_
            return unscale_sharded_(*args, **kwargs)   # Note [GradScaler on sharded gradients] (zero_ext/amp.py)
        if func is torch._foreach_norm:
            tensors, p = args[0], _norm_p(args, kwargs, 1)
            return [t._reduce("norm", p) if isinstance(t, ShardedGrad) else torch.linalg.vector_norm(t, p)
                    for t in tensors]
        self = args[0] if args and isinstance(args[0], ShardedGrad) else None
        if self is None:
            return _refuse(name, next((a for a in args if isinstance(a, ShardedGrad)), None))
        rest = args[1:]
        whole = all(kwargs.get(k) is None for k in ("dim", "axis")) and not kwargs.get("keepdim")
        if name == "__get__":                      # a property: .data is the gradient, the rest metadata
            if getattr(getattr(func, "__self__", None), "__name__", "") == "data":
                return self
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name in ("detach", "detach_", "float", "zero_", "requires_grad_") or \
                (name == "to" and not any(isinstance(a, (torch.device, str)) for a in rest)):
            return self
        if name in ("abs", "square"):
            return self._with((name,))
        if name in ("pow", "__pow__") and rest and isinstance(rest[0], (int, float)):
            return self._with(("pow", float(rest[0])))
        if name in ("norm", "vector_norm", "linalg_vector_norm", "linalg_norm") and whole and len(rest) <= 1:
            return self._reduce("norm", _norm_p(args, kwargs, 1))
        if name in ("sum", "mean", "amax", "amin", "max", "min") and not rest and whole:
            return self._reduce({"amax": "max", "amin": "min"}.get(name, name))
        if name in ("size", "dim", "numel", "__len__", "nelement", "element_size", "is_floating_point",
                    "is_contiguous", "__format__") or name.startswith("_"):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        return _refuse(name, self)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _refuse(str(func), next((a for a in args if isinstance(a, ShardedGrad)), None))


def _refuse(what: str, g) -> None:
    name = f" of {g._zx_name!r}" if g is not None else ""
    raise ZeroUsageError(
        f"zero_ext: {what} on the gradient{name}: a zeroified model's gradients (stages 1-3) live sharded across "
        f"the ranks (Note [Sharded gradients] in zero_ext/sharded_grad.py). What works on p.grad, on every rank: "
        f"p.grad.norm(p), torch.linalg.vector_norm, sum(), mean(), max(), min(), after abs(), square() or pow(k), and "
        f"torch.nn.utils.get_total_norm / clip_grad_norm_ / clip_grad_value_; for the global norm, "
        f"optimizer.clip_grad_norm_(max_norm) returns it")


def install(optimizer, names: dict) -> None:
    """Give the engine one ShardedGrad per trainable parameter."""
    stats, params = GradStats(optimizer), zip(optimizer.engine_params, optimizer.param_shapes)
    optimizer.engine.set_grad_wrappers([ShardedGrad(shape, p.dtype, p.device, stats, i, names.get(id(p), f"#{i}"))
                                        for i, (p, shape) in enumerate(params)])
