"""Stage 3 built sharded: a model constructed on the meta device is given real
(but untouched) CPU parameters, handed to the engine, which keeps only shards,
and is then initialized one unit at a time, so a rank never holds much more than
one full unit beside its shards.

Initialization replays building the model on the CPU (each module's
reset_parameters(), children before parents) and then, if given,
model.apply(init_fn). With the same seed, the result equals the unsharded model
built and initialized that way. An init that reaches into other modules'
parameters from a parent's __init__ is not replayed: move it into init_fn. The root unit stays whole throughout;
every unit is broadcast from rank 0 as it is finished, so all ranks agree.
"""
from __future__ import annotations

import collections

import torch
from torch import nn


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers())


def replace_meta(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Swap every meta parameter/buffer for an uninitialized CPU one (pages not yet
    touched, so no memory is resident), keeping ties and the optimizer's references."""
    new: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                m._parameters[name] = new[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)
    for g in optimizer.param_groups:
        g["params"] = [new.get(id(p), p) for p in g["params"]]
    # the optimizer also indexes its (empty) state by parameter
    optimizer.state = collections.defaultdict(dict, {new.get(id(p), p): s for p, s in optimizer.state.items()})


def _post_order(m: nn.Module):
    for c in m.children():
        yield from _post_order(c)
    yield m


def _by_unit(model: nn.Module, engine, unit_of: dict, fn) -> None:
    """Run fn(module) over the modules in model.apply order with each module's
    units whole; publish (broadcast from rank 0) and free each unit once done."""
    engine.open_unit_fp32(0)
    whole = {0}
    seen = set()
    for m in _post_order(model):
        if id(m) in seen:
            continue
        seen.add(id(m))
        need = {unit_of[id(p)] for p in m.parameters(recurse=False) if id(p) in unit_of}
        for u in sorted(whole - need - {0}):           # finished: publish and free
            engine.commit_unit(u, 0)
            engine.release_unit(u)
            whole.discard(u)
        for u in sorted(need - whole):
            engine.open_unit_fp32(u)   # full precision even with a low param_dtype
            whole.add(u)
        fn(m)
    for u in sorted(whole):
        engine.commit_unit(u, 0)
        engine.release_unit(u)


@torch.no_grad()
def initialize_by_unit(model: nn.Module, engine, unit_of: dict, init_fn=None) -> None:
    """Replays what building the model on the CPU and then calling
    model.apply(init_fn) does: (1) each module's reset_parameters(), as its
    constructor ran it, where a parameter tied to an earlier module keeps that
    module's values (the later module's own weight was replaced by the tie, but
    its random draws still happened); (2) init_fn over every module, if given.
    unit_of: id(parameter) -> unit for every parameter the engine manages."""
    done: set = set()

    def reset(m):
        own = list(m.parameters(recurse=False))
        keep = {id(p): p.detach().clone() for p in own if id(p) in done}
        if hasattr(m, "reset_parameters") and m is not model:
            m.reset_parameters()
        for p in own:
            if id(p) in keep:
                p.copy_(keep[id(p)])
            done.add(id(p))

    _by_unit(model, engine, unit_of, reset)
    if init_fn is not None:
        _by_unit(model, engine, unit_of, init_fn)
