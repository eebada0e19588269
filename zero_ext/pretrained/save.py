"""save_pretrained(): a zeroified model out of its shards as Hugging Face safetensors.

Note [Streaming save_pretrained]
  Every rank calls it; rank 0 writes. The layout is known on every rank first: one
  state-dict name per tensor (of tied names, the one not in HF's `_tied_weights_keys`),
  with shape and dtype. Trainable parameters are written as their fp32 masters, others in
  their own dtype; `dtype=` casts every floating-point one. Files are cut as HF cuts them.
  Rank 0 writes every header, then:
  - Trainable parameters, bucket by bucket, window by window: a window is one range of each
    rank's slice of the bucket's fp32 master, at most WINDOW_BYTES over all ranks, gathered
    to rank 0 (Comm.gather_to), which writes each fragment's part at its byte offset. So
    rank 0 holds a fixed buffer, the others nothing beyond their shard.
  - Frozen parameters stage 3 shards: unit by unit, gathered in param_dtype.
  - Buffers and frozen parameters every rank holds whole: rank 0's own.
  A PEFT model's adapter (small) is gathered whole to rank 0 for PeftModel.save_pretrained.
  Otherwise the model's config and generation config go beside the weights.

Note [Atomic save_pretrained]
  As Note [Atomic save]: all goes into <dir>.tmp, where rank 0 hard-links the files of an
  existing <dir> this save does not replace (tokenizer files; not old weights). Then <dir>
  becomes <dir>.old, <dir>.tmp becomes <dir>, and <dir>.old is removed; load_weights falls
  back to a <dir>.old left by a crash. A <dir> holding directories (a Trainer's output_dir)
  stays: the new files are renamed into it, weights before the index, then the previous
  save's weights files not rewritten are removed. A write failing on rank 0 (a full disk)
  raises on every rank at the end; a rank that dies fails the others' next collective,
  raised as a CheckpointError naming the untouched directory.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil

import torch
from torch import nn

from ..checkpoint.format import CheckpointError
from ..checkpoint.layout import frozen_units
from ..checkpoint.saving import decide, fsync_dir, make_tmp, replace_file
from ..model import ZeroModel
from .files import INDEX, SHARD, WEIGHTS, Writer, numel, parse_size, plan_files
from .load import is_peft, settled_comm, tied_names

ADAPTER = "adapter_model.safetensors"
WINDOW_BYTES = 32 << 20       # what rank 0 gathers at once, over all ranks (fp32)


def _stale(name: str) -> bool:
    """A weights file of an earlier save (replaced or dropped by this one)."""
    return name in (WEIGHTS, INDEX, ADAPTER) or SHARD.fullmatch(name) is not None


def _saved(model: ZeroModel, adapter_only: bool, dtype) -> list:
    """[(name, tensor, engine index or None, out dtype, shape)] in state-dict order."""
    module, guard = model.module, model.guard
    state, groups = tied_names(module)
    # what HF drops from a save as tied: each submodule's `_tied_weights_keys` ({target: source}, a list)
    targets = {f"{path}.{k}" if path else k for path, m in module.named_modules()
               for k in list(getattr(m, "_tied_weights_keys", None) or ())}
    ignore = [re.compile(p) for p in getattr(module, "_keys_to_ignore_on_save", None) or ()]
    out = []
    for names in groups:
        name = next((n for n in names if n not in targets), names[0])
        t, i = state[name], guard.index.get(id(state[name]))
        if any(p.search(name) for p in ignore) or (adapter_only and (i is None or i >= guard.n_trainable)):
            continue
        shape = tuple(guard.shapes[i]) if i is not None else tuple(t.shape)
        own = torch.float32 if i is not None and i < guard.n_trainable else t.dtype
        out.append((name, t, i, dtype if dtype is not None and own.is_floating_point else own, shape))
    return out


class _Sink:
    """Rank 0's: the files of `files`, or (None) whole tensors in `out` (a PEFT adapter). A failed
    write is kept, not raised, so that rank 0 stays in the collectives."""

    def __init__(self, tmp: str, files: dict | None, tensors: list):
        self.error, self.writer, self.out = None, None, {}
        try:
            if files is None:
                self.out = {name: torch.empty(shape, dtype=dt) for name, dt, shape in tensors}
            else:
                self.writer = Writer(tmp, files)
        except OSError as e:
            self.error = e

    def put(self, name: str, first: int, values: torch.Tensor) -> None:
        if self.error is None:
            try:
                if self.writer is None:
                    self.out[name].view(-1)[first:first + values.numel()].copy_(values.reshape(-1))
                else:
                    self.writer.put(name, first, values)
            except OSError as e:
                self.error = e


@torch.no_grad()
def _stream(model: ZeroModel, comm, saved: list, sink) -> None:
    """Every rank: the gathers of Note [Streaming save_pretrained]; `sink` on rank 0 only."""
    engine = model.engine
    rank, parts = engine.rank, engine.partitions
    wanted = {i: name for name, _, i, _, _ in saved if i is not None and i < model.guard.n_trainable}
    masters = engine.param_shards()
    slices = [engine.bucket_fragments(r) for r in range(parts)] if rank == 0 else None   # rank -> bucket -> pieces
    window = max(1, WINDOW_BYTES // 4 // parts)
    buf = torch.empty(parts * window, device=comm.device) if rank == 0 and parts > 1 else None
    for b, m in enumerate(masters):
        n = m.numel()
        for a in range(0, n, window) if parts > 1 else [0]:
            w = min(window, n - a) if parts > 1 else n
            got = m if parts == 1 else comm.gather_to(m.narrow(0, a, w), buf[:parts * w] if buf is not None else None)
            if sink is None:
                continue
            for r in range(parts):   # each fragment's part in [a, a + w) of rank r's slice
                for i, poff, off, k in slices[r][b]:
                    lo, hi = max(off, a), min(off + k, a + w)
                    if i in wanted and lo < hi:
                        sink.put(wanted[i], poff + lo - off, got[r * w + lo - a:r * w + hi - a])
    del buf
    frozen = {id(t): name for name, t, i, _, _ in saved if i is not None and i >= model.guard.n_trainable}
    for params in frozen_units(model):   # none outside stage 3
        for p in params:
            if sink is not None and id(p) in frozen:
                sink.put(frozen[id(p)], 0, p.detach())
    if sink is not None:
        for name, t, i, _, _ in saved:
            if i is None:
                sink.put(name, 0, t.detach())


def _write_config(base: nn.Module, directory: str, dtype) -> None:
    """The config and generation config as save_pretrained writes them."""
    config = getattr(base, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config = copy.deepcopy(config)
    config.dtype = str(dtype or torch.float32).split(".")[1]
    config.architectures = [type(base).__name__]
    config.save_pretrained(directory)
    gen = getattr(base, "generation_config", None)
    can = getattr(base, "can_generate", None)
    if gen is not None and callable(can) and can():
        gen.save_pretrained(directory)


def _commit(tmp: str, path: str, weights_last: list) -> None:
    """Note [Atomic save_pretrained]: <dir>.tmp into <dir>."""
    made = set(os.listdir(tmp))
    if not os.path.isdir(path) or not any(os.path.isdir(os.path.join(path, f)) for f in os.listdir(path)):
        for f in os.listdir(path) if os.path.isdir(path) else ():
            if f not in made and not _stale(f):
                try:
                    os.link(os.path.join(path, f), os.path.join(tmp, f))
                except OSError:
                    shutil.copy2(os.path.join(path, f), os.path.join(tmp, f))
        fsync_dir(tmp)
        replace_file(tmp, path)
        return
    order = sorted(made - set(weights_last)) + [f for f in weights_last if f in made]
    for f in order:
        os.replace(os.path.join(tmp, f), os.path.join(path, f))
    for f in os.listdir(path):
        if _stale(f) and f not in made:
            os.remove(os.path.join(path, f))
    fsync_dir(path)
    shutil.rmtree(tmp, ignore_errors=True)


def save_pretrained(model, save_directory, *, max_shard_size: int | str = "5GB", dtype=None) -> None:
    """Write a zeroified model as a checkpoint from_pretrained (or load_weights) loads; every rank
    calls it, rank 0 writes: Note [Streaming save_pretrained], Note [Atomic save_pretrained].
    dtype=torch.bfloat16 casts every float tensor; a PEFT model writes its adapter."""
    if not isinstance(model, ZeroModel):
        raise TypeError(f"zero_ext: save_pretrained takes the model zeroify() returned, got {type(model).__name__}; "
                        f"a plain model saves with its own save_pretrained()")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"zero_ext: save_pretrained(dtype={dtype!r}); pass a floating-point torch dtype "
                         f"(torch.bfloat16) or None (fp32 masters, every other tensor in its own dtype)")
    limit = parse_size(max_shard_size)
    path = os.path.abspath(os.fspath(save_directory))
    engine, comm = model.engine, settled_comm(model)
    peft = is_peft(model.module)
    saved = _saved(model, peft, dtype)
    files = plan_files([(name, dt, shape) for name, _, _, dt, shape in saved], limit) if not peft else None
    tmp = make_tmp(comm, engine.rank, path)
    sink = _Sink(tmp, files, [(n, dt, s) for n, _, _, dt, s in saved]) if engine.rank == 0 else None
    try:
        _stream(model, comm, saved, sink)
    except RuntimeError as e:   # a collective failed: another rank died
        raise CheckpointError(f"zero_ext: save_pretrained({path!r}) failed on rank {engine.rank} ({type(e).__name__}: "
                              f"{e}); another rank may have died. {path!r} is untouched; fix what the first failing "
                              f"rank's log names and save again") from e
    error = None
    if engine.rank == 0:
        try:
            if sink.error is not None:
                raise sink.error
            if peft:
                model.module.save_pretrained(tmp, state_dict=sink.out, safe_serialization=True)
                weights_last = [ADAPTER]
            else:
                sink.writer.close()
                _write_config(model.module, tmp, dtype)
                weights_last = list(files)
                if len(files) > 1:
                    total = sum(dt.itemsize * numel(s) for _, _, _, dt, s in saved)
                    index = {"metadata": {"total_size": total, "total_parameters": sum(numel(s) for *_, s in saved)},
                             "weight_map": {n: f for f, ts in files.items() for n, _, _ in ts}}
                    with open(os.path.join(tmp, INDEX), "w") as f:
                        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
                    weights_last.append(INDEX)
            _commit(tmp, path, weights_last)
        except OSError as e:
            error = (f"zero_ext: save_pretrained({path!r}) failed on rank 0: {e}; free disk space or fix the "
                     f"permissions, then save again ({path!r} is untouched)")
    decide(comm, error)
