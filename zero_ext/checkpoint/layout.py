"""The model and optimizer as a checkpoint sees them (names, shapes, param groups, frozen
tensors, whole tensors, step counts), and settling the engine before a checkpoint. This
package never imports zero_ext/optim.py (tests/test_imports.py).
"""
from __future__ import annotations

import torch

from .._C import PHASE_CHECKPOINT
from ..alone import source
from ..gather import OWNER_ATTR
from ..model import ZeroModel


def core_optimizer(optimizer):
    """The ZeroOptimizer behind what zeroify returned (one optimizer, or a list of several)."""
    if isinstance(optimizer, (list, tuple)) and optimizer:
        optimizer = optimizer[0]
    return getattr(optimizer, "zero_optimizer", optimizer)


def layout_of(model, optimizer) -> dict:
    """The model as a checkpoint sees it, alike on every rank: params (trainable name -> shape,
    group; engine order), plain (frozen parameters, buffers -> shape, dtype), keys (state_dict
    key -> stored name; tied ones share), groups (names per param group, in order). Raises
    unless given what zeroify() returned (a ZeroOptimizer is known by its engine and parts:
    importing the class would close a cycle)."""
    opt = core_optimizer(optimizer)
    if not (isinstance(model, ZeroModel) and isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "engine")
            and hasattr(opt, "parts")):
        raise TypeError(f"zero_ext: save/load take the (model, optimizer) pair returned by zeroify(), got "
                        f"({type(model).__name__}, {type(optimizer).__name__}); pass those: "
                        f"model, opt = zero_ext.zeroify(...); zero_ext.save(path, model, opt)")
    optimizer, module = opt, model.module
    names = {id(p): n for n, p in module.named_parameters()}   # a tied parameter: its first name
    shapes = optimizer.param_shapes or [tuple(p.shape) for p in optimizer.engine_params]
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    params = {names[id(p)]: {"shape": list(s), "group": group_of[id(p)]}
              for p, s in zip(optimizer.engine_params, shapes)}
    keys, plain = {}, {}
    guard = model.guard
    logical = {id(p): s for p, s in zip(guard.params, guard.shapes)}   # stage-3 frozen ones are empty here
    for key, t in module.state_dict(keep_vars=True).items():
        name = names.get(id(t), key)
        keys[key] = name
        if name not in params and name not in plain:
            plain[name] = {"shape": list(logical.get(id(t), t.shape)), "dtype": str(t.dtype).replace("torch.", "")}
    groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    parts = [{"optimizer": p.cls.__name__, "groups": list(p.groups), "kind": p.kind} for p in optimizer.parts]
    return {"params": params, "plain": plain, "keys": keys, "groups": groups,
            "optimizer": "+".join(p["optimizer"] for p in parts), "parts": parts}


def settle(model, optimizer, phase: int | None = PHASE_CHECKPOINT, servable: bool = False):
    """(engine, its Comm, layout) once outstanding collectives are done and every rank is here,
    or, servable, this rank knows whether it reads alone (Note [Reading alone] in csrc/engine/away.h)."""
    layout = layout_of(model, optimizer)   # metadata only; it checks the pair first
    optimizer = core_optimizer(optimizer)
    engine = optimizer.engine
    if phase is not None:
        engine.sequence_mark(phase, servable=servable)
    engine.wait_reductions()
    engine.flush_params()
    return engine, optimizer.comm, layout


def saved_objects(optimizer, names: list, shard) -> dict:
    """The hyperparameters, step counts (per parameter: Note [Unused parameters]) and scalar
    state a checkpoint or a consolidated state dict holds."""
    return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            "steps": list(optimizer.group_steps), "param_steps": dict(zip(names, optimizer.param_step_counts())),
            "scalar_state": shard.scalar_state()}


def whole_tensors(optimizer, layout) -> list:
    """(name, the inner torch optimizer, master view) of every whole tensor this rank owns."""
    names = list(layout["params"])
    return [(names[i], part.opt, view) for part in optimizer.parts if part.kind == "whole"
            for i, view in part.owned]


def plain_tensors(model, layout, full: dict | None = None) -> dict:
    """name -> frozen parameter or buffer; full: gather_frozen's values of those stage 3 shards
    (None: left out)."""
    sd = model.module.state_dict(keep_vars=True)
    sharded = {id(p) for p in frozen_in_engine(model)}
    out = {}
    for key, name in layout["keys"].items():
        t = sd[key]
        if name not in layout["plain"] or name in out:
            continue
        if id(t) not in sharded:
            out[name] = t.detach()
        elif full is not None:
            out[name] = full[id(t)]
    return out


def frozen_in_engine(model) -> list:
    """The frozen parameters stage 3 shards, in the engine's frozen order."""
    guard = model.guard
    return guard.params[guard.n_trainable:]


def frozen_units(model):
    """Yields, unit by unit, the frozen parameters stage 3 shards there, whole until the next."""
    engine, frozen = model.engine, frozen_in_engine(model)
    unit_of = {id(p): getattr(p, OWNER_ATTR)[1] for p in frozen}
    src = source(engine.sequence_away)   # as the call's mark settled it (Note [Shard server])
    for u in sorted(set(unit_of.values())):
        was = engine.unit_gathered(u)
        src.unit(model.optimizer, u)
        yield [p for p in frozen if unit_of[id(p)] == u]
        if not was:
            engine.release_unit(u)


@torch.no_grad()
def gather_frozen(model, keep: bool) -> dict:
    """id -> a whole clone of every frozen parameter stage 3 shards (kept only where keep)."""
    return {id(p): p.detach().clone() for params in frozen_units(model) for p in params if keep}


@torch.no_grad()
def write_frozen(model, loaded: dict) -> None:
    """Stage 3: each rank writes its slices of the frozen parameters read whole."""
    guard, engine = model.guard, model.engine
    for j, p in enumerate(frozen_in_engine(model)):
        guard.write(engine, guard.n_trainable + j, p, loaded[id(p)])
