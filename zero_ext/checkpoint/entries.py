"""The DCP entries (ShardedTensors) that hand this rank's share of the sharded state (LocalShard)
to a save or a load (Note [Checkpoint format] in zero_ext/checkpoint/format.py)."""
from __future__ import annotations

import torch

from ..local_shard import LocalShard, Windows


def as_fp32(states: dict) -> tuple:
    """(name -> per-bucket fp32 states, copies where bf16; [(bf16 state, its fp32 copy)] for a
    load to write back). Checkpoints hold states in fp32: bf16 widens exactly."""
    out, back = {}, []
    for name, pieces in states.items():
        if all(t.dtype == torch.float32 for t in pieces):
            out[name] = pieces
            continue
        wide = [t.float() for t in pieces]
        back += [(t, w) for t, w in zip(pieces, wide) if t.dtype != torch.float32]
        out[name] = Windows(wide, pieces.lo) if isinstance(pieces, Windows) else wide
    return out, back


def prepare_states(optimizer, shard: LocalShard, saved: list) -> dict:
    """Per-bucket tensors the saved states load into; states the checkpoint lacks are cleared."""
    if shard.views is None:
        e = shard.engine
        for name, flat in e.states().items():
            if name not in saved:
                flat.zero_()
        for name in saved:
            e.state(name)
        return shard.states()
    st = optimizer.shard_optimizer.state
    for v in shard.views:
        st[v] = {name: torch.zeros_like(v) for name in saved}
    return {name: [st[v][name] for v in shard.views] for name in saved}


def restore_scalars(optimizer, shard: LocalShard, objects: dict) -> None:
    """Generic path: each bucket view's scalar state ("step", ...), or the fused path's step counts."""
    groups = shard.engine.bucket_groups()
    st = optimizer.shard_optimizer.state
    for b, v in enumerate(shard.views):
        gi = groups[b]
        scal = objects["scalar_state"].get(gi)
        if scal is None and objects["steps"][gi] > 0 and st[v]:
            scal = {"step": torch.tensor(float(objects["steps"][gi]))}
        for k, t in (scal or {}).items():
            st[v][k] = t.clone() if torch.is_tensor(t) else t
        if not st[v]:
            del st[v]


# --------------------------------------------------------------------------- DCP entries
def _sharded(numel: int, chunks: list, local: list, rank: int):
    """A 1-D fp32 ShardedTensor of `numel`: chunks = every rank's (rank, offset, numel), local =
    this rank's (offset, tensor). ShardedTensorBase (torch's one private API used here) needs
    no process group; DTensor cannot express uneven element-granular pieces."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensorBase
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    # a placement names its pieces' device; other ranks' indices are unknown here and not read
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


def sharded_entries(shard: LocalShard, names: list, pieces_by_kind: dict, writing: bool) -> dict:
    """DCP entries of every kind ("model", "optim/<state>"): this rank's fragments among every
    rank's pieces. One partition: every rank holds all; only rank 0 writes it."""
    e = shard.engine
    parts, rank = e.partitions, e.rank
    chunks: list = [[] for _ in names]                    # every rank's pieces: (rank, offset, numel)
    for r in range(parts):
        for i, poff, _, n in e.fragments(r):
            chunks[i].append((r, poff, n))
    numel = [sum(n for _, _, n in c) for c in chunks]     # the pieces tile each parameter
    mine = [] if writing and parts == 1 and rank != 0 else shard.fragments
    out = {}
    for kind, pieces in pieces_by_kind.items():
        local: list = [[] for _ in names]
        for f in mine:
            local[f.param].append((f.param_offset, shard.piece(pieces, f)))
        for i, name in enumerate(names):
            if kind.startswith("optim/") and shard.atomic[i]:
                continue                                  # a whole tensor's state is under whole/
            if local[i] and numel[i] > 0:
                out[f"{kind}/{name}"] = _sharded(numel[i], chunks[i], local[i], rank)
    return out
