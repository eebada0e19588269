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

import functools
import itertools
import weakref

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .gather import OWNER_ATTR

_models: dict[str, weakref.ref] = {}   # Units.id -> its Units (weak: Note [No cycles through C++], model.py)
_ids = itertools.count(1)


class Units:
    """One stage-3 model's units as the operators see them: per unit, its parameters
    (engine index, shape, numel, offset in flat), its module, and the names that module
    reads its own parameters by (a nested unit's are its own; a tied weight under several
    names is one view under each)."""

    def __init__(self, wrapper, modules: list):
        guard = wrapper.guard
        if len(guard.params) != guard.n_trainable:
            raise NotImplementedError("zero_ext: compiled.UNITS_IN_GRAPH does not take stage 3's sharded frozen "
                                      "parameters yet; leave it False (every unit is gathered before the graph)")
        self.wrapper = weakref.ref(wrapper)
        engine = wrapper.engine
        self.dtype = wrapper.compute_dtype or torch.float32
        self.members = [[] for _ in range(engine.num_units)]   # per unit: (engine index, shape, numel, offset)
        numel = [0] * engine.num_units
        index = {}
        for i in range(guard.n_trainable):
            k = getattr(guard.params[i], OWNER_ATTR)[1]
            n = guard.shapes[i].numel()
            index[id(guard.params[i])] = (k, len(self.members[k]))
            self.members[k].append((i, tuple(guard.shapes[i]), n, numel[k]))
            numel[k] += n
        self.numel = numel
        self.modules = modules
        self.names = []   # per unit: (name in its module, member) for the parameters the unit owns
        for k, m in enumerate(modules):
            own = [(name, index[id(p)][1]) for name, p in m.named_parameters(remove_duplicate=False)
                   if index.get(id(p), (None,))[0] == k]
            self.names.append(own)
        device = guard.params[0].device
        self.anchors = [torch.zeros(0, device=device, requires_grad=True) for _ in self.members]
        self.gathers = self.regathers = 0   # unit_gather calls run, those in backward (tests read them)
        self.live = self.peak = 0   # bytes of gathered flats alive now, and their most (tests read it)
        self.id = f"zx{next(_ids)}"   # a str: dynamo keeps it a constant (an int may turn symbolic)
        _models[self.id] = weakref.ref(self)
        me = weakref.ref(self)   # Note [No cycles through C++] (model.py): the modules hold these
        self._forwards = [functools.partial(_unit_forward, me, k) for k in range(len(modules))]
        self._context = functools.partial(create_selective_checkpoint_contexts, _recompute_gathers)

    def install(self) -> None:
        """Before a compiled forward: each unit's module runs _unit_forward (removed after)."""
        for k, m in enumerate(self.modules):
            if self.members[k]:
                m.forward = self._forwards[k]

    def uninstall(self) -> None:
        for k, m in enumerate(self.modules):
            if m.__dict__.get("forward") is self._forwards[k]:
                del m.forward

    # -- what the operators run
    def gather(self, k: int) -> torch.Tensor:
        from .alone import source
        w = self.wrapper()
        engine, params = w.engine, w.guard.params
        if torch._C._current_graph_task_id() != -1:   # recomputed for backward
            w.begin_backward()
            self.regathers += 1
        was = engine.unit_gathered(k)
        self.gathers += 1
        if not was:
            source(engine.sequence_away).unit(w.optimizer, k)
        flat = torch.cat([params[i].detach().reshape(-1) for i, *_ in self.members[k]])
        if not was:
            engine.release_unit(k)
        self.live += flat.nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(flat.untyped_storage(), self._freed, weakref.ref(self), flat.nbytes)
        return flat

    @staticmethod
    def _freed(ref, nbytes: int) -> None:
        units = ref()
        if units is not None:
            units.live -= nbytes

    def reduce(self, k: int, grad: torch.Tensor) -> None:
        w = self.wrapper()
        w.begin_backward()
        for i, _, n, off in self.members[k]:
            w.engine.mark_ready_with(i, grad[off:off + n])


def _unit_forward(ref, k: int, *args, **kwargs):
    """Traced: unit k's module's forward with its parameters replaced by views of the flat
    zero_ext::unit_gather returns at this first use (after the unit's input exists), the
    gather tagged must-recompute (gathered again in backward, not saved)."""
    units = ref()
    module = units.modules[k]
    dep = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), units.anchors[k])
    flat = checkpoint(_gather, units.id, k, units.anchors[k], dep, use_reentrant=False, context_fn=units._context)
    members = units.members[k]
    views = {}
    for name, j in units.names[k]:
        _, shape, n, off = members[j]
        views[name] = flat[off:off + n].view(shape)
    with _reparametrize_module(module, views):
        return type(module).forward(module, *args, **kwargs)


def _gather(model: str, unit: int, anchor: torch.Tensor, dep: torch.Tensor) -> torch.Tensor:
    return torch.ops.zero_ext.unit_gather(model, unit, anchor, dep)


def _recompute_gathers(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE if op is torch.ops.zero_ext.unit_gather.default \
        else CheckpointPolicy.PREFER_SAVE


def _units(model: str) -> Units:
    units = _models[model]()
    if units is None:
        raise RuntimeError("zero_ext: a compiled graph ran after its zeroified model was deleted; compile the "
                           "model zeroify() returned while it lives")
    return units


@torch.library.custom_op("zero_ext::unit_gather", mutates_args=())
def unit_gather(model: str, unit: int, anchor: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    return _units(model).gather(unit)


@unit_gather.register_fake
def _(model, unit, anchor, after):
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
    return None, None, unit_reduce(ctx.model, ctx.unit, grad), None


unit_gather.register_autograd(_backward, setup_context=_setup)
try:   # ordered effects: torch 2.13's custom ops take them
    from torch._library.effects import EffectType
    unit_reduce.register_effect(EffectType.ORDERED)
except (ImportError, AttributeError):
    pass
