"""Full, unsharded state in torch's own format: consolidate(path) reads a checkpoint offline
(`python -m zero_ext.consolidate`); consolidated_state_dict() assembles it from the live ranks."""
from __future__ import annotations

import math

import torch

from .._C import PHASE_CHECKPOINT
from ..alone import source
from ..local_shard import LocalShard
from .format import (LOAD_EARLIER, OBJECTS, CheckpointError, quiet, read_manifest, read_objects, resolve, steps_of,
                     whole_entries)
from .layout import core_optimizer, gather_frozen, plain_tensors, saved_objects, settle


def optimizer_state_dict(layout: dict, tensors: dict, objects: dict, whole: dict | None = None):
    """A torch.optim state dict of the wrapped class (a list of them for several wrapped
    optimizers) from tensors[state][name], parameter `name`'s full state, and whole[name] =
    {state: tensor} of the whole-tensor optimizers. Parameters are numbered as torch does."""
    parts = layout.get("parts") or [dict(groups=range(len(layout["groups"])), kind="fused",
                                         optimizer=layout["optimizer"])]
    out = [_part_state_dict(layout, part, tensors, whole or {}, objects) for part in parts]
    return out if len(out) > 1 else out[0]


def _part_state_dict(layout: dict, part: dict, tensors: dict, whole: dict, objects: dict) -> dict:
    """The state dict of one wrapped optimizer (its param groups' parameters numbered from 0)."""
    index, state = {}, {}
    groups = [dict(objects["param_groups"][gi], params=[index.setdefault(n, len(index)) for n in layout["groups"][gi]])
              for gi in part["groups"]]
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
                if not scal and part["optimizer"] in ("Adam", "AdamW") and steps > 0:
                    s["step"] = torch.tensor(float(steps))
                if steps > 0 or scal:
                    s.update({st: per[n] for st, per in tensors.items()})
            if s:
                state[index[n]] = s
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def consolidate(path) -> dict:
    """Checkpoint `path` as full tensors, without a process group: {"model": a state_dict,
    "optimizer": a state dict of the wrapped class, "extra", "scheduler", "loss_scaler"}."""
    real = resolve(path)
    m = read_manifest(real)
    sd = {OBJECTS: torch.empty(m["objects_bytes"], dtype=torch.uint8)}
    # a whole tensor's state is under whole/ (Note [State windows] in csrc/engine/fill.cpp)
    whole_groups = {g for part in m.get("parts", []) if part["kind"] == "whole" for g in part["groups"]}
    flat = {kind: [torch.zeros(math.prod(info["shape"])) for info in m["params"].values()]
            for kind in ["model"] + [f"optim/{s}" for s in m["states"]]}
    for kind, full in flat.items():
        for (name, info), t in zip(m["params"].items(), full):
            if t.numel() and (kind == "model" or info["group"] not in whole_groups):
                sd[f"{kind}/{name}"] = t
    for name, info in m["plain"].items():
        sd[f"model/{name}"] = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
    from torch.distributed import checkpoint as dcp
    try:
        whole = whole_entries(real, list(m["params"]))   # whole tensors' states, in the same read
        sd.update({k: t for per in whole.values() for k, t in per.items()})
        with quiet():
            dcp.load(sd, storage_reader=dcp.FileSystemReader(real), no_dist=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"zero_ext: reading checkpoint {real!r} failed ({type(e).__name__}: {e}); "
                              f"{LOAD_EARLIER}") from e
    objects = read_objects(sd[OBJECTS], real)
    whole = {n: {k.split("/")[1]: t for k, t in per.items()} for n, per in whole.items()}
    return dict(_assemble(m, flat, objects, whole, {name: sd[f"model/{name}"] for name in m["plain"]}),
                extra=objects["extra"], scheduler=objects["scheduler"], loss_scaler=objects["loss_scaler"])


def _assemble(layout: dict, flat: dict, objects: dict, whole: dict, plain: dict | None) -> dict:
    """{"model" (unless plain is None), "optimizer"} from flat[kind], each trainable parameter's
    full flat tensor in engine order, and plain: name -> frozen parameter or buffer."""
    full = {kind: {name: t.view(info["shape"]) for (name, info), t in zip(layout["params"].items(), ts)}
            for kind, ts in flat.items()}
    out = {}
    if plain is not None:
        values = {**full["model"], **plain}
        out["model"] = {key: values[name] for key, name in layout["keys"].items()}
    tensors = {kind.removeprefix("optim/"): v for kind, v in full.items() if kind != "model"}
    out["optimizer"] = optimizer_state_dict(layout, tensors, objects, whole)
    return out


@torch.no_grad()
def consolidated_state_dict(model, optimizer, to: int | None = 0, *, model_state: bool = True,
                            phase: int = PHASE_CHECKPOINT):
    """{"model": the full state_dict, "optimizer": a torch.optim state dict of the wrapped class}
    on rank `to` (None: every rank), None elsewhere; every rank calls it, or one alone (served).
    Streamed a bucket at a time. model_state=False: the optimizer's state only."""
    optimizer = core_optimizer(optimizer)
    rank, parts = optimizer.engine.rank, optimizer.engine.partitions
    # one partition: no collective; otherwise a rank alone reads the others' shard servers (Note [Shard server])
    engine, comm, layout = settle(model, optimizer, phase if parts > 1 else None, servable=True)
    src = source(parts > 1 and engine.sequence_away)
    if src.reads_alone and to is not None and to != rank:
        return None   # read alone: nothing to assemble here, and nobody to send it to
    shard = LocalShard(optimizer)
    kinds = {**({"model": shard.masters} if model_state else {}),
             **{f"optim/{s}": p for s, p in shard.states().items()}}
    names = list(layout["params"])   # engine order
    receiving = to is None or rank == to
    out = None
    if receiving:
        numel = [math.prod(layout["params"][name]["shape"]) for name in names]
        src.fits(4 * sum(numel) * len(kinds), "the full model and optimizer state")
        out = {k: [torch.zeros(n) for n in numel] for k in kinds}
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
                for i, poff, off, n in slices[r][b]:
                    out[kind][i].narrow(0, poff, n).copy_(got.narrow(0, off, n))
        del buf
    # whole-tensor states: each owner's, to rank `to` (they are per tensor, not per element)
    whole = optimizer.whole_states()
    if parts > 1:
        whole = src.whole_states(optimizer, whole, to)
    whole = {names[i]: st for i, st in whole.items()}
    frozen = gather_frozen(model, keep=receiving) if model_state else {}
    if not receiving:
        return None
    plain = None
    if model_state:
        plain = {n: t.clone() for n, t in plain_tensors(model, layout).items()}
        plain.update({n: t for n, t in plain_tensors(model, layout, frozen).items() if n not in plain})  # frozen
    return _assemble(layout, out, saved_objects(optimizer, names, shard), whole, plain)

