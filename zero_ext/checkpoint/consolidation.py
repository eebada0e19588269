"""Full, unsharded state in torch's own format: consolidate(path) reads a checkpoint
offline (no process group; `python -m zero_ext.consolidate`), consolidated_state_dict()
assembles it from the live ranks (collective); both give torch.optim state dicts of
the wrapped class."""
from __future__ import annotations

import math

import torch

from .._C import PHASE_CHECKPOINT
from ..alone import source
from ..local_shard import LocalShard
from .format import (LOAD_EARLIER, OBJECTS, CheckpointError, read_objects, quiet, steps_of, whole_entries, read_manifest,
                     resolve)
from .layout import gather_frozen, param_steps, plain_tensors, settle, core_optimizer

_ADAM_FAMILY = ("Adam", "AdamW")


def optimizer_state_dict(layout: dict, tensors: dict, objects: dict, whole: dict | None = None):
    """A torch.optim state dict for the wrapped class from per-parameter full tensors:
    tensors[state][name] = the state of trainable parameter `name`, shaped like it.
    Parameters are numbered across param groups in order, as torch numbers them.
    With several wrapped optimizers or one that needs whole tensors: one state dict
    per wrapped optimizer (a list when there are several), whole[name] = {state:
    tensor} giving the whole-tensor optimizers' states."""
    parts = layout.get("parts") or [dict(groups=range(len(layout["groups"])), kind="fused",
                                         optimizer=layout["optimizer"])]
    out = [_part_state_dict(layout, part, tensors, whole or {}, objects) for part in parts]
    return out if len(out) > 1 else out[0]


def _numbered(layout: dict, group_ids, objects: dict) -> tuple:
    """(name -> index, param groups): these groups' parameters numbered in order, as torch does."""
    index: dict = {}
    groups = [dict(objects["param_groups"][gi], params=[index.setdefault(n, len(index)) for n in layout["groups"][gi]])
              for gi in group_ids]
    return index, groups


def _part_state_dict(layout: dict, part: dict, tensors: dict, whole: dict, objects: dict) -> dict:
    """The state dict of one wrapped optimizer (its param groups, numbered from 0)."""
    (index, groups), state = _numbered(layout, part["groups"], objects), {}
    for gi in part["groups"]:
        scal = objects["scalar_state"].get(gi)
        for n in layout["groups"][gi]:
            if n not in layout["params"]:
                continue                                   # frozen: no state
            steps = steps_of(objects, n, gi)               # Note [Unused parameters]: a parameter's own
            if part["kind"] == "whole":
                s = {k: t.clone() for k, t in whole.get(n, {}).items()}
            else:
                s = {k: (t.clone() if torch.is_tensor(t) else t) for k, t in (scal or {}).items()}
                if not scal and part["optimizer"] in _ADAM_FAMILY and steps > 0:
                    s["step"] = torch.tensor(float(steps))
                if steps > 0 or scal:
                    s.update({st: per[n] for st, per in tensors.items()})
            if s:
                state[index[n]] = s
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def consolidate(path) -> dict:
    """Read checkpoint `path` into plain full tensors, without a process group:
    {"model": the module's state_dict, "optimizer": a state dict that a plain torch
    optimizer of the wrapped class loads, "extra", "scheduler", "loss_scaler"}."""
    real = resolve(path)
    m = read_manifest(real)
    sd = {OBJECTS: torch.empty(m["objects_bytes"], dtype=torch.uint8)}
    flat = {}
    # a whole tensor's state is under whole/ (Note [State windows] in csrc/engine/fill.cpp)
    whole_groups = {g for part in m.get("parts", []) if part["kind"] == "whole" for g in part["groups"]}
    for name, info in m["params"].items():
        numel = math.prod(info["shape"])
        for kind in ["model"] + [f"optim/{s}" for s in m["states"]]:
            flat[(kind, name)] = torch.zeros(numel)
            if numel and (kind == "model" or info["group"] not in whole_groups):
                sd[f"{kind}/{name}"] = flat[(kind, name)]
    for name, info in m["plain"].items():
        sd[f"model/{name}"] = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
    from torch.distributed import checkpoint as dcp
    try:
        with quiet():
            dcp.load(sd, storage_reader=dcp.FileSystemReader(real), no_dist=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"zero_ext: reading checkpoint {real!r} failed ({type(e).__name__}: {e}); "
                              f"{LOAD_EARLIER}") from e
    objects = read_objects(sd[OBJECTS], real)
    whole = whole_entries(real, list(m["params"]))
    if whole:
        with quiet():
            dcp.load({k: t for per in whole.values() for k, t in per.items()},
                     storage_reader=dcp.FileSystemReader(real), no_dist=True)
    whole = {n: {k.split("/")[1]: t for k, t in per.items()} for n, per in whole.items()}
    values = {name: flat[("model", name)].view(info["shape"]) for name, info in m["params"].items()}
    values.update({name: sd[f"model/{name}"] for name in m["plain"]})
    model_sd = {key: values[name] for key, name in m["keys"].items()}
    tensors = {s: {name: flat[(f"optim/{s}", name)].view(info["shape"]) for name, info in m["params"].items()}
               for s in m["states"]}
    return {"model": model_sd, "optimizer": optimizer_state_dict(m, tensors, objects, whole),
            "extra": objects["extra"], "scheduler": objects["scheduler"], "loss_scaler": objects["loss_scaler"]}


@torch.no_grad()
def consolidated_state_dict(model, optimizer, to: int | None = 0, *, model_state: bool = True,
                            phase: int = PHASE_CHECKPOINT):
    """The full model state_dict and a plain torch.optim state dict of the wrapped
    class, assembled on rank `to` (of the model's process group; None: on every rank):
    {"model", "optimizer"} there, None on the other ranks; every rank calls it, or one
    rank alone (served). Streamed bucket by bucket: besides the result the receiving rank
    holds one bucket at a time. model_state=False: the optimizer's state only."""
    optimizer = core_optimizer(optimizer)
    rank, parts = optimizer.engine.rank, optimizer.engine.partitions
    # stage 0 and one rank hold everything: no collective, so any rank may call it alone;
    # a rank that calls it alone otherwise reads from the others' shard servers (Note [Shard server])
    engine, comm, layout = settle(model, optimizer, phase if parts > 1 else None, servable=True)
    src = source(parts > 1 and engine.sequence_away)
    if src.reads_alone and to is not None and to != rank:
        return None   # read alone: nothing to assemble here, and nobody to send it to
    shard = LocalShard(optimizer)
    states = shard.states()
    kinds = {**({"model": shard.masters} if model_state else {}), **{f"optim/{s}": p for s, p in states.items()}}
    names = list(layout["params"])   # engine order
    receiving = to is None or rank == to
    out = None
    if receiving:
        numel = [math.prod(layout["params"][name]["shape"]) for name in names]
        src.fits(4 * sum(numel) * len(kinds), "the full model and optimizer state")
        out = {k: [torch.zeros(n) for n in numel] for k in kinds}

    def place(kind, pieces, src):
        for i, poff, off, n in pieces:
            out[kind][i].narrow(0, poff, n).copy_(src.narrow(0, off, n))

    if parts == 1:                                   # everything is here (stage 0 / one rank)
        if receiving:
            for kind, pieces in kinds.items():
                for f in shard.fragments:
                    out[kind][f.param].narrow(0, f.param_offset, f.numel).copy_(shard.piece(pieces, f))
    else:
        # rank -> bucket -> the pieces of its slice, for the receiving rank to place
        slices = [engine.bucket_fragments(r) for r in range(parts)] if receiving else None
        # each rank's slice of bucket b, from its owner (src: a broadcast, or its shard server)
        buf = torch.empty(max(m.numel() for m in shard.masters), device=comm.device)
        for b in range(len(shard.masters)):
            own = {kind: shard.full(pieces, b) for kind, pieces in kinds.items()}
            for kind, r, got in src.bucket_slices(optimizer, own, b, to, buf):
                place(kind, slices[r][b], got)
        del buf
    # whole-tensor states: each owner's, to rank `to` (they are per tensor, not per element)
    whole = optimizer.whole_states()
    if parts > 1:
        whole = src.whole_states(optimizer, whole, to)
    whole = {names[i]: st for i, st in whole.items()}
    frozen = gather_frozen(model, keep=receiving) if model_state else {}
    if not receiving:
        return None
    scalar = shard.scalar_state()
    objects = {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
               "steps": list(optimizer.group_steps), "param_steps": param_steps(optimizer, names),
               "scalar_state": scalar}
    tensors = {s: {name: out[f"optim/{s}"][i].view(layout["params"][name]["shape"]) for i, name in enumerate(names)}
               for s in states}
    result = {"optimizer": optimizer_state_dict(layout, tensors, objects, whole)}
    if model_state:
        values = {name: out["model"][i].view(layout["params"][name]["shape"]) for i, name in enumerate(names)}
        values.update({n: t.clone() for n, t in plain_tensors(model, layout).items()})
        values.update({n: t for n, t in plain_tensors(model, layout, frozen).items() if n not in values})  # frozen
        result["model"] = {key: values[name] for key, name in layout["keys"].items()}
    return result

