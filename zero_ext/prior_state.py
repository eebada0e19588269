"""The state a torch optimizer already holds when zeroify() wraps it.

Note [State given to zeroify]
  A resuming script often loads its checkpoint into the torch optimizer, then wraps it
  (nanoGPT). zeroify() carries that state into its shards, or says why not.
  - capture(), rank-local before any collective, takes each state_dict() once zero_ext
    can hold it exactly: fused Adam/AdamW/SGD their own states; a 'shard' optimizer one
    scalar state per bucket view, so every parameter of a group must hold state with
    equal scalars; whole-tensor ones (Muon) anything. Per-element states must have the
    parameter's shape. Else a ValueError, raised on every rank by the agreement check.
  - Its summary (parameters with state, least and largest step) joins the agreement
    check, so ranks that loaded different states are named.
  - restore() loads each through the torch-format load_state_dict (Note [Complete
    optimizer state] in zero_ext/optim_state.py), no collective, then clears the retired
    torch optimizer's state, which would keep full-size moments.
"""
from __future__ import annotations

import torch

# what the fused kernels keep per parameter (zero_ext/optim.py, FUSED)
FUSED_STATES = {True: {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, False: {"momentum_buffer"}}


def _step_of(st: dict):
    s = st.get("step")
    return None if s is None else int(s.item() if torch.is_tensor(s) else s)


def _per_element(t) -> bool:
    return torch.is_tensor(t) and t.dim() > 0


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    return a == b


def _check(optimizer, part, trainable: set, names: dict) -> None:
    """Raise ValueError when zero_ext cannot hold `optimizer`'s state exactly."""
    cls = type(optimizer).__name__
    per_param = (f"use Adam, AdamW or SGD (zero_ext keeps their step counts per parameter), or build {cls} afresh "
                 f"(without the loaded state) before zeroify()")
    for gi, g in enumerate(optimizer.param_groups):
        held = [(p, optimizer.state.get(p)) for p in g["params"] if id(p) in trainable]
        with_state = [(p, st) for p, st in held if st]
        if part.kind == "whole" or not with_state:
            continue
        for p, st in with_state:
            name = names.get(id(p), f"of shape {tuple(p.shape)}")
            for key, t in st.items():
                if _per_element(t) and tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"zero_ext: {cls} holds state {key!r} of shape {tuple(t.shape)} for parameter "
                                     f"{name!r} of shape {tuple(p.shape)}: zero_ext shards per-element states by the "
                                     f"parameter's elements, so it cannot carry this one into its shards; load a "
                                     f"state saved from this model, or build {cls} afresh before zeroify()")
            if part.kind == "fused":
                unknown = sorted(k for k, t in st.items() if t is not None and k not in FUSED_STATES[part.adam])
                if unknown:
                    raise ValueError(f"zero_ext: {cls} holds state {unknown} for parameter {name!r}, which zero_ext's "
                                     f"fused {'Adam' if part.adam else 'SGD'} kernel does not keep (it keeps "
                                     f"{sorted(FUSED_STATES[part.adam])}), so zeroify() cannot carry it; zeroify "
                                     f"with fused='never' ({cls} then runs as a torch optimizer over shard views, "
                                     f"keeping its own states), or use the torch class itself")
        if part.kind != "shard":
            continue
        # Note [State given to zeroify]: one scalar state per bucket view, so per param group
        if len(with_state) != len(held):
            bare = next(p for p, st in held if not st)
            raise ValueError(f"zero_ext: {cls} holds state for {len(with_state)} of the {len(held)} trainable "
                             f"parameters of param group {gi} ({names.get(id(bare), 'one')!r} has none): zero_ext "
                             f"runs {cls} over flat shard views that keep one step count per param group, so it "
                             f"cannot carry this state exactly; {per_param}")
        first_p, first = with_state[0]
        for p, st in with_state[1:]:
            for key, t in st.items():
                if not _per_element(t) and not _same(t, first.get(key)):
                    raise ValueError(f"zero_ext: {cls}'s scalar state {key!r} differs between parameters "
                                     f"{names.get(id(first_p))!r} ({first.get(key)!r}) and {names.get(id(p))!r} "
                                     f"({t!r}) of param group {gi}: zero_ext runs {cls} over flat shard views that "
                                     f"keep one per param group, so it cannot carry this state exactly; {per_param}")


def capture(optimizers: list, parts: list, params: list, names: dict) -> tuple[list, tuple]:
    """([each optimizer's state_dict(), or None], a summary for the agreement check)."""
    trainable = {id(p) for p in params}
    states, summary = [], []
    for optimizer, part in zip(optimizers, parts):
        if not any(optimizer.state.values()):
            states.append(None)
            summary.append(None)
            continue
        _check(optimizer, part, trainable, names)
        steps = [_step_of(st) for st in optimizer.state.values() if st]
        steps = [s for s in steps if s is not None] or [0]
        states.append(optimizer.state_dict())
        summary.append((sum(1 for st in optimizer.state.values() if st), min(steps), max(steps)))
    return states, tuple(summary) if any(s is not None for s in summary) else ()


def describe(summary) -> str:
    """One rank's summary, for the agreement check's message."""
    def one(s):
        return "no state" if s is None else \
            f"state for {s[0]} parameters ({f'step {s[1]}' if s[1] == s[2] else f'steps {s[1]} to {s[2]}'})"
    if len(summary) <= 1:
        return one(summary[0] if summary else None)
    return ", ".join(f"optimizer {k}: {one(s)}" for k, s in enumerate(summary))


def restore(zopt, optimizers: list, states: list) -> None:
    """Load each captured state into the ZeroOptimizer's shards, clearing the torch optimizers'."""
    from . import optim_state

    several = len(optimizers) > 1
    for k, (optimizer, sd) in enumerate(zip(optimizers, states)):
        if sd is None:
            continue
        optim_state.load_state_dict(zopt, sd, k if several else None)
        optimizer.state.clear()
