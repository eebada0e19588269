"""Stage 3's units as custom operators in a compiled graph (Note [Stage 3 collectives in
the graph], zero_ext/compiled.py). A Python torch.library prototype, off unless
compiled.UNITS_IN_GRAPH is set: the operators belong in the C++ binding (TORCH_LIBRARY)
once their memory (recomputing gathers in backward) is settled.

  zero_ext::unit_gather(model, unit, anchor) -> flat   the unit's parameters whole, in
      the engine's order, flattened and concatenated (a fresh tensor in param_dtype)
  zero_ext::unit_reduce(model, unit, grad)   -> empty  flat's gradient handed to the
      engine, parameter by parameter (mark_ready_with): the reduction of eager's hooks
  unit_gather's autograd formula is unit_reduce; `anchor` (0 elements, requires grad,
  one per unit) is the edge autograd calls it through. Both are ordered effects, so
  no compiler pass reorders them against each other (every rank issues the same
  collectives in the same order). `model` names a registered Units (a str).
"""
from __future__ import annotations

import itertools
import weakref

import torch

from .gather import OWNER_ATTR

_models: dict[str, weakref.ref] = {}   # Units.id -> its Units (weak: Note [No cycles through C++], model.py)
_ids = itertools.count(1)


class Units:
    """One stage-3 model's units as the operators see them: per unit, its parameters
    (engine index, shape, numel, offset in flat) and the names the module reads them by."""

    def __init__(self, wrapper):
        guard = wrapper.guard
        if len(guard.params) != guard.n_trainable:
            raise NotImplementedError("zero_ext: compiled.UNITS_IN_GRAPH does not take stage 3's sharded frozen "
                                      "parameters yet; leave it False (every unit is gathered before the graph)")
        self.wrapper = weakref.ref(wrapper)
        engine = wrapper.engine
        self.dtype = wrapper.compute_dtype or torch.float32
        self.members = [[] for _ in range(engine.num_units)]   # per unit: (engine index, shape, numel, offset)
        numel = [0] * engine.num_units
        for i in range(guard.n_trainable):
            k = getattr(guard.params[i], OWNER_ATTR)[1]
            n = guard.shapes[i].numel()
            self.members[k].append((i, tuple(guard.shapes[i]), n, numel[k]))
            numel[k] += n
        self.numel = numel
        names: dict[int, list] = {}
        for name, p in wrapper.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        self.names = [[names.get(id(guard.params[i]), []) for i, *_ in m] for m in self.members]
        device = guard.params[0].device
        self.anchors = [torch.zeros(0, device=device, requires_grad=True) for _ in self.members]
        self.gathers = 0   # unit_gather calls run (tests read it)
        self.id = f"zx{next(_ids)}"   # a str: dynamo keeps it a constant (an int may turn symbolic)
        _models[self.id] = weakref.ref(self)

    def views(self) -> dict:
        """Traced: every unit gathered by the operator, its parameters as views of flat, by name."""
        out = {}
        for k, members in enumerate(self.members):
            if not members:   # a root unit holding no parameter
                continue
            flat = torch.ops.zero_ext.unit_gather(self.id, k, self.anchors[k])
            for (i, shape, n, off), names in zip(members, self.names[k]):
                view = flat[off:off + n].view(shape)
                for name in names:
                    out[name] = view
        return out

    # -- what the operators run
    def gather(self, k: int) -> torch.Tensor:
        from .alone import source
        w = self.wrapper()
        engine, params = w.engine, w.guard.params
        was = engine.unit_gathered(k)
        self.gathers += 1
        if not was:
            source(engine.sequence_away).unit(w.optimizer, k)
        flat = torch.cat([params[i].detach().reshape(-1) for i, *_ in self.members[k]])
        if not was:
            engine.release_unit(k)
        return flat

    def reduce(self, k: int, grad: torch.Tensor) -> None:
        w = self.wrapper()
        w.begin_backward()
        for i, _, n, off in self.members[k]:
            w.engine.mark_ready_with(i, grad[off:off + n])


def _units(model: str) -> Units:
    units = _models[model]()
    if units is None:
        raise RuntimeError("zero_ext: a compiled graph ran after its zeroified model was deleted; compile the "
                           "model zeroify() returned while it lives")
    return units


@torch.library.custom_op("zero_ext::unit_gather", mutates_args=())
def unit_gather(model: str, unit: int, anchor: torch.Tensor) -> torch.Tensor:
    return _units(model).gather(unit)


@unit_gather.register_fake
def _(model, unit, anchor):
    units = _units(model)
    return anchor.new_empty(units.numel[unit], dtype=units.dtype)


@torch.library.custom_op("zero_ext::unit_reduce", mutates_args=())
def unit_reduce(model: str, unit: int, grad: torch.Tensor) -> torch.Tensor:
    _units(model).reduce(unit, grad)
    return grad.new_zeros(0, dtype=torch.float32)


@unit_reduce.register_fake
def _(model, unit, grad):
    return grad.new_empty(0, dtype=torch.float32)


def _setup(ctx, inputs, output):
    ctx.model, ctx.unit = inputs[0], inputs[1]


def _backward(ctx, grad):
    return None, None, unit_reduce(ctx.model, ctx.unit, grad)


unit_gather.register_autograd(_backward, setup_context=_setup)
try:   # ordered effects: torch 2.13's custom ops take them
    from torch._library.effects import EffectType
    unit_gather.register_effect(EffectType.ORDERED)
    unit_reduce.register_effect(EffectType.ORDERED)
except (ImportError, AttributeError):
    pass
