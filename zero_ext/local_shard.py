"""This rank's share of the sharded state, for checkpoints and the shard servers (Note [Fragment
views] in csrc/engine/fragment_view.h, Note [State windows] in csrc/engine/fill.cpp)."""
from __future__ import annotations

import torch


class LocalShard:
    """Per bucket: the fp32 masters, each per-element optimizer state, and the fragments saying
    which piece of which parameter lies where in them."""

    def __init__(self, optimizer):
        self.opt = optimizer = getattr(optimizer, "zero_optimizer", optimizer)   # a part: the shared one
        self.engine = e = optimizer.engine
        self.masters = e.param_shards()                     # per bucket, 1-D views of this rank's slice
        self.fragments = e.fragment_views()                 # this rank's pieces, bucket by bucket
        self.atomic = [o >= 0 for o in e.owners()]          # whole tensors: per-tensor state only
        self.windows = e.state_windows()                    # per bucket: (lo, numel, flat offset)
        self.views = optimizer.bucket_views() if optimizer.shard_optimizer is not None else None   # per bucket

    def states(self) -> dict:
        """name -> per-bucket 1-D tensors of each per-element optimizer state."""
        if self.views is None:   # Note [State windows] (csrc/engine/fill.cpp)
            lo = [lo for lo, _, _ in self.windows]
            return {name: Windows([flat.narrow(0, off, n) for _, n, off in self.windows], lo)
                    for name, flat in self.engine.states().items()}
        state = self.opt.shard_optimizer.state
        names = sorted({k for v in self.views for k, t in state.get(v, {}).items() if _per_element(t, v)})
        return {n: [state[v][n] for v in self.views] for n in names}

    def kinds(self) -> dict:
        """The masters ("model"), then each state ("optim/<name>") by name: as servers send them."""
        states = self.states()
        return {"model": self.masters, **{f"optim/{s}": states[s] for s in sorted(states)}}

    def scalar_state(self) -> dict:
        """Generic path: group -> the optimizer's non-per-element state ("step", ...)."""
        if self.views is None:
            return {}
        out = {}
        for v, gi in zip(self.views, self.engine.bucket_groups()):
            s = self.opt.shard_optimizer.state.get(v, {})
            if gi not in out and s:
                out[gi] = {k: (t.clone() if torch.is_tensor(t) else t) for k, t in s.items()
                           if not _per_element(t, v)}
        return out

    def piece(self, pieces: list, f) -> torch.Tensor:
        """Fragment `f`'s elements of the per-bucket `pieces`: a view, or zeros outside a state window."""
        b, n = f.bucket, f.numel
        at = f.slice_offset - (pieces.lo[b] if isinstance(pieces, Windows) else 0)
        if at < 0 or at + n > pieces[b].numel():
            return torch.zeros(n, dtype=pieces[b].dtype)
        return pieces[b].narrow(0, at, n)

    def full(self, pieces: list, b: int) -> torch.Tensor:
        """Bucket b's slice of `pieces`, slice-sized (zeros outside a state window), in fp32."""
        n = self.masters[b].numel()
        if not isinstance(pieces, Windows) or (pieces.lo[b] == 0 and pieces[b].numel() == n):
            return pieces[b].float()
        out = torch.zeros(n, dtype=torch.float32)
        out.narrow(0, pieces.lo[b], pieces[b].numel()).copy_(pieces[b])
        return out


class Windows(list):
    """Per bucket, a per-element state over the window of its slice starting at lo[b]."""

    def __init__(self, tensors: list, lo: list):
        super().__init__(tensors)
        self.lo = lo


def _per_element(t, view) -> bool:
    return torch.is_tensor(t) and t.dim() == 1 and t.shape == view.shape


