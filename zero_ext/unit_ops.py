"""Stage 3's units as custom operators in a compiled graph (Note [Stage 3 collectives in
the graph], zero_ext/compiled.py), off unless UNITS_IN_GRAPH.
  zero_ext::unit_gather(model, unit, anchor, after) -> flat: the unit's parameters whole, flat in
      the engine's order; `after` (the unit's input, not read) orders it. Its autograd formula
      (through `anchor`, 0 elements) is zero_ext::unit_reduce(model, unit, grad): the gradient
      handed to the engine. `model`: a Units' id.
"""
from __future__ import annotations

import functools
import itertools
import weakref

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import CheckpointPolicy as Policy, checkpoint, create_selective_checkpoint_contexts

from .gather import OWNER_ATTR

_models: dict[str, weakref.ref] = {}   # Units.id -> its Units (weak: Note [No cycles through C++], model.py)
_ids = itertools.count(1)


class Units:
    """One stage-3 model's units as the operators see them: per unit its module, its parameters
    (engine index, shape, numel, offset in flat) and the names its module reads them by."""

    def __init__(self, wrapper, modules: list):
        guard = wrapper.guard
        if len(guard.params) != guard.n_trainable:
            raise NotImplementedError("zero_ext: compiled.UNITS_IN_GRAPH does not take sharded frozen parameters")
        self.wrapper, self.modules, self.dtype = weakref.ref(wrapper), modules, wrapper.compute_dtype or torch.float32
        self.members = [[] for _ in modules]   # per unit: (engine index, shape, numel, offset)
        self.numel, where = [0] * len(modules), {}
        for i in range(guard.n_trainable):
            k, n = getattr(guard.params[i], OWNER_ATTR)[1], guard.shapes[i].numel()
            where[id(guard.params[i])] = (k, len(self.members[k]))
            self.members[k].append((i, tuple(guard.shapes[i]), n, self.numel[k]))
            self.numel[k] += n
        # per unit: (name in its module, member) of the parameters it owns (not a nested unit's)
        self.names = [[(name, where[id(p)][1]) for name, p in m.named_parameters(remove_duplicate=False)
                       if where.get(id(p), (None,))[0] == k] for k, m in enumerate(modules)]
        self.anchors = [torch.zeros(0, device=guard.params[0].device, requires_grad=True) for _ in modules]
        hooks, cfg = wrapper.units, wrapper.optimizer.config   # a schedule of its own: eager's stays as it was
        self.schedule = type(hooks.schedule)(hooks.numel, cfg.prefetch_depth, cfg.coalesce_numel)
        # unit_gather calls: run, in backward, unit in flight (prefetched); flats' storages (weak), bytes at most
        self.gathers, self.regathers, self.prefetched, self.alive, self.peak = 0, 0, 0, [], 0
        self.id = f"zx{next(_ids)}"   # a str: dynamo keeps it a constant (an int may turn symbolic)
        _models[self.id] = me = weakref.ref(self)   # (weak: the modules hold the partials)
        self._forwards = [functools.partial(_unit_forward, me, k) for k in range(len(modules))]
        self.own = [None] * len(modules)   # a forward set on a unit's module itself, kept meanwhile
        self._context = functools.partial(create_selective_checkpoint_contexts, _recompute_gathers)

    def install(self, on: bool, backward_follows: bool = False) -> None:
        """While a compiled forward runs (traced), each unit's module runs _unit_forward."""
        grad = torch.is_grad_enabled()   # the prefetch learns the graph's gathers (Note [Stage 3 unit sequence])
        self.schedule.begin_pass(grad) if on else self.schedule.end_forward(grad, backward_follows)
        for k, m in enumerate(self.modules):
            if on and self.members[k]:
                self.own[k], m.forward = m.__dict__.get("forward"), self._forwards[k]
            elif not on and m.__dict__.get("forward") is self._forwards[k]:
                del m.forward
                if self.own[k] is not None:
                    m.forward = self.own[k]

    def gather(self, k: int) -> torch.Tensor:
        from .alone import source
        w = self.wrapper()
        engine, params, backward = w.engine, w.guard.params, torch._C._current_graph_task_id() != -1
        if backward:
            w.begin_backward()
        self.gathers, self.regathers = self.gathers + 1, self.regathers + backward
        self.schedule.need(k, backward)
        self.prefetched += source(engine.sequence_away).unit(w.optimizer, k) and not w.pinned[k]   # waits for it
        flat = torch.cat([params[i].detach().reshape(-1) for i, *_ in self.members[k]])
        if not (w.pinned[k] or not backward and self.schedule.kept_after_forward(k)):
            engine.release_unit(k)
        together, launch = self.schedule.ahead(engine, k, backward)   # the next unit(s), in flight
        source(engine.sequence_away).units(w.optimizer, launch, together)   # while this one computes
        self.alive = [(r, n) for r, n in self.alive if r() is not None]
        self.alive.append((weakref.ref(flat.untyped_storage()), flat.nbytes))
        self.peak = max(self.peak, sum(n for _, n in self.alive))
        return flat

    def reduce(self, k: int, grad: torch.Tensor) -> None:
        w = self.wrapper()
        w.begin_backward()
        for i, _, n, off in self.members[k]:
            w.engine.mark_ready_with(i, grad[off:off + n])


def _unit_forward(ref, k: int, *args, **kwargs):
    """Traced: unit k's module's forward reading its parameters as views of the flat gathered
    at this first use, the gather must-recompute (gathered again in backward, not saved)."""
    units = ref()
    module, members = units.modules[k], units.members[k]
    dep = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), units.anchors[k])
    flat = checkpoint(torch.ops.zero_ext.unit_gather.default, units.id, k, units.anchors[k], dep,
                      use_reentrant=False, context_fn=units._context)
    views = {name: flat[members[j][3]:members[j][3] + members[j][2]].view(members[j][1]) for name, j in units.names[k]}
    with _reparametrize_module(module, views):
        return (units.own[k] or functools.partial(type(module).forward, module))(*args, **kwargs)


def _recompute_gathers(ctx, op, *args, **kwargs):
    return Policy.MUST_RECOMPUTE if op is torch.ops.zero_ext.unit_gather.default else Policy.PREFER_SAVE


def _units(model: str) -> Units:
    units = _models[model]()
    if units is None:
        raise RuntimeError("zero_ext: a compiled graph ran after its zeroified model was deleted")
    return units


@torch.library.custom_op("zero_ext::unit_gather", mutates_args=())
def unit_gather(model: str, unit: int, anchor: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    return _units(model).gather(unit)


@unit_gather.register_fake
def _(model, unit, anchor, after):
    return anchor.new_empty(_units(model).numel[unit], dtype=_units(model).dtype)


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
    return None, None, unit_reduce(ctx.model, ctx.unit, grad), None


unit_gather.register_autograd(_backward, setup_context=_setup)
try:   # an ordered effect: torch 2.13's custom ops take them
    from torch._library.effects import EffectType
    unit_reduce.register_effect(EffectType.ORDERED)
except (ImportError, AttributeError):
    pass
