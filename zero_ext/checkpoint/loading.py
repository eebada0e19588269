"""load(): rank 0 checks the checkpoint, then every rank reads its fragments in the new layout
(DCP reshards) straight into the master and state shards."""
from __future__ import annotations

import torch

from .entries import LocalShard, as_fp32, prepare_states, restore_scalars, sharded_entries
from .format import (OBJECTS, CheckpointError, mismatch, quiet, read_manifest, read_objects, resolve, steps_of,
                     whole_entries)
from .layout import core_optimizer, frozen_in_engine, plain_tensors, settle, whole_tensors, write_frozen


def load(path, model, optimizer, *, scheduler=None):
    """Load checkpoint `path` (saved at any world size and stage) into zeroify's `model` and
    `optimizer` on every rank, scheduler too if given; returns the saved `extra`. Rank 0 checks
    the files and the model first: a CheckpointError is raised on every rank."""
    optimizer = core_optimizer(optimizer)
    engine, comm, layout = settle(model, optimizer)
    rank = engine.rank
    real = resolve(path)
    error, manifest = None, None
    if rank == 0:
        try:
            manifest = read_manifest(real)
            error = mismatch(manifest, layout, real)
        except CheckpointError as e:
            error = str(e)
    # rank 0's verdict and directory hold for every rank
    error, manifest, real = comm.broadcast_object((error, manifest, real), src=0)
    if error is not None:
        raise CheckpointError(error)

    shard = LocalShard(optimizer)
    saved_states = manifest["states"]
    states, narrow_back = as_fp32(prepare_states(optimizer, shard, saved_states))
    names = list(layout["params"])   # engine order
    kinds = {"model": shard.masters, **{f"optim/{s}": states[s] for s in saved_states}}
    with quiet():
        sd = sharded_entries(shard, names, kinds, writing=False)
    # stage-3 frozen parameters are read whole, then each rank keeps its slices
    frozen = {id(p): torch.empty(s, dtype=p.dtype, device=p.device) for p, s in
              zip(frozen_in_engine(model), model.guard.shapes[model.guard.n_trainable:])}
    sd.update({f"model/{n}": t for n, t in plain_tensors(model, layout, frozen).items()})
    sd[OBJECTS] = torch.empty(manifest["objects_bytes"], dtype=torch.uint8)
    from torch.distributed import checkpoint as dcp
    whole = whole_entries(real, [name for name, _, _ in whole_tensors(optimizer, layout)])
    sd.update({k: t for per in whole.values() for k, t in per.items()})
    try:
        with torch.no_grad(), quiet():
            dcp.load(sd, storage_reader=dcp.FileSystemReader(real), process_group=comm.pg, no_dist=comm.pg is None)
    except Exception as e:  # noqa: BLE001 - DCP raises the same failure on every rank
        raise CheckpointError(f"zero_ext: reading checkpoint {real!r} failed on rank {rank} ({type(e).__name__}: "
                              f"{e}); the model and optimizer may be partly loaded: load again or rebuild them") from e
    with torch.no_grad():
        for state, wide in narrow_back:   # bf16 states: the checkpoint's fp32 values, rounded to nearest
            state.copy_(wide)
    del narrow_back
    objects = read_objects(sd[OBJECTS], real)
    write_frozen(model, frozen)
    del frozen

    for g, saved in zip(optimizer.param_groups, objects["param_groups"]):
        g.update(saved)
    optimizer.group_steps = list(objects["steps"])
    engine.set_param_steps([steps_of(objects, n, layout["params"][n]["group"]) for n in names])
    if shard.views is not None:
        restore_scalars(optimizer, shard, objects)
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is not None and objects["loss_scaler"] is not None:
        scaler.load_state_dict(objects["loss_scaler"])
    if scheduler is not None and objects["scheduler"] is not None:
        many = isinstance(scheduler, (list, tuple))
        for s, d in zip(scheduler, objects["scheduler"]) if many else [(scheduler, objects["scheduler"])]:
            s.load_state_dict(d)
    for name, opt, view in whole_tensors(optimizer, layout):
        opt.state.pop(view, None)
        if whole.get(name):
            opt.state[view] = {k.split("/")[1]: t for k, t in whole[name].items()}
    engine.publish_params()
    return objects["extra"]

