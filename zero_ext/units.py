"""Stage 3 units: which module subtree each parameter is gathered with.

A unit is a module whose parameters are all-gathered together before its forward
(and backward) and released after. Unit 0 is the root: parameters outside every
unit, and parameters shared by two units or used outside their unit (tied
weights), which stay gathered from the start of forward to the end of backward.
"""
from __future__ import annotations

import torch
from torch import nn


def frozen_to_shard(frozen: list, stage, param_dtype: str) -> list:
    """Of the parameters outside the optimizer's trainable ones, those stage 3
    shards (Note [Stage 3 frozen parameters], csrc/engine/frozen.cpp): every
    requires_grad=False floating-point one that computes in param_dtype. With fp32
    that keeps only fp32 ones (a frozen bf16 base in an fp32 run stays whole, as in
    stages 0-2, rather than be widened); with a low param_dtype all, as stages 0-2
    cast them too. Other stages: none."""
    if stage != 3:
        return []
    return [p for p in frozen if not p.requires_grad and p.is_floating_point() and p.numel() > 0
            and (param_dtype != "fp32" or p.dtype == torch.float32)]


# Note [Units are called modules]
#   A unit is gathered by hooks on its module's forward (model.py's _UnitHooks), so
#   only a module that is called can be one. Containers without a forward of their
#   own (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict) never are:
#   the module holding them calls their elements or reads their parameters. A
#   ModuleList chosen as a unit (a GPT's blocks are under a quarter of the model
#   when a large tied embedding is most of it) had its storage released after its
#   first backward and never gathered again; the first step only passed because the
#   registration-order guess prefetched it. Automatic selection therefore walks
#   through such a container to its elements, and counts a never-called child's
#   parameters as its holder's own; unit_modules naming one is refused.
def called(m: nn.Module) -> bool:
    """Whether m has a forward of its own (hooks on it can fire)."""
    return type(m).forward is not nn.Module.forward


def assign_units(model: nn.Module, params: list, unit_modules, unit_numel, min_unit_numel: int):
    """Returns (unit id per parameter of `params` (trainable ones and the frozen ones
    stage 3 shards alike), unit modules with index 0 the model,
    the modules other than the model that hold root-unit parameters directly).

    unit_modules: class names (or classes) that form units; None = automatic:
        walking down from the root, a child holding at most `unit_numel` trainable
        elements (default: a quarter of them) becomes a unit, a larger one is split
        into its children unless it holds parameters of its own (then it stays whole).
        Units under min_unit_numel elements join the root. A module that is never
        called (Note [Units are called modules]) is never a unit.
    """
    trainable = {id(p) for p in params}

    def numel(m):
        return sum(p.numel() for p in m.parameters() if id(p) in trainable)

    def direct(m):
        """The trainable parameters m's forward may read without calling a submodule:
        its own and those of its never-called children (an nn.ParameterList), at any depth."""
        return [p for p in m.parameters(recurse=False) if id(p) in trainable] + [
            p for c in m.children() if not called(c) for p in direct(c)]

    total = sum(p.numel() for p in params)
    cap = unit_numel if unit_numel is not None else max(total // 4, 1)
    names = None
    if unit_modules is not None:
        names = {c if isinstance(c, str) else c.__name__ for c in unit_modules}

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
            if not called(child):
                # Note [Units are called modules]: its elements are units of their own;
                # its direct parameters belong to the module that holds it.
                visit(child)
                continue
            # A module holding parameters of its own is not split: its forward may read
            # its children's parameters directly (nn.MultiheadAttention uses
            # out_proj.weight without calling out_proj), so they must be gathered with it.
            own = bool(direct(child))
            has_sub = any(numel(c) for c in child.children())
            if n <= cap or not has_sub or own:
                if n >= min_unit_numel:
                    units.append(child)
            else:
                visit(child)

    visit(model)
    # Nearest unit ancestor of every module registration, then each parameter's
    # owner; a parameter seen from two units goes to the root.
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
    # Renumber so that unit ids are contiguous over units that own parameters.
    used = sorted({owner[id(p)] for p in params} | {0})
    renum = {old: new for new, old in enumerate(used)}
    root_holders = [m for m in model.modules() if m is not model and any(
        owner.get(id(p)) == 0 for p in m.parameters(recurse=False))]
    return [renum[owner[id(p)]] for p in params], [units[k] for k in used], root_holders
