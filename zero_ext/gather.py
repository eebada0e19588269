"""zero_ext.gathered_parameters: read (or, with a modifier rank, edit) a zeroified model's full parameters.

    with zero_ext.gathered_parameters(model.module.head, modifier_rank=0):
        if rank == 0:
            model.module.head.weight.zero_()       # every rank sees this afterwards
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

# on each parameter zeroify manages: (weakref to the ZeroModel, unit id); Note [No cycles through C++]
OWNER_ATTR = "_zero_ext_owner"


def _named(where) -> dict:
    """id -> name of the parameters of `where` when it is a module (for messages)."""
    return ({id(p): n for n, p in where.named_parameters(remove_duplicate=False)}
            if isinstance(where, nn.Module) else {})


def _label(p: torch.Tensor, named: dict) -> str:
    return f"parameter {named[id(p)]!r}" if id(p) in named else f"a tensor of shape {tuple(p.shape)}"


@contextlib.contextmanager
def gathered_parameters(params_or_module, modifier_rank: int | None = None):
    """Inside the block the given parameters (a module's, or an iterable of them) are whole on every
    rank. With modifier_rank=r, what rank r wrote to them is written into every rank's shard on exit;
    without it an in-place change raises on exit (and is discarded in stage 3)."""
    params = ([params_or_module] if isinstance(params_or_module, torch.Tensor) else list(
        params_or_module.parameters() if isinstance(params_or_module, nn.Module) else params_or_module))
    owned = [(p, getattr(p, OWNER_ATTR)) for p in params if hasattr(p, OWNER_ATTR)]
    replicated = [p for p in params if not hasattr(p, OWNER_ATTR) and not p.requires_grad]
    if len(owned) + len(replicated) != len(params) or not owned:
        named = _named(params_or_module)
        strays = [p for p in params if not hasattr(p, OWNER_ATTR) and p.requires_grad]
        what = (f"{_label(strays[0], named)}, which no zeroified optimizer trains" if strays else
                "only frozen parameters, which zeroify() does not manage")
        raise ValueError(f"zero_ext: gathered_parameters got {what}; it takes parameters of a model returned "
                         f"by zeroify() that its optimizer trains (or frozen ones beside them): pass the model "
                         f"zeroify() returned, one of its submodules (model.module.head) or their parameters")
    owned = [(p, (o[0](), o[1])) for p, o in owned]
    if any(o[0] is None for _, o in owned):
        raise ValueError("zero_ext: the zeroified model these parameters belonged to no longer exists; keep a "
                         "reference to the model zeroify() returned while you use its parameters")
    wrappers = {id(o[0]): o[0] for _, o in owned}
    if len(wrappers) != 1:
        raise ValueError(f"zero_ext: gathered_parameters got parameters of {len(wrappers)} zeroified models at "
                         f"once; it takes one model's at a time: nest one `with gathered_parameters(...)` per model")
    wrapper = next(iter(wrappers.values()))
    engine, world = wrapper.engine, wrapper.engine.world_size
    if modifier_rank is not None and not 0 <= modifier_rank < world:
        raise ValueError(f"zero_ext: gathered_parameters: modifier_rank must be a rank of the model's process "
                         f"group, in [0, {world}), got {modifier_rank}; pass modifier_rank=0 (the rank whose "
                         f"edits to keep), or None to read only")
    stage3 = wrapper.units is not None
    units = sorted({o[1] for _, o in owned}) if stage3 else []
    engine.flush_params()
    was_gathered = {u: engine.unit_gathered(u) for u in units}
    for u in units:
        engine.gather_unit(u, True)
    pinned = wrapper.pinned    # the unit hooks leave them whole (a forward inside needs no collective)
    pinned.update(units)
    if modifier_rank is not None and not stage3:
        engine.join_masters()   # Note [Split master in the engine]: absorb then folds exactly the changed elements
    versions = [p._version for p in params]
    try:
        yield params
    finally:
        changed = any(p._version != v for p, v in zip(params, versions))
        if modifier_rank is not None:
            with torch.no_grad():
                if stage3:
                    for u in units:
                        engine.commit_unit(u, modifier_rank)
                else:
                    engine.broadcast_tensors([p.data for p, _ in owned], modifier_rank)
                    engine.absorb_param_edits()   # low precision: fold the edits into the fp32 master
                engine.broadcast_tensors([p.data for p in replicated], modifier_rank)
        pinned.subtract(units)
        for u in units:
            if not was_gathered[u] and not pinned[u]:
                engine.release_unit(u)
        guard = wrapper.guard
        if guard is not None:          # committed, or refused below: not an edit outside (changes.py)
            guard.accept([p for p, _ in owned])
        if changed and modifier_rank is None:
            named = _named(wrapper.module)
            edited = [_label(p, named) for p, v in zip(params, versions) if p._version != v]
            raise RuntimeError(f"zero_ext: {', '.join(edited[:3])}{' and more' if len(edited) > 3 else ''} "
                               f"{'was' if len(edited) == 1 else 'were'} modified inside gathered_parameters() "
                               f"without a modifier_rank; parameters are read-only there without one (stage 3 "
                               f"discards the change). Pass modifier_rank=<rank whose edits to keep>: "
                               f"`with zero_ext.gathered_parameters(module, modifier_rank=0):`")
