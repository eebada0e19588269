"""The wrapped optimizer's complete state, in torch's format: what DDP's optimizer gives.

Note [Complete optimizer state]
  DDP scripts save `optimizer.state_dict()` (often on rank 0 alone) and resume with
  `optimizer.load_state_dict(torch.load(path))` on every rank. state_dict() assembles
  the dict a plain torch optimizer would hold, bucket by bucket (collective; a rank
  calling it alone reads from the shard servers: Note [Shard server] in
  zero_ext/alone/serving.py). load_state_dict() takes it, or a plain torch run's, at
  any world size and stage: each rank copies its fragments, no collective.
  "zero_ext_complete" adds the step counts per group, the loss scaler and, with a low
  param_dtype, "master_weights" (the fp32 masters by state_dict key), so the pair
  resumes bit for bit when the model's state is loaded first.
"""
from __future__ import annotations

import torch

from .checkpoint import consolidated_state_dict
from .checkpoint.entries import prepare_states, restore_scalars
from .checkpoint.layout import layout_of, whole_tensors
from ._C import PHASE_OPTIM_STATE
from .local_shard import LocalShard

EXTRA = "zero_ext_complete"


def _model_of(optimizer):
    model = optimizer.guard.wrapper if optimizer.guard is not None else None
    if model is None:
        raise RuntimeError("zero_ext: the model zeroify() returned with this optimizer no longer exists; "
                           "keep a reference to it while the optimizer is in use")
    return model


def state_dict(optimizer, part: int | None = None) -> dict:
    """The complete torch state dict (of wrapped optimizer `part`, when several), on every rank."""
    model = _model_of(optimizer)
    low = optimizer.config.param_dtype != "fp32"
    both = consolidated_state_dict(model, optimizer, to=None, model_state=low, phase=PHASE_OPTIM_STATE)
    full = both["optimizer"]
    if isinstance(full, list):
        full = full[0 if part is None else part]
    groups = range(len(optimizer.param_groups)) if part is None else optimizer.parts[part].groups
    full[EXTRA] = {"steps": [optimizer.group_steps[gi] for gi in groups], "loss_scaler": optimizer.scaler_state_dict(),
                   "skipped_steps": optimizer.skipped_steps}
    if low:
        layout = layout_of(model, optimizer)
        mine = {n for n, info in layout["params"].items() if info["group"] in set(groups)}
        full[EXTRA]["master_weights"] = {k: t for k, t in both["model"].items() if layout["keys"].get(k) in mine}
    return full


def _check(sd: dict, layout: dict, groups: list) -> None:
    """torch's own checks, with the names: group count and sizes, state shapes."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        got = sorted(map(str, sd))[:5] if isinstance(sd, dict) else type(sd).__name__
        raise ValueError(f"zero_ext: load_state_dict takes an optimizer state dict ({{'state', 'param_groups'}}), "
                         f"got {got}; pass what optimizer.state_dict() (this one's, or a plain torch optimizer's) "
                         f"returned, not a model's state dict or a checkpoint holding it")
    saved = sd["param_groups"]
    if len(saved) != len(groups):
        raise ValueError(f"zero_ext: the state dict has {len(saved)} param groups, this optimizer "
                         f"{len(groups)}; build the optimizer with the same param groups as the one saved")
    for k, (gi, g) in enumerate(zip(groups, saved)):
        have = len(layout["groups"][gi])
        if len(g["params"]) != have:
            raise ValueError(f"zero_ext: param group {k} of the state dict has {len(g['params'])} parameters, "
                             f"this optimizer's has {have} ({', '.join(layout['groups'][gi][:3])}...); build "
                             f"the optimizer over the same parameters, in the same order, as the one saved")


def load_state_dict(optimizer, sd: dict, part: int | None = None) -> None:
    """Load a complete torch-format state dict on this rank (no collective)."""
    engine = optimizer.engine
    engine.wait_reductions()
    layout = layout_of(_model_of(optimizer), optimizer)
    groups = list(range(len(optimizer.param_groups))) if part is None else list(optimizer.parts[part].groups)
    _check(sd, layout, groups)
    index = dict(enumerate(n for gi in groups for n in layout["groups"][gi]))   # torch's index -> name
    by_name: dict = {}
    shapes = {n: tuple(info["shape"]) for n, info in layout["params"].items()}
    # whole tensors (Muon, Adafactor) keep their torch optimizer's own state, of any shape
    whole_groups = {gi for p in optimizer.parts if p.kind == "whole" for gi in p.groups}
    flat = {n for n, info in layout["params"].items() if info["group"] not in whole_groups}
    for k, st in sd["state"].items():
        k = int(k)
        if k not in index:
            raise ValueError(f"zero_ext: the state dict has state for parameter {k}, but its param groups number "
                             f"only {len(index)} parameters; the state dict is damaged or edited: load one that "
                             f"optimizer.state_dict() returned, unedited")
        name = index[k]
        if name not in shapes:
            continue                                        # frozen here: no state, as torch skips it
        for key, t in st.items():
            if name in flat and torch.is_tensor(t) and t.dim() > 0 and tuple(t.shape) != shapes[name]:
                raise ValueError(f"zero_ext: state {key!r} of parameter {name!r} has shape {tuple(t.shape)}, "
                                 f"the parameter {shapes[name]}; the state dict is of another model: load one "
                                 f"saved from this model (the same shapes), or build the model that was saved")
        by_name[name] = st
    names = list(layout["params"])                          # engine order
    mine = set(groups)
    in_part = [layout["params"][n]["group"] in mine for n in names]
    shard = LocalShard(optimizer)
    # per-element states: every rank copies its fragments; no state (never stepped) is zero
    per_elem = sorted({key for n, st in by_name.items() if n in flat for key, t in st.items()
                       if torch.is_tensor(t) and t.dim() > 0})
    whole_kind = {i for i, a in enumerate(shard.atomic) if a}
    states = {}
    if any(gi not in whole_groups for gi in groups):   # a whole-tensor part alone leaves the flat states be
        if shard.views is None:
            for t in engine.states().values():
                t.zero_()
        states = prepare_states(optimizer, shard, per_elem) if per_elem else {}
    extra = sd.get(EXTRA) or {}
    masters = extra.get("master_weights") if optimizer.config.param_dtype != "fp32" else None
    by_key = {layout["keys"][k]: t for k, t in (masters or {}).items() if k in layout["keys"]}
    with torch.no_grad():
        for f in shard.fragments:
            name, cut = names[f.param], slice(f.param_offset, f.param_offset + f.numel)
            if not in_part[f.param]:
                continue
            if name in by_key:
                f.master.copy_(by_key[name].reshape(-1)[cut])
            for key in per_elem if f.param not in whole_kind else ():
                t = by_name.get(name, {}).get(key)
                if t is not None:
                    shard.piece(states[key], f).copy_(t.reshape(-1)[cut])
    # step counts: torch keeps one per parameter ("step"); SGD keeps none, so a parameter
    # with state took its group's count (ours) or at least one step (a plain torch state)
    saved_steps = extra.get("steps")
    steps = optimizer.param_step_counts()
    for i, name in enumerate(names):
        st = by_name.get(name, {})
        if in_part[i] and st.get("step") is not None:
            steps[i] = int(st["step"])
        elif in_part[i]:
            gi = layout["params"][name]["group"]
            steps[i] = saved_steps[groups.index(gi)] if saved_steps and st else int(bool(st))
    group_steps = list(optimizer.group_steps)
    for k, gi in enumerate(groups):
        group_steps[gi] = int(saved_steps[k]) if saved_steps else max(
            (s for s, n in zip(steps, names) if layout["params"][n]["group"] == gi), default=0)
        optimizer.param_groups[gi].update({key: v for key, v in sd["param_groups"][k].items() if key != "params"})
    optimizer.group_steps = group_steps
    engine.set_param_steps(steps)
    if shard.views is not None:                            # generic torch optimizer over shard views
        scalar = {}
        for name, st in by_name.items():
            gi = layout["params"][name]["group"]
            scalar.setdefault(gi, {k: (t.clone() if torch.is_tensor(t) else t) for k, t in st.items()
                                   if not (torch.is_tensor(t) and t.dim() > 0)})
        restore_scalars(optimizer, shard, {"scalar_state": scalar, "steps": group_steps})
    for name, opt, view in whole_tensors(optimizer, layout):   # whole tensors: their owner
        if layout["params"][name]["group"] not in mine:
            continue
        opt.state.pop(view, None)
        if name in by_name:
            opt.state[view] = {k: (t.detach().clone().to(view.device) if torch.is_tensor(t) else t)
                               for k, t in by_name[name].items()}
    if masters:
        engine.publish_params()
    if extra:
        optimizer.load_scaler_state_dict(extra.get("loss_scaler"))
        optimizer.skipped_steps = int(extra.get("skipped_steps", 0))
