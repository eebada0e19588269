"""Stage 3 units: which module subtree each parameter is gathered with.

A unit's parameters are gathered together before its forward (and backward) and released
after. Unit 0, the root, holds those outside every unit or shared by two (tied weights).
"""
from __future__ import annotations

import torch
from torch import nn


def frozen_to_shard(frozen: list, stage, param_dtype: str) -> list:
    """The frozen parameters stage 3 shards (Note [Stage 3 frozen parameters], csrc/engine/frozen.cpp):
    floating-point ones computing in param_dtype (with fp32, a frozen bf16 one stays whole)."""
    return [p for p in frozen if stage == 3 and not p.requires_grad and p.is_floating_point() and p.numel() > 0
            and (param_dtype != "fp32" or p.dtype == torch.float32)]


# Note [Units are called modules]
#   A unit is gathered by hooks on its module's forward (model.py's _UnitHooks), so only a
#   module that is called can be one. Containers without a forward of their own
#   (nn.ModuleList, nn.ParameterDict, ...) never are: once released they would never be
#   gathered again. Automatic selection walks through one to its elements, and counts a
#   never-called child's parameters as its holder's own; unit_modules naming one is refused.
def called(m: nn.Module) -> bool:
    """Whether m has a forward of its own (hooks on it can fire)."""
    return type(m).forward is not nn.Module.forward


def assign_units(model: nn.Module, params: list, unit_modules, unit_numel, min_unit_numel: int):
    """(unit id per parameter of `params`, unit modules with index 0 the model, the other modules
    holding root-unit parameters directly).

    unit_modules: class names (or classes) that form units; None = automatic: walking down
        from the root, a child holding at most `unit_numel` elements (default: a quarter)
        becomes a unit, a larger one is split unless it holds parameters of its own. Units
        under min_unit_numel join the root.
    """
    trainable = {id(p) for p in params}

    def numel(m):
        return sum(p.numel() for p in m.parameters() if id(p) in trainable)

    def direct(m):
        """The trainable parameters m's forward may read without calling a submodule."""
        return [p for p in m.parameters(recurse=False) if id(p) in trainable] + [
            p for c in m.children() if not called(c) for p in direct(c)]

    total = sum(p.numel() for p in params)
    cap = unit_numel if unit_numel is not None else max(total // 4, 1)
    names = None if unit_modules is None else {c if isinstance(c, str) else c.__name__ for c in unit_modules}
    units = [model]

    def visit(m):
        for child in m.children():
            n = numel(child)
            if n == 0:
                continue
            if names is not None:
                if type(child).__name__ in names:
                    if not called(child):
                        raise ValueError(
                            f"zero_ext: unit_modules names {type(child).__name__}, a container without a "
                            f"forward of its own: it is never called, so its parameters could not be gathered "
                            f"before use; name the class of its elements instead (e.g. the transformer block)")
                    units.append(child)
                else:
                    visit(child)
                continue
            if not called(child):   # Note [Units are called modules]
                visit(child)
                continue
            # one holding parameters of its own is not split: nn.MultiheadAttention reads out_proj.weight
            if n <= cap or direct(child) or not any(numel(c) for c in child.children()):
                if n >= min_unit_numel:
                    units.append(child)
            else:
                visit(child)

    visit(model)
    # each parameter's nearest unit ancestor; one seen from two units goes to the root
    index = {id(m): k for k, m in enumerate(units)}
    owner: dict[int, int] = {}

    def walk(m, cur):
        k = index.get(id(m), cur)
        for p in m.parameters(recurse=False):
            if id(p) in trainable:
                owner[id(p)] = k if owner.get(id(p), k) == k else 0
        for c in m.children():
            walk(c, k)

    walk(model, 0)
    used = sorted({owner[id(p)] for p in params} | {0})
    renum = {old: new for new, old in enumerate(used)}
    root_holders = [m for m in model.modules() if m is not model and any(
        owner.get(id(p)) == 0 for p in m.parameters(recurse=False))]
    return [renum[owner[id(p)]] for p in params], [units[k] for k in used], root_holders
