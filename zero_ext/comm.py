"""comm.py — every collective zero_ext issues from Python, on tensors of the engine's device.

Note [One communication layer]
  A group made by init_process_group("nccl") carries CUDA tensors only; a CPU tensor
  fails there ("No backend type associated with device type cpu"). A CPU-only group
  refuses CUDA tensors. So every collective zero_ext issues runs on tensors of the
  engine's device (the parameters'), through one of two places:
  - the C++ engine's Communicator (csrc/engine/comm.h), for training;
  - this module, for what Python does once: zeroify's agreement check and broadcast,
    the meta build's verdict, the inf-norm, checkpoint verdicts and consolidation.
  Objects travel as pickled bytes in a uint8 tensor on that device, so nothing depends
  on torch.cuda.current_device(). torch.distributed.checkpoint chooses its own
  collectives' device from the group's `_device_types`, which check_device makes agree.
  tests/test_comm_layer.py fails on a collective that bypasses this module or carries a
  tensor of another device. One side channel carries CPU tensors by design: the shard
  servers' messages, point to point on a gloo group of their own
  (zero_ext/alone/channel.py), never on the engine's group.
"""
from __future__ import annotations

import pickle
import time

import torch
import torch.distributed as dist


def group_devices(pg) -> list[str]:
    """Device types the group's backends carry ([] when torch cannot tell)."""
    try:
        return sorted({d.type for d in pg._device_types})
    except (AttributeError, RuntimeError):
        return []


def device_backend(backend: str, device_type: str | None = None) -> str:
    """The backend that carries `device_type` tensors in a backend string as dist.get_backend
    gives it: "gloo", "cuda:gloo", "cpu:gloo,cuda:nccl". Without a device type: the one backend
    every device uses, or the whole string when they differ."""
    if ":" not in backend:
        return backend
    pairs = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    if device_type is not None and device_type in pairs:
        return pairs[device_type]
    names = set(pairs.values())
    return names.pop() if len(names) == 1 else backend


def check_device(pg, device: torch.device, backend: str) -> str | None:
    """None when `pg` can carry tensors of `device`, else the message naming both and the fix.
    Local and deterministic (no collective), so every rank reaches the same verdict."""
    devices = group_devices(pg)
    if not devices or backend == "fake" or device.type in devices:
        return None
    fix = ("initialize the process group with a CPU backend: dist.init_process_group('gloo'), or "
           "'cpu:gloo,cuda:nccl' for both" if device.type == "cpu" else
           "initialize it with dist.init_process_group('nccl') (or 'cuda:gloo' for several ranks on one GPU), "
           "or move the model to the CPU")
    return (f"the model's parameters are on {device.type}, but the process group (backend {backend!r}) carries "
            f"only {', '.join(devices)} tensors, so no collective could run; {fix}")


class Comm:
    """The Python-side collectives of one zeroified model: process group + the engine's device.

    Every method is a collective: every rank of the group calls it, in the same order.
    With no group (world size 1) each method returns what the one rank holds."""

    def __init__(self, pg, device: torch.device):
        self.pg = pg
        self.device = torch.device(device)
        self.world = pg.size() if pg is not None else 1
        self.rank = pg.rank() if pg is not None else 0
        self.delay_s = 0.0       # Note [Communication delay] (csrc/engine/comm.cpp): after each collective

    def _delayed(self) -> None:
        if self.delay_s > 0:
            time.sleep(self.delay_s)

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.pg, rank)

    # ---- tensors
    def all_gather_int64(self, values: list[int]) -> torch.Tensor:
        """(world, len(values)) int64 on the CPU: row r is rank r's values."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        if self.world == 1:
            return mine.cpu().view(1, -1)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine, group=self.pg)
        self._delayed()
        return torch.stack(out).cpu()

    def all_reduce(self, values: list[float], op=dist.ReduceOp.MAX, dtype=torch.float64) -> list[float]:
        t = torch.tensor(values, dtype=dtype, device=self.device)
        if self.world > 1:
            dist.all_reduce(t, op=op, group=self.pg)
            self._delayed()
        return t.cpu().tolist()

    def all_reduce_(self, t: torch.Tensor, op=dist.ReduceOp.MAX) -> torch.Tensor:
        """All-reduce `t` (a tensor on the engine's device) in place; nothing is read back."""
        if self.world > 1:
            dist.all_reduce(t, op=op, group=self.pg)
            self._delayed()
        return t

    def broadcast_(self, tensors, src: int = 0) -> None:
        """Overwrite every tensor with rank `src`'s (one coalesced broadcast per dtype);
        tensors on another device than the engine's are staged through it."""
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
                dist.broadcast(flat, src=self._global(src), group=self.pg)
                self._delayed()
                for t, v in zip(ts, _unflatten_dense_tensors(flat, ts)):
                    t.data.copy_(v)

    def broadcast_from(self, tensor: torch.Tensor | None, out: torch.Tensor, src: int) -> torch.Tensor:
        """Rank `src`'s `tensor` on every rank, in `out` (a reusable engine-device buffer
        of its numel and dtype) on the others; `src` gets its own tensor back. Streams a
        shard to one rank (consolidation) one piece at a time."""
        if self.rank == src:
            buf = tensor.reshape(-1).to(self.device, out.dtype).contiguous()
        else:
            buf = out
        if self.world > 1:
            dist.broadcast(buf, src=self._global(src), group=self.pg)
            self._delayed()
        return buf

    def gather_to(self, tensor: torch.Tensor, out: torch.Tensor | None, dst: int = 0) -> torch.Tensor | None:
        """Every rank's `tensor` (1-D, the same numel on every rank), in rank order, in `out`
        (world * numel elements of the engine's device, given on `dst` only) on rank `dst`;
        None elsewhere. Streams a bucket's slices to one writing rank (save_pretrained)."""
        mine = tensor.reshape(-1).to(self.device).contiguous()
        if self.world == 1:
            out.copy_(mine)
            return out
        rows = list(out.view(self.world, -1).unbind(0)) if self.rank == dst else None
        dist.gather(mine, gather_list=rows, dst=self._global(dst), group=self.pg)
        self._delayed()
        return out if self.rank == dst else None

    # ---- objects (pickled into uint8 tensors on the engine's device)
    def _bytes_of(self, obj) -> torch.Tensor:
        return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)

    @staticmethod
    def _object_of(t: torch.Tensor):
        return pickle.loads(t.cpu().numpy().tobytes())

    def broadcast_object(self, obj, src: int = 0):
        """Rank `src`'s object, on every rank."""
        if self.world == 1:
            return obj
        data = self._bytes_of(obj) if self.rank == src else None
        size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=self._global(src), group=self.pg)
        self._delayed()
        if data is None:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(data, src=self._global(src), group=self.pg)
        self._delayed()
        return obj if self.rank == src else self._object_of(data)

    def gather_object(self, obj, dst: int | None) -> list | None:
        """Every rank's object, in rank order, on rank `dst` (None elsewhere; dst=None: on
        every rank): one broadcast per rank, so a rank holds one other rank's bytes at a time."""
        got = [self.broadcast_object(obj if r == self.rank else None, src=r) for r in range(self.world)]
        return got if dst is None or self.rank == dst else None


def delay_collectives(model_or_optimizer, ms: float, serialize: bool = False) -> None:
    """Make every collective of a zeroified model take at least `ms` milliseconds longer, as
    if the link were that slow (Note [Communication delay], csrc/engine/comm.cpp): the
    engine's (C++: gradient reduce-scatters, parameter gathers, prefetches; on CUDA a sleep
    on a side stream the collective waits for) and this module's. serialize=True waits for
    each collective where it is launched, so nothing overlaps: a step then costs its
    compute plus every delay. ms=0 turns it off. For tests and benchmarks of overlap
    (tests/test_overlap.py, benchmarks/bench_step.py --comm-delay-ms)."""
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
