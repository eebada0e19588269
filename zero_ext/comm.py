"""Every collective zero_ext issues from Python, on tensors of the engine's device.

Note [One communication layer]
  An NCCL group carries CUDA tensors only, a CPU-only group CPU ones. So every collective
  runs on tensors of the engine's device (the parameters'), in one of two places: the C++
  engine's Communicator (csrc/engine/comm.h) for training, or this module for what Python
  does once (zeroify's checks, the inf-norm, checkpoints, consolidation). Objects travel
  as pickled bytes in a uint8 tensor on that device. tests/test_comm_layer.py fails on a
  collective that bypasses this. The one exception by design: the shard servers'
  messages, on a gloo group of their own (zero_ext/alone/channel.py).
"""
from __future__ import annotations

import pickle
import time

import torch
import torch.distributed as dist


def device_backend(backend: str, device_type: str | None = None) -> str:
    """The backend carrying `device_type` tensors in dist.get_backend's string ("cpu:gloo,cuda:nccl");
    without a device type: the one backend every device uses, or the whole string."""
    if ":" not in backend:
        return backend
    pairs = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    if device_type is not None and device_type in pairs:
        return pairs[device_type]
    names = set(pairs.values())
    return names.pop() if len(names) == 1 else backend


def check_device(pg, device: torch.device, backend: str) -> str | None:
    """None when `pg` can carry tensors of `device`, else the message naming the fix (no collective)."""
    try:   # the device types the group's backends carry
        devices = sorted({d.type for d in pg._device_types})
    except (AttributeError, RuntimeError):   # torch cannot tell
        devices = []
    if not devices or backend == "fake" or device.type in devices:
        return None
    fix = ("initialize the process group with a CPU backend: dist.init_process_group('gloo'), or "
           "'cpu:gloo,cuda:nccl' for both" if device.type == "cpu" else
           "initialize it with dist.init_process_group('nccl') (or 'cuda:gloo' for several ranks on one GPU), "
           "or move the model to the CPU")
    return (f"the model's parameters are on {device.type}, but the process group (backend {backend!r}) carries "
            f"only {', '.join(devices)} tensors, so no collective could run; {fix}")


class Comm:
    """The Python-side collectives of one zeroified model: every rank calls each, in the same order."""

    def __init__(self, pg, device: torch.device):
        self.pg = pg
        self.device = torch.device(device)
        self.world = pg.size() if pg is not None else 1
        self.rank = pg.rank() if pg is not None else 0
        self.delay_s = 0.0       # Note [Communication delay] (csrc/engine/comm.cpp): after each collective

    def _run(self, collective, *args, **kwargs) -> None:
        collective(*args, group=self.pg, **kwargs)
        if self.delay_s > 0:
            time.sleep(self.delay_s)

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.pg, rank)

    def all_gather_int64(self, values: list[int]) -> torch.Tensor:
        """(world, len(values)) int64 on the CPU: row r is rank r's values."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        if self.world == 1:
            return mine.cpu().view(1, -1)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        self._run(dist.all_gather, out, mine)
        return torch.stack(out).cpu()

    def all_reduce(self, values: list[float], op=dist.ReduceOp.MAX, dtype=torch.float64) -> list[float]:
        return self.all_reduce_(torch.tensor(values, dtype=dtype, device=self.device), op).cpu().tolist()

    def all_reduce_(self, t: torch.Tensor, op=dist.ReduceOp.MAX) -> torch.Tensor:
        """All-reduce `t` (a tensor on the engine's device) in place; nothing is read back."""
        if self.world > 1:
            self._run(dist.all_reduce, t, op=op)
        return t

    def broadcast_(self, tensors, src: int = 0) -> None:
        """Overwrite every tensor with rank `src`'s (one coalesced broadcast per dtype)."""
        if self.world == 1:
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        by_dtype: dict = {}
        for t in tensors:
            if t.numel() > 0:
                by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for ts in by_dtype.values():
                flat = _flatten_dense_tensors([t.data.to(self.device) for t in ts])
                self._run(dist.broadcast, flat, src=self._global(src))
                for t, v in zip(ts, _unflatten_dense_tensors(flat, ts)):
                    t.data.copy_(v)

    def broadcast_from(self, tensor: torch.Tensor | None, out: torch.Tensor, src: int) -> torch.Tensor:
        """Rank `src`'s `tensor` on every rank: in `out` (a reusable buffer of its numel and dtype)
        on the others."""
        buf = tensor.reshape(-1).to(self.device, out.dtype).contiguous() if self.rank == src else out
        if self.world > 1:
            self._run(dist.broadcast, buf, src=self._global(src))
        return buf

    def gather_to(self, tensor: torch.Tensor, out: torch.Tensor | None, dst: int = 0) -> torch.Tensor | None:
        """Every rank's `tensor` (the same numel on each), in rank order, in `out` (given on `dst`
        only) on rank `dst`; None elsewhere."""
        mine = tensor.reshape(-1).to(self.device).contiguous()
        if self.world == 1:
            out.copy_(mine)
            return out
        rows = list(out.view(self.world, -1).unbind(0)) if self.rank == dst else None
        self._run(dist.gather, mine, gather_list=rows, dst=self._global(dst))
        return out if self.rank == dst else None

    def broadcast_object(self, obj, src: int = 0):
        """Rank `src`'s object, on every rank."""
        if self.world == 1:
            return obj
        data = (torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
                if self.rank == src else None)
        size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64, device=self.device)
        self._run(dist.broadcast, size, src=self._global(src))
        if data is None:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._run(dist.broadcast, data, src=self._global(src))
        return obj if self.rank == src else pickle.loads(data.cpu().numpy().tobytes())

    def gather_object(self, obj, dst: int | None) -> list | None:
        """Every rank's object, in rank order, on rank `dst` (dst=None: every rank; None elsewhere),
        one broadcast per rank."""
        got = [self.broadcast_object(obj if r == self.rank else None, src=r) for r in range(self.world)]
        return got if dst is None or self.rank == dst else None


def delay_collectives(model_or_optimizer, ms: float, serialize: bool = False) -> None:
    """Make every collective of a zeroified model (the engine's and this module's) take at least
    `ms` milliseconds longer (Note [Communication delay], csrc/engine/comm.cpp); ms=0 turns it off.
    serialize=True waits for each where it is launched, so nothing overlaps. For tests of overlap."""
    core = getattr(model_or_optimizer, "zero_optimizer", model_or_optimizer)   # a part of several optimizers
    engine = getattr(core, "engine", None)   # an optimizer's, or a ZeroModel's
    if engine is None:
        raise TypeError(f"zero_ext: delay_collectives takes the model or optimizer zeroify() returned, "
                        f"got {type(model_or_optimizer).__name__}; pass one of those")
    if not ms >= 0:
        raise ValueError(f"zero_ext: delay_collectives: ms={ms!r}; pass 0 or more milliseconds")
    engine.set_comm_delay(float(ms), bool(serialize))
    comm = getattr(core, "comm", None)
    if comm is not None:
        comm.delay_s = ms / 1000.0
