"""What a checkpoint is on disk, and reading it back: the manifest and its checks.

Note [Checkpoint format]
A checkpoint is a torch.distributed.checkpoint (DCP) directory plus a manifest, zero_ext.json.
Every tensor is a logical one, whatever layout wrote it:

    model/<name>          a trainable parameter, flat fp32 (the master), written by each rank
                          as ShardedTensor pieces (its fragments); DCP records offsets.
    optim/<state>/<name>  a per-element optimizer state (exp_avg, ...), the same pieces.
    model/<name>          a frozen parameter or buffer, whole, written by rank 0.
    whole/<state>/<name>  a per-tensor state (Muon, Adafactor), written by its owner.
    zero_ext/objects      torch.save bytes of hyperparameters, step counts, scalar state,
                          scaler, scheduler and `extra` (loaded with weights_only).

A load hands DCP this rank's fragments in the new layout; DCP reads their overlap with the
saved pieces into the shards. The manifest names the model and every file (bytes, CRC32), so
another model's checkpoint or a damaged file is refused on every rank before any read.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
import zlib

import torch

FORMAT = 1
MANIFEST = "zero_ext.json"
LOAD_EARLIER = "load an earlier checkpoint (or a backup copy of this one)"
OBJECTS = "zero_ext/objects"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded, or a save that failed; raised on every rank."""


@contextlib.contextmanager
def quiet():
    """Silence DCP's warnings that ShardedTensor is deprecated (DTensor cannot express uneven
    element-granular pieces) and that it runs without a process group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*")
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def resolve(path) -> str:
    """`path`, or `path`.old after an interrupted save (Note [Atomic save] in zero_ext/checkpoint/saving.py)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(os.path.join(path, MANIFEST)) and os.path.exists(os.path.join(path + ".old", MANIFEST)):
        return path + ".old"
    return path


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint `path`, every file it lists checked (present, size, CRC32)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"zero_ext: no checkpoint at {path!r} (no such directory); pass the directory that "
                              f"zero_ext.save(path, model, optimizer) wrote")
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise CheckpointError(f"zero_ext: {path!r} is not a complete zero_ext checkpoint: its manifest {MANIFEST} "
                              f"is missing (an interrupted save leaves its files in <path>.tmp and the previous "
                              f"checkpoint in place; was this written by zero_ext.save?)")
    try:
        with open(mpath) as f:
            m = json.load(f)
        files = m["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"zero_ext: the manifest {mpath!r} is corrupt ({e}); {LOAD_EARLIER}") from None
    if m.get("format") != FORMAT:
        raise CheckpointError(f"zero_ext: checkpoint {path!r} has format {m.get('format')!r}; this zero_ext "
                              f"reads format {FORMAT}: load it with the zero_ext version that wrote it")
    for name, info in files.items():
        fp = os.path.join(path, name)
        who = f" (the shard written by rank {name[2:].split('_')[0]})" if name.endswith(".distcp") else ""
        if not os.path.exists(fp):
            raise CheckpointError(f"zero_ext: checkpoint {path!r} is incomplete: file {name!r}{who} is missing; "
                                  f"copy it back if you have it, or {LOAD_EARLIER}")
        size = os.path.getsize(fp)
        if size != info["bytes"]:
            what = "truncated" if size < info["bytes"] else "longer than written"
            raise CheckpointError(f"zero_ext: checkpoint {path!r} is damaged: file {name!r}{who} is {what} "
                                  f"({size} bytes, {info['bytes']} were written); {LOAD_EARLIER}")
        crc = file_crc32(fp)
        if crc != info["crc32"]:
            raise CheckpointError(f"zero_ext: checkpoint {path!r} is corrupt: file {name!r}{who} has CRC32 "
                                  f"{crc:08x}, {info['crc32']:08x} was written; {LOAD_EARLIER}")
    return m


def mismatch(m: dict, layout: dict, path: str) -> str | None:
    """Why checkpoint manifest `m` does not fit the model/optimizer `layout`, or None."""
    problems = []
    for kind, label in (("params", "trainable parameters"), ("plain", "frozen parameters/buffers")):
        saved, here = m[kind], layout[kind]
        missing = [n for n in here if n not in saved]
        unexpected = [n for n in saved if n not in here]
        shapes = [f"{n} {tuple(saved[n]['shape'])} saved, {tuple(here[n]['shape'])} here"
                  for n in here if n in saved and saved[n]["shape"] != here[n]["shape"]]
        for what, found in (("not in the checkpoint", missing),
                            ("of the checkpoint not in this model", unexpected)):
            if found:
                problems.append(f"{label} {what}: {found[:5]}{' ...' if len(found) > 5 else ''}")
        if shapes:
            problems.append("shapes differ: " + "; ".join(shapes[:5]))
    if problems:
        return (f"zero_ext: checkpoint {path!r} is of another model: " + " | ".join(problems)
                + ". Build the same model as the one saved")
    if m["optimizer"] != layout["optimizer"]:
        return (f"zero_ext: checkpoint {path!r} holds {m['optimizer']} state; this optimizer is "
                f"{layout['optimizer']}. Wrap the same optimizer class")
    if m["groups"] != layout["groups"]:
        return (f"zero_ext: checkpoint {path!r} has param groups {[len(g) for g in m['groups']]} (parameters per "
                f"group) that differ from this optimizer's {[len(g) for g in layout['groups']]}; build the optimizer "
                f"with the same param groups")
    return None


def read_objects(t: torch.Tensor, path: str) -> dict:
    try:
        return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"zero_ext: the saved objects of checkpoint {path!r} cannot be read ({e}); "
                              f"{LOAD_EARLIER}") from e


def steps_of(objects: dict, name: str, group: int) -> int:
    """A parameter's step count; a checkpoint without per-parameter counts has its group's."""
    return int(objects.get("param_steps", {}).get(name, objects["steps"][group]))


def whole_entries(real: str, names: list) -> dict:
    """name -> {"whole/<state>/<name>": an empty tensor to load into} for whole tensors `names`."""
    from torch.distributed import checkpoint as dcp
    md = dcp.FileSystemReader(real).read_metadata().state_dict_metadata
    wanted, out = set(names), {}
    for key, meta in md.items():
        if key.startswith("whole/"):
            name = key.split("/", 2)[2]
            if name in wanted:
                out.setdefault(name, {})[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    return out
