"""save(): every rank writes its shard; rank 0 finishes the checkpoint atomically.

Note [Atomic save]
Ranks write into the sibling directory <path>.tmp; rank 0 checksums the files, writes the
manifest last, renames <path> to <path>.old and <path>.tmp to <path>, and removes <path>.old.
A crash before the first rename leaves <path> untouched; one between the renames leaves a
complete <path>.old, which load() falls back to. A directory without a manifest never loads.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import torch

from .entries import LocalShard, as_fp32, sharded_entries
from .format import FORMAT, MANIFEST, OBJECTS, CheckpointError, file_crc32, quiet
from .layout import core_optimizer, gather_frozen, plain_tensors, saved_objects, settle, whole_tensors


def save(path, model, optimizer, extra=None, *, scheduler=None) -> None:
    """Write zeroify's `model` and `optimizer` to directory `path`, every rank its shard; it loads
    at any world size and stage (Note [Checkpoint format]) and replaces `path` atomically.
    `extra`: plain data load() returns; `scheduler`: an LR scheduler (or a list) saved too."""
    path = os.path.abspath(os.fspath(path))
    optimizer = core_optimizer(optimizer)
    engine, comm, layout = settle(model, optimizer)
    rank = engine.rank
    shard = LocalShard(optimizer)
    states = as_fp32(shard.states())[0]   # bf16 states are written widened to fp32
    tmp = make_tmp(comm, rank, path)
    names = list(layout["params"])   # engine order
    kinds = {"model": shard.masters, **{f"optim/{s}": p for s, p in states.items()}}
    with quiet():
        sd = sharded_entries(shard, names, kinds, writing=True)
    for name, opt, view in whole_tensors(optimizer, layout):   # the owner writes them
        if engine.partitions == 1 and rank != 0:
            break
        for k, t in opt.state.get(view, {}).items():
            sd[f"whole/{k}/{name}"] = t if torch.is_tensor(t) else torch.tensor(t)
    full = gather_frozen(model, keep=rank == 0)
    if rank == 0:
        scaler = getattr(optimizer, "loss_scaler", None)
        many = isinstance(scheduler, (list, tuple))
        objects = dict(saved_objects(optimizer, names, shard), extra=extra,
                       scheduler=[s.state_dict() for s in scheduler] if many else
                       None if scheduler is None else scheduler.state_dict(),
                       loss_scaler=scaler.state_dict() if scaler is not None else None)
        buf = io.BytesIO()
        torch.save(objects, buf)
        sd[OBJECTS] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        sd.update({f"model/{n}": t for n, t in plain_tensors(model, layout, full).items()})
    del full
    try:
        from torch.distributed import checkpoint as dcp
        with quiet():
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True),
                     process_group=comm.pg, no_dist=comm.pg is None)
    except Exception as e:  # noqa: BLE001 - DCP raises the same failure on every rank
        raise CheckpointError(f"zero_ext: saving checkpoint {path!r} failed on rank {rank} ({type(e).__name__}: "
                              f"{e}); another rank may have died. The previous checkpoint at {path!r}, if any, "
                              f"is untouched: fix what the first failing rank's log names, then save again") from e

    error = None
    if rank == 0:
        try:
            files = {f: {"bytes": os.path.getsize(os.path.join(tmp, f)), "crc32": file_crc32(os.path.join(tmp, f))}
                     for f in sorted(os.listdir(tmp))}
            manifest = dict(layout, format=FORMAT, stage=model.stage, world_size=engine.world_size,
                            partitions=engine.partitions, torch=torch.__version__, states=sorted(states),
                            objects_bytes=int(sd[OBJECTS].numel()), files=files)
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            replace_file(tmp, path)
        except OSError as e:
            error = (f"zero_ext: finishing checkpoint {path!r} failed: {e}; free disk space or fix the permissions, "
                     f"then save again (the previous checkpoint, if any, is untouched)")
    decide(comm, error)


def make_tmp(comm, rank: int, path: str) -> str:
    """Rank 0 makes <path>.tmp afresh (Note [Atomic save]); every rank learns whether it could."""
    tmp, error = path + ".tmp", None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = f"zero_ext: cannot create {tmp!r} to save into: {e}; save to a directory you can write to"
    decide(comm, error)
    return tmp


def decide(comm, error: str | None):
    """Rank 0's verdict reaches every rank: all raise the same error or none does."""
    error = comm.broadcast_object(error, src=0)
    if error is not None:
        raise CheckpointError(error)


def replace_file(tmp: str, path: str) -> None:
    """Note [Atomic save]: <path>.tmp becomes <path>."""
    old = path + ".old"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(os.path.dirname(path))
    shutil.rmtree(old, ignore_errors=True)


def fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
