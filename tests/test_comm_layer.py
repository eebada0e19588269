"""Every collective zero_ext issues goes through one communication layer, on tensors of
the engine's device (Note [One communication layer] in zero_ext/comm.py).

A process group made by init_process_group("nccl") carries CUDA tensors only: a
collective on a CPU tensor that works on gloo kills the multi-GPU launch. This machine
has no GPU, so the guard is a spy: every torch.distributed collective a rank calls
while it exercises each feature (zeroify's checks and broadcast, the meta-device build,
the inf- and 2-norms, fp16 loss scaling, stage="auto", the sequence check, gathered
parameters, save / load at another world size / consolidation, pretrained weights in and
out, whole-tensor optimizers, stats, the estimator) is recorded with the first frame outside torch that called it.
A call from zero_ext anywhere but zero_ext/comm.py, or one that carries a tensor of
another device than the engine's, fails the test. torch.distributed.checkpoint (DCP)
is torch's own layer: it picks its device from the group's backends, which zeroify
checks agree with the engine's device.

The bad-input half: a group whose backends cannot carry the model's device (here a CPU
model on a "cuda:gloo" group, the shape "nccl" has) is refused by zeroify with a
ZeroInputError naming both devices and the fix, on every rank, before any collective.
"""
import os
import threading
import time

import pytest
import torch
from torch import nn

from dist_harness import run_world

pytestmark = pytest.mark.dist

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
               "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
               "gather", "gather_object", "irecv", "isend", "recv", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "scatter", "scatter_object_list", "send")
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
DCP_DIR = os.path.join(TORCH_DIR, "distributed", "checkpoint") + os.sep


class Spy:
    """Wraps torch.distributed's collectives; records (name, origin file, devices) of the
    outermost call in each thread (torch's own object collectives call the tensor ones)."""

    def __init__(self):
        import torch.distributed as dist
        self.dist, self.saved, self.calls = dist, {}, []
        self.local = threading.local()
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self.saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def spy(*args, **kwargs):
            depth = getattr(self.local, "depth", 0)
            if depth == 0:
                self.calls.append((name, *self._origin(), self._devices(args, kwargs)))
            self.local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.local.depth = depth
        return spy

    @staticmethod
    def _origin():
        """(first caller file outside torch, whether DCP is on the way)."""
        import sys
        f, via_dcp = sys._getframe(2), False
        while f is not None and f.f_code.co_filename.startswith(TORCH_DIR):
            via_dcp = via_dcp or f.f_code.co_filename.startswith(DCP_DIR)
            f = f.f_back
        return (f.f_code.co_filename if f is not None else "?"), via_dcp

    @staticmethod
    def _devices(args, kwargs):
        out = set()
        for a in list(args) + list(kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else [a]):
                if isinstance(t, torch.Tensor):
                    out.add(t.device.type)
        return sorted(out)

    def close(self):
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)

    def violations(self, engine_device: str):
        import zero_ext
        pkg = os.path.dirname(zero_ext.__file__) + os.sep
        layer = os.path.join(pkg, "comm.py")
        bad = []
        for name, origin, via_dcp, devices in self.calls:
            if not origin.startswith(pkg):
                continue                                   # the test's own DDP reference, barriers
            if origin != layer and not via_dcp:
                bad.append(f"{name} called from {os.path.relpath(origin, pkg)} (not zero_ext/comm.py)")
            if any(d != engine_device for d in devices):
                bad.append(f"{name} from {os.path.relpath(origin, pkg)} on {devices}, engine on {engine_device}")
        return bad

    def through_layer(self):
        import zero_ext
        layer = os.path.join(os.path.dirname(zero_ext.__file__), "comm.py")
        return sum(1 for _, origin, _, _ in self.calls if origin == layer)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 24)
        self.blocks = nn.ModuleList(nn.Linear(24, 24) for _ in range(3))
        self.head = nn.Linear(24, 50)
        self.register_buffer("seen", torch.zeros(2))   # broadcast from rank 0 with the parameters

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.head(h).logsumexp(-1).mean()


class NetPlus(Net):
    """Net and a module that no checkpoint of Net has."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(24, 24)


def _steps(zm, zo, rank, n=2, clip=None):
    for k in range(n):
        x = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(10 * k + rank))
        zm(x).backward()
        if clip is not None:
            zo.clip_grad_norm_(1.0, norm_type=clip)
        zo.step()
        zo.zero_grad()


def _features(rank, world, tmp):
    """Each feature that communicates, once. Returns the spy's verdict."""
    import zero_ext
    spy = Spy()
    try:
        # zeroify's agreement check and broadcast; inf- and 2-norm clipping; stats
        m = Net()
        zm, zo = zero_ext.zeroify(m, torch.optim.AdamW(m.parameters(), lr=1e-3), stage=2, param_dtype="bf16")
        _steps(zm, zo, rank, clip=float("inf"))
        _steps(zm, zo, rank, clip=2.0)
        zo.stats()
        # save at this world size, load, consolidate; gathered parameters with a modifier
        zero_ext.save(os.path.join(tmp, "ck"), zm, zo)
        zero_ext.load(os.path.join(tmp, "ck"), zm, zo)
        zero_ext.consolidated_state_dict(zm, zo, to=world - 1)
        with zero_ext.gathered_parameters(zm.module.head, modifier_rank=0):
            pass
        # pretrained weights: streamed out to rank 0, a meta build filled from them (a new module initialized
        # from rank 0's draw), a load into a zeroified model
        zero_ext.save_pretrained(zm, os.path.join(tmp, "hf"))
        with torch.device("meta"):
            mw = NetPlus()
        zmw, _ = zero_ext.zeroify(mw, torch.optim.AdamW(mw.parameters()), stage=3,
                                  weights=zero_ext.Weights(os.path.join(tmp, "hf"), allow_missing=["extra"]))
        zero_ext.load_weights(zmw, os.path.join(tmp, "hf"), allow_missing=["extra"])
        # stage 3 built on the meta device (the build's verdict), loading the stage-2 checkpoint
        with zero_ext.meta_parameters():
            m3 = Net()
        zm3, zo3 = zero_ext.zeroify(m3, torch.optim.AdamW(m3.parameters(), lr=1e-3), stage=3,
                                    init_fn=lambda mod: None)
        zero_ext.load(os.path.join(tmp, "ck"), zm3, zo3)
        _steps(zm3, zo3, rank)
        zm3.state_dict()
        # fp16 loss scaling; the sequence check; stage="auto" (the least free memory over ranks)
        m = Net()
        zm, zo = zero_ext.zeroify(m, torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9), stage=1,
                                  param_dtype="fp16", check_sequence=True)
        _steps(zm, zo, rank, clip=2.0)
        m = Net()
        zm, zo = zero_ext.zeroify(m, torch.optim.AdamW(m.parameters()), stage="auto")
        _steps(zm, zo, rank)
        # whole-tensor optimizers (per-tensor states gathered to one rank)
        m = Net()
        mats = [b.weight for b in m.blocks]
        rest = [p for p in m.parameters() if all(p is not w for w in mats)]
        zm, (zmuon, zadam) = zero_ext.zeroify(m, [torch.optim.Muon(mats, lr=1e-2), torch.optim.AdamW(rest)],
                                             stage=2)
        for _ in range(2):
            zm(torch.randint(0, 50, (4, 8))).backward()
            zmuon.step()
            zadam.step()
            zmuon.zero_grad()
            zadam.zero_grad()
        zero_ext.consolidated_state_dict(zm, zmuon, to=0)
        m = Net()
        zero_ext.estimate_memory(m, world, 3, optimizer=torch.optim.AdamW(m.parameters()))
    finally:
        spy.close()
    return {"violations": spy.violations("cpu"), "through_layer": spy.through_layer(),
            "calls": len(spy.calls)}


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_goes_through_the_layer(world, tmp_path):
    outs = run_world(_features, world, str(tmp_path), timeout_s=300)
    for rank, out in enumerate(outs):
        assert out["through_layer"] > 0, f"rank {rank}: the spy saw no collective of zero_ext/comm.py"
        assert not out["violations"], f"rank {rank}: collectives outside the layer:\n" + "\n".join(
            sorted(set(out["violations"])))


def _wrong_backend(rank, world):
    import torch.distributed as dist
    import zero_ext
    pg = dist.new_group(backend="cuda:gloo")       # backends for CUDA tensors only, as "nccl"
    m = Net()
    t0 = time.monotonic()
    try:
        zero_ext.zeroify(m, torch.optim.AdamW(m.parameters()), stage=2, process_group=pg)
    except zero_ext.ZeroInputError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None}


def test_group_that_cannot_carry_the_device_is_refused():
    outs = run_world(_wrong_backend, 2, timeout_s=60)
    for rank, out in enumerate(outs):
        msg = out["error"]
        assert msg is not None, f"rank {rank}: zeroify accepted a CPU model on a CUDA-only group"
        assert "cpu" in msg and "cuda" in msg and "init_process_group('gloo')" in msg, msg
        assert out["seconds"] < 10, out
