"""Checkpoints that survive a change of world size and stage.

    zero_ext.save("ckpt", model, opt, extra={"step": step}, scheduler=sched)   # every rank
    extra = zero_ext.load("ckpt", model, opt, scheduler=sched)                # any N, any stage
    full = zero_ext.consolidated_state_dict(model, opt, to=0)   # {"model", "optimizer"} on rank 0
    python -m zero_ext.consolidate ckpt full.pt                 # offline, no process group

Note [Checkpoint format]
A checkpoint is a directory written by
torch.distributed.checkpoint (DCP: `.metadata` + one `__<rank>_0.distcp` file per
writing rank) plus our manifest `zero_ext.json`. Every tensor is a *logical* one,
independent of the layout that wrote it:

    model/<name>          trainable parameter, flattened to (numel,) fp32: the master
                          weights. Each rank writes only its fragments (engine.fragments:
                          contiguous pieces of the flattened parameter), as the local
                          shards of a ShardedTensor; DCP records every piece's offset.
    optim/<state>/<name>  a per-element optimizer state (exp_avg, momentum_buffer, ...),
                          the same pieces; only for parameters of elementwise
                          optimizers (a whole tensor's state is under whole/).
    model/<name>          frozen parameter or buffer: a plain tensor of its own shape,
                          written once (by rank 0; they are replicated). Stage 3 shards
                          frozen parameters (Note [Stage 3 frozen parameters]): save
                          gathers them unit by unit onto rank 0 (which then holds them
                          whole until written), load writes each rank's slices from
                          the tensor read; the format is the same in every stage.
    whole/<state>/<name>  a per-tensor state of an optimizer that needs whole tensors
                          (Muon's momentum_buffer, Adafactor's step, row_var, col_var,
                          variance): a plain tensor of the state's own shape, written
                          by the rank owning the parameter whole and read by the rank
                          owning it in the new layout (zero_ext/whole.py).
    zero_ext/objects      uint8 bytes of torch.save({param_groups hyperparameters, step
                          counts per group, scalar optimizer state, loss-scaler and
                          LR-scheduler state dicts, extra}); read back with
                          weights_only=True, so only plain data and tensors are inside.

Loading hands DCP this rank's fragments in the *new* layout; DCP reads the overlap of
each with the saved pieces (its resharding), straight into the master and state
shards, then engine.publish_params() makes the parameters equal the masters again.
The manifest describes the model (names, shapes, param groups, optimizer class) and
every file (bytes, CRC32), so a checkpoint of another model, a truncated, corrupt or
missing file is refused with its own message on every rank before anything is read.

Note [Atomic save]
Ranks write into the sibling directory <path>.tmp; rank 0 then
checksums the files, writes the manifest last, renames <path> to <path>.old, <path>.tmp
to <path>, and removes <path>.old. A crash before the first rename leaves <path>
untouched; a crash between the renames leaves a complete <path>.old, which load()
falls back to. A directory without a manifest is never loaded.
"""
from __future__ import annotations

import bisect
import contextlib
import io
import json
import os
import shutil
import warnings
import zlib

import torch

from .model import PHASE_CHECKPOINT

FORMAT = 1
MANIFEST = "zero_ext.json"
# the fix for a checkpoint that cannot be read
_EARLIER = "load an earlier checkpoint (or a backup copy of this one)"
OBJECTS = "zero_ext/objects"
_ADAM_FAMILY = ("Adam", "AdamW")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (missing, incomplete, corrupt, another model)
    or a save that failed. Raised on every rank."""


# --------------------------------------------------------------------------- layout
def _require_pair(model, optimizer) -> None:
    """save/load/consolidation take what zeroify() returned (checked before anything is touched)."""
    from .model import ZeroModel
    from .optim import ZeroOptimizer

    if not isinstance(model, ZeroModel) or not isinstance(core_optimizer(optimizer), ZeroOptimizer):
        raise TypeError(f"zero_ext: save/load take the (model, optimizer) pair returned by zeroify(), got "
                        f"({type(model).__name__}, {type(optimizer).__name__}); pass those: "
                        f"model, opt = zero_ext.zeroify(...); zero_ext.save(path, model, opt)")


def _layout(model, optimizer) -> dict:
    """The model as a checkpoint sees it (identical on every rank):
    params: trainable name -> {shape, group}, in engine order; plain: frozen
    parameters and buffers name -> {shape, dtype}; keys: state_dict key -> the
    name its tensor is stored under (tied parameters share one); groups: the names in
    each param group, in order (torch optimizer state dicts index them so)."""
    _require_pair(model, optimizer)
    optimizer = core_optimizer(optimizer)
    module = model.module
    names = {}
    for n, p in module.named_parameters():
        names.setdefault(id(p), n)
    shapes = getattr(optimizer, "_param_shapes", None) or [tuple(p.shape) for p in optimizer._params]
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    params = {names[id(p)]: {"shape": list(s), "group": group_of[id(p)]}
              for p, s in zip(optimizer._params, shapes)}
    keys, plain = {}, {}
    guard = model._guard
    logical = {id(p): s for p, s in zip(guard.params, guard.shapes)}   # stage-3 frozen ones are empty here
    for key, t in module.state_dict(keep_vars=True).items():
        name = names.get(id(t), key)
        keys[key] = name
        if name not in params and name not in plain:
            plain[name] = {"shape": list(logical.get(id(t), t.shape)), "dtype": str(t.dtype).replace("torch.", "")}
    groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    parts = [{"optimizer": p.cls.__name__, "groups": list(p.groups), "kind": p.kind} for p in optimizer._parts]
    return {"params": params, "plain": plain, "keys": keys, "groups": groups,
            "optimizer": "+".join(p["optimizer"] for p in parts), "parts": parts}


def core_optimizer(optimizer):
    """The ZeroOptimizer behind what zeroify returned: itself, or the one shared by
    the list of optimizers (or one of them) that zeroify returned for several."""
    if isinstance(optimizer, (list, tuple)) and optimizer:
        optimizer = optimizer[0]
    return getattr(optimizer, "zero_optimizer", optimizer)


def _whole_tensors(optimizer, layout) -> list:
    """(name, the inner torch optimizer, master view) of every whole tensor this rank owns."""
    names = list(layout["params"])
    return [(names[i], part.opt, view) for part in optimizer._parts if part.kind == "whole"
            for i, view in part.owned]


def _scheduler_state(scheduler):
    if scheduler is None:
        return None
    if isinstance(scheduler, (list, tuple)):
        return [s.state_dict() for s in scheduler]
    return scheduler.state_dict()


def _load_scheduler(scheduler, saved) -> None:
    if scheduler is None or saved is None:
        return
    if isinstance(scheduler, (list, tuple)):
        for s, d in zip(scheduler, saved):
            s.load_state_dict(d)
    else:
        scheduler.load_state_dict(saved)


def _plain_tensors(model, layout, full: dict | None = None) -> dict:
    """name -> frozen parameter or buffer; full: id -> whole value of the frozen
    parameters stage 3 shards (_gather_frozen), or None to leave them out."""
    sd = model.module.state_dict(keep_vars=True)
    sharded = {id(p) for p in _frozen_in_engine(model)}
    out = {}
    for key, name in layout["keys"].items():
        t = sd[key]
        if name not in layout["plain"] or name in out:
            continue
        if id(t) not in sharded:
            out[name] = t.detach()
        elif full is not None:
            out[name] = full[id(t)]
    return out


def _frozen_in_engine(model) -> list:
    """The frozen parameters stage 3 shards, in the engine's frozen order."""
    guard = model._guard
    return guard.params[guard.n_trainable:]


@torch.no_grad()
def _gather_frozen(model, keep: bool) -> dict:
    """id -> whole clone of every frozen parameter stage 3 shards (held only where
    keep); every rank calls it: one unit gathered at a time."""
    from .gather import OWNER_ATTR

    engine, out = model._engine, {}
    unit_of = {id(p): getattr(p, OWNER_ATTR)[1] for p in _frozen_in_engine(model)}
    for u in sorted(set(unit_of.values())):
        was = engine.unit_gathered(u)
        engine.gather_unit(u, True)
        if keep:
            out.update({id(p): p.detach().clone() for p in _frozen_in_engine(model) if unit_of[id(p)] == u})
        if not was:
            engine.release_unit(u)
    return out


@torch.no_grad()
def _write_frozen(model, loaded: dict) -> None:
    """Stage 3: each rank writes its slices of the frozen parameters read whole."""
    guard, engine = model._guard, model._engine
    for j, p in enumerate(_frozen_in_engine(model)):
        guard.write(engine, guard.n_trainable + j, p, loaded[id(p)])


class _Shard:
    """This rank's view of the sharded state: per bucket, the master weights and
    each per-element optimizer state, plus where fragments sit (Note [Checkpoint format])."""

    def __init__(self, optimizer):
        self.opt = optimizer = core_optimizer(optimizer)
        self.engine = e = optimizer._engine
        self.masters = e.param_shards()                     # per bucket, 1-D views
        self.offsets, off = [], 0                           # bucket b's offset in the flat shard
        for t in self.masters:
            self.offsets.append(off)
            off += t.numel()
        self.numel = [0] * len(optimizer._params)           # elements of each parameter
        for r in range(e.partitions):
            for i, _, _, n in e.fragments(r):
                self.numel[i] += n
        self.atomic = [o >= 0 for o in e.owners()]          # whole tensors: per-tensor state only
        self.windows = e.state_windows()                    # per bucket: (lo, numel, flat offset)
        self.views = None                                   # generic path: bucket -> shard view
        if optimizer._shard_opt is not None:
            self.views = optimizer._bucket_views()

    def bucket_of(self, shard_offset: int) -> int:
        return bisect.bisect_right(self.offsets, shard_offset) - 1

    def states(self) -> dict:
        """name -> per-bucket 1-D tensors of each per-element optimizer state."""
        if self.views is None:
            # Note [State windows] (csrc/engine/fill.cpp): each bucket's state covers a window of its slice
            out = {}
            for name, flat in self.engine.states().items():
                out[name] = _Windows([flat.narrow(0, off, n) for _, n, off in self.windows],
                                     [lo for lo, _, _ in self.windows])
            return out
        state = self.opt._shard_opt.state
        names = sorted({k for v in self.views for k, t in state.get(v, {}).items() if _per_element(t, v)})
        return {n: [state[v][n] for v in self.views] for n in names}

    def scalar_state(self) -> dict:
        """Generic path: group -> the optimizer's non-per-element state ("step", ...)."""
        if self.views is None:
            return {}
        out = {}
        for v, gi in zip(self.views, self.engine.bucket_groups()):
            s = self.opt._shard_opt.state.get(v, {})
            if gi not in out and s:
                out[gi] = {k: (t.clone() if torch.is_tensor(t) else t) for k, t in s.items()
                           if not _per_element(t, v)}
        return out

    def local(self, pieces: list, shard_offset: int, n: int) -> torch.Tensor:
        b = self.bucket_of(shard_offset)
        at = shard_offset - self.offsets[b] - (pieces.lo[b] if isinstance(pieces, _Windows) else 0)
        if at < 0 or at + n > pieces[b].numel():         # outside a state window: no state there
            return torch.zeros(n, dtype=pieces[b].dtype)
        return pieces[b].narrow(0, at, n)

    def full(self, pieces: list, b: int) -> torch.Tensor:
        """Bucket b's slice of `pieces`, slice-sized (zeros outside a state window), in fp32
        (bf16 states widened: Note [bf16 optimizer states] in csrc/engine/stepper.cpp)."""
        n = self.masters[b].numel()
        if not isinstance(pieces, _Windows) or (pieces.lo[b] == 0 and pieces[b].numel() == n):
            return pieces[b].float()
        out = torch.zeros(n, dtype=torch.float32)
        out.narrow(0, pieces.lo[b], pieces[b].numel()).copy_(pieces[b])
        return out


class _Windows(list):
    """Per bucket, a per-element state over the window of its slice starting at lo[b]."""

    def __init__(self, tensors: list, lo: list):
        super().__init__(tensors)
        self.lo = lo


def _as_fp32(states: dict) -> tuple:
    """Checkpoints hold every per-element state in fp32, whatever state_dtype (Note [bf16
    optimizer states] in csrc/engine/stepper.cpp): a bf16 state widens exactly, so it
    loads back into bf16 states bit for bit, and into fp32 states of another run too.
    Returns (name -> per-bucket fp32 tensors: the states themselves where they are fp32,
    else copies), [(bf16 state, its fp32 copy)] for a load to write back."""
    out, back = {}, []
    for name, pieces in states.items():
        if all(t.dtype == torch.float32 for t in pieces):
            out[name] = pieces
            continue
        wide = [t.float() for t in pieces]
        back += [(t, w) for t, w in zip(pieces, wide) if t.dtype != torch.float32]
        out[name] = _Windows(wide, pieces.lo) if isinstance(pieces, _Windows) else wide
    return out, back


def _per_element(t, view) -> bool:
    return torch.is_tensor(t) and t.dim() == 1 and t.shape == view.shape


def _sharded(numel: int, chunks: list, local: list, rank: int):
    """A 1-D ShardedTensor of `numel` fp32 elements: `chunks` = every rank's pieces
    (rank, offset, numel), `local` = this rank's (offset, tensor). Built from the
    plan without communication: ShardedTensorBase's constructor checks that the
    pieces tile the tensor but, unlike ShardedTensor's, needs no process group. It is
    torch's one private API used here (present since torch 2.0; tested on 2.13).
    DTensor, DCP's other sharded type, cannot express uneven element-granular pieces."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensorBase
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    # Placements name the device the pieces live on (the engine's): a Shard whose tensor
    # is on cuda:0 must say so. Other ranks' device indices are not known here and are
    # not read (DCP plans from the local shards and the sizes).
    dev = local[0][1].device if local else torch.device("cpu")
    md = ShardedTensorMetadata(
        shards_metadata=[ShardMetadata([o], [n], f"rank:{r}/{dev if r == rank else dev.type}")
                         for r, o, n in chunks],
        size=torch.Size([numel]),
        tensor_properties=TensorProperties(dtype=torch.float32, layout=torch.strided, requires_grad=False,
                                           memory_format=torch.contiguous_format, pin_memory=False))
    shards = [Shard(t, ShardMetadata([o], [t.numel()], f"rank:{rank}/{t.device}")) for o, t in local]
    st = ShardedTensorBase._init_from_local_shards_and_global_metadata(shards, md)
    st._process_group = None     # what ShardedTensor's own constructor sets; its size() reads it
    return st


def _sharded_entries(shard: _Shard, names: list, pieces_by_kind: dict, writing: bool) -> dict:
    """DCP entries for every sharded tensor kind ("model", "optim/<state>"): this
    rank's fragments in the current layout. Stage 0 (one partition): rank 0's plan
    holds everything and every rank holds all of it; only rank 0 writes it."""
    e = shard.engine
    parts, rank = e.partitions, e.rank
    chunks: list = [[] for _ in names]
    for r in range(parts):
        for i, poff, _, n in e.fragments(r):
            chunks[i].append((r, poff, n))
    mine = e.fragments(rank if parts > 1 else 0)
    if writing and parts == 1 and rank != 0:
        mine = []
    out = {}
    for kind, pieces in pieces_by_kind.items():
        local: list = [[] for _ in names]
        for i, poff, soff, n in mine:
            local[i].append((poff, shard.local(pieces, soff, n)))
        for i, name in enumerate(names):
            if kind.startswith("optim/") and shard.atomic[i]:
                continue                                  # a whole tensor's state is under whole/
            if local[i] and shard.numel[i] > 0:
                out[f"{kind}/{name}"] = _sharded(shard.numel[i], chunks[i], local[i], rank)
    return out


def _engine_names(optimizer, layout) -> list:
    return list(layout["params"])                         # engine order (dicts keep it)


def _param_steps(optimizer, names) -> dict:
    """name -> optimizer steps that parameter took (Note [Unused parameters] in
    csrc/engine/unused.cpp: a parameter no rank gave a gradient is not stepped);
    the same on every rank, so world-size independent."""
    return dict(zip(names, optimizer.param_step_counts()))


def _steps_of(objects: dict, name: str, group: int) -> int:
    """A parameter's step count; a checkpoint without per-parameter counts has its group's."""
    return int(objects.get("param_steps", {}).get(name, objects["steps"][group]))


def _settle(model, optimizer, phase: int | None = PHASE_CHECKPOINT):
    """(engine, its Comm, layout), once every outstanding collective is done and every
    rank is here (a rank calling alone is named: Note [Collective sequence check])."""
    _require_pair(model, optimizer)
    optimizer = core_optimizer(optimizer)
    engine = optimizer._engine
    if phase is not None:
        engine.sequence_mark(phase)
    engine.wait_reductions()
    engine.flush_params()
    return engine, optimizer._comm, _layout(model, optimizer)


def _decide(comm, error: str | None, src_rank: int = 0):
    """Rank 0's verdict reaches every rank: all raise the same error or none does."""
    error = comm.broadcast_object(error, src=src_rank)
    if error is not None:
        raise CheckpointError(error)


@contextlib.contextmanager
def _quiet():
    """DCP warns that ShardedTensor is deprecated in favour of DTensor (which cannot
    express our uneven element-granular pieces) and, without a process group, that
    it runs in one process; neither is news to the user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*")
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- save
def save(path, model, optimizer, extra=None, *, scheduler=None) -> None:
    """Write a checkpoint of `model` and `optimizer` (as returned by zeroify) to the
    directory `path`; every rank calls it. Each rank writes only its shard; the
    result loads at any world size and stage (Note [Checkpoint format]) and replaces
    an existing checkpoint at `path` atomically (Note [Atomic save]). `extra`: plain
    data (dicts, lists, numbers, strings, tensors) returned by load(); `scheduler`:
    an LR scheduler whose state_dict() is saved too."""
    path = os.path.abspath(os.fspath(path))
    optimizer = core_optimizer(optimizer)
    engine, comm, layout = _settle(model, optimizer)
    rank = engine.rank
    shard = _Shard(optimizer)
    states = _as_fp32(shard.states())[0]   # bf16 states are written widened to fp32
    tmp = path + ".tmp"
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = (f"zero_ext: cannot create {tmp!r} to save a checkpoint: {e}; save to a directory you can "
                     f"write to")
    _decide(comm, error)

    names = _engine_names(optimizer, layout)
    kinds = {"model": shard.masters, **{f"optim/{s}": p for s, p in states.items()}}
    with _quiet():
        sd = _sharded_entries(shard, names, kinds, writing=True)
    for name, opt, view in _whole_tensors(optimizer, layout):   # the owner writes them
        if engine.partitions == 1 and rank != 0:
            break
        for k, t in opt.state.get(view, {}).items():
            sd[f"whole/{k}/{name}"] = t if torch.is_tensor(t) else torch.tensor(t)
    objects = None
    full = _gather_frozen(model, keep=rank == 0)
    if rank == 0:
        scaler = getattr(optimizer, "loss_scaler", None)
        objects = {
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            "steps": list(optimizer._steps),
            "param_steps": _param_steps(optimizer, names),
            "scalar_state": shard.scalar_state(),
            "loss_scaler": scaler.state_dict() if scaler is not None else None,
            "scheduler": _scheduler_state(scheduler),
            "extra": extra,
        }
        buf = io.BytesIO()
        torch.save(objects, buf)
        sd[OBJECTS] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        sd.update({f"model/{n}": t for n, t in _plain_tensors(model, layout, full).items()})
    del full
    try:
        from torch.distributed import checkpoint as dcp
        with _quiet():
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True),
                     process_group=comm.pg, no_dist=comm.pg is None)
    except Exception as e:  # noqa: BLE001 - DCP raises the same failure on every rank
        raise CheckpointError(f"zero_ext: saving checkpoint {path!r} failed on rank {rank} ({type(e).__name__}: "
                              f"{e}); another rank may have died. The previous checkpoint at {path!r}, if any, "
                              f"is untouched: fix what the first failing rank's log names, then save again") from e

    error = None
    if rank == 0:
        try:
            files = {f: {"bytes": os.path.getsize(os.path.join(tmp, f)), "crc32": _crc32(os.path.join(tmp, f))}
                     for f in sorted(os.listdir(tmp))}
            manifest = dict(layout, format=FORMAT, stage=model._config.stage, world_size=engine.world_size,
                            partitions=engine.partitions, torch=torch.__version__, states=sorted(states),
                            objects_bytes=int(sd[OBJECTS].numel()), files=files)
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            _replace(tmp, path)
        except OSError as e:
            error = (f"zero_ext: finishing checkpoint {path!r} failed: {e}; free disk space or fix the permissions, "
                     f"then save again (the previous checkpoint, if any, is untouched)")
    _decide(comm, error)


def _replace(tmp: str, path: str) -> None:
    """Note [Atomic save]."""
    old = path + ".old"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))
    shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- verify
def resolve(path) -> str:
    """The checkpoint directory to read for `path`: `path` itself, or `path`.old when a
    save was interrupted between its two renames (Note [Atomic save])."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(os.path.join(path, MANIFEST)) and os.path.exists(os.path.join(path + ".old", MANIFEST)):
        return path + ".old"
    return path


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint `path` after checking every file it lists (present,
    size, CRC32). Raises CheckpointError naming what is wrong."""
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
        raise CheckpointError(f"zero_ext: the manifest {mpath!r} is corrupt ({e}); {_EARLIER}") from None
    if m.get("format") != FORMAT:
        raise CheckpointError(f"zero_ext: checkpoint {path!r} has format {m.get('format')!r}; this zero_ext "
                              f"reads format {FORMAT}: load it with the zero_ext version that wrote it")
    for name, info in files.items():
        fp = os.path.join(path, name)
        who = f" (the shard written by rank {name[2:].split('_')[0]})" if name.endswith(".distcp") else ""
        if not os.path.exists(fp):
            raise CheckpointError(f"zero_ext: checkpoint {path!r} is incomplete: file {name!r}{who} is missing; "
                                  f"copy it back if you have it, or {_EARLIER}")
        size = os.path.getsize(fp)
        if size != info["bytes"]:
            what = "truncated" if size < info["bytes"] else "longer than written"
            raise CheckpointError(f"zero_ext: checkpoint {path!r} is damaged: file {name!r}{who} is {what} "
                                  f"({size} bytes, {info['bytes']} were written); {_EARLIER}")
        crc = _crc32(fp)
        if crc != info["crc32"]:
            raise CheckpointError(f"zero_ext: checkpoint {path!r} is corrupt: file {name!r}{who} has CRC32 "
                                  f"{crc:08x}, {info['crc32']:08x} was written; {_EARLIER}")
    return m


def _mismatch(m: dict, layout: dict, path: str) -> str | None:
    """Why checkpoint manifest `m` does not fit the model/optimizer `layout`, or None."""
    problems = []
    for kind, label in (("params", "trainable parameters"), ("plain", "frozen parameters/buffers")):
        saved, here = m[kind], layout[kind]
        missing = [n for n in here if n not in saved]
        unexpected = [n for n in saved if n not in here]
        shapes = [f"{n} {tuple(saved[n]['shape'])} saved, {tuple(here[n]['shape'])} here"
                  for n in here if n in saved and saved[n]["shape"] != here[n]["shape"]]
        if missing:
            problems.append(f"{label} not in the checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            problems.append(f"{label} of the checkpoint not in this model: {unexpected[:5]}"
                            f"{' ...' if len(unexpected) > 5 else ''}")
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


# --------------------------------------------------------------------------- load
def load(path, model, optimizer, *, scheduler=None):
    """Load checkpoint `path` (written by save() at any world size and stage) into
    `model` and `optimizer` from zeroify(); every rank calls it. Restores the master
    weights, optimizer state, step counts, param-group hyperparameters, loss-scaler
    and (if given) scheduler state; returns the `extra` that was saved. Checks first
    (rank 0 reads the manifest and every file's size and CRC32, and compares the
    model) and raises the same CheckpointError on every rank if anything is wrong."""
    optimizer = core_optimizer(optimizer)
    engine, comm, layout = _settle(model, optimizer)
    rank = engine.rank
    real = resolve(path)
    error, manifest = None, None
    if rank == 0:
        try:
            manifest = read_manifest(real)
            error = _mismatch(manifest, layout, real)
        except CheckpointError as e:
            error = str(e)
    # rank 0's verdict and directory hold for every rank
    error, manifest, real = comm.broadcast_object((error, manifest, real), src=0)
    if error is not None:
        raise CheckpointError(error)

    shard = _Shard(optimizer)
    saved_states = manifest["states"]
    states, narrow_back = _as_fp32(_prepare_states(optimizer, shard, saved_states))
    names = _engine_names(optimizer, layout)
    kinds = {"model": shard.masters, **{f"optim/{s}": states[s] for s in saved_states}}
    with _quiet():
        sd = _sharded_entries(shard, names, kinds, writing=False)
    # stage-3 frozen parameters are read whole, then each rank keeps its slices
    frozen = {id(p): torch.empty(s, dtype=p.dtype, device=p.device) for p, s in
              zip(_frozen_in_engine(model), model._guard.shapes[model._guard.n_trainable:])}
    sd.update({f"model/{n}": t for n, t in _plain_tensors(model, layout, frozen).items()})
    sd[OBJECTS] = torch.empty(manifest["objects_bytes"], dtype=torch.uint8)
    from torch.distributed import checkpoint as dcp
    whole = _whole_entries(real, [name for name, _, _ in _whole_tensors(optimizer, layout)])
    sd.update({k: t for per in whole.values() for k, t in per.items()})
    try:
        with torch.no_grad(), _quiet():
            dcp.load(sd, storage_reader=dcp.FileSystemReader(real), process_group=comm.pg, no_dist=comm.pg is None)
    except Exception as e:  # noqa: BLE001 - DCP raises the same failure on every rank
        raise CheckpointError(f"zero_ext: reading checkpoint {real!r} failed on rank {rank} ({type(e).__name__}: "
                              f"{e}); the model and optimizer may be partly loaded: load again or rebuild them") from e
    with torch.no_grad():
        for state, wide in narrow_back:   # bf16 states: the checkpoint's fp32 values, rounded to nearest
            state.copy_(wide)
    del narrow_back
    objects = _objects(sd[OBJECTS], real)
    _write_frozen(model, frozen)
    del frozen

    for g, saved in zip(optimizer.param_groups, objects["param_groups"]):
        g.update(saved)
    optimizer._steps = list(objects["steps"])
    engine.set_param_steps([_steps_of(objects, n, layout["params"][n]["group"]) for n in names])
    if shard.views is not None:
        _restore_scalars(optimizer, shard, objects)
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is not None and objects["loss_scaler"] is not None:
        scaler.load_state_dict(objects["loss_scaler"])
    _load_scheduler(scheduler, objects["scheduler"])
    for name, opt, view in _whole_tensors(optimizer, layout):
        opt.state.pop(view, None)
        if whole.get(name):
            opt.state[view] = {k.split("/")[1]: t for k, t in whole[name].items()}
    engine.publish_params()
    return objects["extra"]


def _whole_entries(real: str, names: list) -> dict:
    """name -> {"whole/<state>/<name>": empty tensor to load into}, for the whole
    tensors `names`, from the checkpoint's DCP metadata (shape and dtype of each)."""
    from torch.distributed import checkpoint as dcp
    md = dcp.FileSystemReader(real).read_metadata().state_dict_metadata
    wanted, out = set(names), {}
    for key, meta in md.items():
        if key.startswith("whole/"):
            name = key.split("/", 2)[2]
            if name in wanted:
                out.setdefault(name, {})[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    return out


def _prepare_states(optimizer, shard: _Shard, saved: list) -> dict:
    """Per-bucket tensors that the saved per-element states load into; states the
    checkpoint does not have (it was saved before the first step) are cleared."""
    if shard.views is None:
        e = shard.engine
        for name, flat in e.states().items():
            if name not in saved:
                flat.zero_()
        for name in saved:
            e.state(name)
        return shard.states()
    st = optimizer._shard_opt.state
    for v in shard.views:
        st[v] = {name: torch.zeros_like(v) for name in saved}
    return {name: [st[v][name] for v in shard.views] for name in saved}


def _restore_scalars(optimizer, shard: _Shard, objects: dict) -> None:
    """Generic path: put back the scalar state ("step", ...) of every bucket view;
    a checkpoint from the fused path has step counts only."""
    groups = shard.engine.bucket_groups()
    st = optimizer._shard_opt.state
    for b, v in enumerate(shard.views):
        gi = groups[b]
        scal = objects["scalar_state"].get(gi)
        if scal is None and objects["steps"][gi] > 0 and st[v]:
            scal = {"step": torch.tensor(float(objects["steps"][gi]))}
        for k, t in (scal or {}).items():
            st[v][k] = t.clone() if torch.is_tensor(t) else t
        if not st[v]:
            del st[v]


def _objects(t: torch.Tensor, path: str) -> dict:
    try:
        return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"zero_ext: the saved objects of checkpoint {path!r} cannot be read ({e}); "
                              f"{_EARLIER}") from e


# --------------------------------------------------------------------------- consolidate
def optimizer_state_dict(layout: dict, tensors: dict, objects: dict, whole: dict | None = None):
    """A torch.optim state dict for the wrapped class from per-parameter full tensors:
    tensors[state][name] = the state of trainable parameter `name`, shaped like it.
    Parameters are numbered across param groups in order, as torch numbers them.
    With several wrapped optimizers or one that needs whole tensors: one state dict
    per wrapped optimizer (a list when there are several), whole[name] = {state:
    tensor} giving the whole-tensor optimizers' states."""
    parts = layout.get("parts") or []
    if len(parts) > 1 or (parts and parts[0]["kind"] == "whole"):
        out = [_part_state_dict(layout, part, tensors, whole or {}, objects) for part in parts]
        return out if len(out) > 1 else out[0]
    index, groups = {}, []
    for gi, names in enumerate(layout["groups"]):
        ids = []
        for n in names:
            index[n] = len(index)
            ids.append(index[n])
        groups.append(dict(objects["param_groups"][gi], params=ids))
    state = {}
    for name, info in layout["params"].items():
        gi = info["group"]
        steps = _steps_of(objects, name, gi)
        s = {}
        scal = objects["scalar_state"].get(gi)
        if scal is not None:
            s.update({k: (t.clone() if torch.is_tensor(t) else t) for k, t in scal.items()})
        elif layout["optimizer"] in _ADAM_FAMILY and steps > 0:
            s["step"] = torch.tensor(float(steps))
        for st, per_param in tensors.items():
            s[st] = per_param[name]
        if s and (steps > 0 or scal):
            state[index[name]] = s
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def _part_state_dict(layout: dict, part: dict, tensors: dict, whole: dict, objects: dict) -> dict:
    """The state dict of one wrapped optimizer (its param groups, numbered from 0)."""
    index, groups, state = {}, [], {}
    for gi in part["groups"]:
        ids = []
        for n in layout["groups"][gi]:
            index[n] = len(index)
            ids.append(index[n])
        groups.append(dict(objects["param_groups"][gi], params=ids))
    for gi in part["groups"]:
        steps = objects["steps"][gi]
        scal = objects["scalar_state"].get(gi)
        for n in layout["groups"][gi]:
            if n not in layout["params"]:
                continue                                   # frozen: no state
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
        numel = 1
        for d in info["shape"]:
            numel *= d
        for kind in ["model"] + [f"optim/{s}" for s in m["states"]]:
            flat[(kind, name)] = torch.zeros(numel)
            if numel and (kind == "model" or info["group"] not in whole_groups):
                sd[f"{kind}/{name}"] = flat[(kind, name)]
    for name, info in m["plain"].items():
        sd[f"model/{name}"] = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
    from torch.distributed import checkpoint as dcp
    try:
        with _quiet():
            dcp.load(sd, storage_reader=dcp.FileSystemReader(real), no_dist=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"zero_ext: reading checkpoint {real!r} failed ({type(e).__name__}: {e}); "
                              f"{_EARLIER}") from e
    objects = _objects(sd[OBJECTS], real)
    whole = _whole_entries(real, list(m["params"]))
    if whole:
        with _quiet():
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
    {"model", "optimizer"} there, None on the other ranks; every rank calls it.
    Streamed bucket by bucket and rank by rank with point-to-point sends, so besides the
    result the receiving rank holds one bucket slice at a time (its extra memory is
    bounded by a bucket, not the model) and the senders send views of their shards.
    model_state=False: the optimizer's state only ({"optimizer"})."""
    optimizer = core_optimizer(optimizer)
    engine = optimizer._engine
    rank, parts = engine.rank, engine.partitions
    # stage 0 and one rank hold everything: no collective, so any rank may call it alone
    engine, comm, layout = _settle(model, optimizer, phase if parts > 1 else None)
    shard = _Shard(optimizer)
    states = shard.states()
    kinds = {**({"model": shard.masters} if model_state else {}), **{f"optim/{s}": p for s, p in states.items()}}
    names = _engine_names(optimizer, layout)
    receiving = to is None or rank == to
    out = {k: [torch.zeros(n) for n in shard.numel] for k in kinds} if receiving else None

    def place(kind, frags, src, base):
        for i, poff, soff, n in frags:
            out[kind][i].narrow(0, poff, n).copy_(src.narrow(0, soff - base, n))

    if parts == 1:                                   # everything is here (stage 0 / one rank)
        if receiving:
            for kind, pieces in kinds.items():
                for i, poff, soff, n in engine.fragments(0):
                    out[kind][i].narrow(0, poff, n).copy_(shard.local(pieces, soff, n))
    else:
        by_bucket = [[[] for _ in shard.masters] for _ in range(parts)]   # rank -> bucket -> fragments
        if receiving:
            for r in range(parts):
                for f in engine.fragments(r):
                    by_bucket[r][shard.bucket_of(f[2])].append(f)
        # each rank's slice of bucket b, from its owner (a broadcast: Note [One communication layer])
        buf = torch.empty(max(m.numel() for m in shard.masters), device=comm.device)
        for b, m in enumerate(shard.masters):
            n_b, base = m.numel(), shard.offsets[b]
            for kind, pieces in kinds.items():
                for r in range(parts):
                    if r == to:
                        if receiving:
                            place(kind, by_bucket[r][b], shard.full(pieces, b), base)
                        continue
                    got = comm.broadcast_from(shard.full(pieces, b) if rank == r else None, buf[:n_b], r)
                    if receiving:
                        place(kind, by_bucket[r][b], got, base)
        del buf
    # whole-tensor states: each owner's, to rank `to` (they are per tensor, not per element)
    mine = {name: {k: t.detach().cpu().clone() if torch.is_tensor(t) else t for k, t in opt.state.get(view, {}).items()}
            for name, opt, view in _whole_tensors(optimizer, layout)}
    whole = mine
    if parts > 1:
        got = comm.gather_object(mine, dst=to)
        whole = {n: st for d in (got or []) for n, st in d.items()}
    frozen = _gather_frozen(model, keep=receiving) if model_state else {}
    if not receiving:
        return None
    scalar = shard.scalar_state()
    objects = {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
               "steps": list(optimizer._steps), "param_steps": _param_steps(optimizer, names), "scalar_state": scalar}
    tensors = {s: {name: out[f"optim/{s}"][i].view(layout["params"][name]["shape"]) for i, name in enumerate(names)}
               for s in states}
    result = {"optimizer": optimizer_state_dict(layout, tensors, objects, whole)}
    if model_state:
        values = {name: out["model"][i].view(layout["params"][name]["shape"]) for i, name in enumerate(names)}
        values.update({n: t.clone() for n, t in _plain_tensors(model, layout).items()})
        values.update({n: t for n, t in _plain_tensors(model, layout, frozen).items() if n not in values})  # frozen
        result["model"] = {key: values[name] for key, name in layout["keys"].items()}
    return result
