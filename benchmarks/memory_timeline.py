"""Memory over one training step, as the process sees it and as zero_ext accounts for it.

    probe = Timeline(blocks, engine_stats=opt.stats)   # before the step to record
    with probe:
        ...one step...
    probe.rows()    # [{"t": s, "rss": MiB, "label": ..., "owners": {...}}]

A thread samples the resident set (/proc/self/statm) every `period` seconds; markers, taken
on the main thread at each block's forward start/end and backward start/end, add the
engine's own accounting (opt.stats()), the bytes of tensors autograd saved for backward
(activations: saved_tensors_hooks, each storage once, the parameters' storages left out) and
glibc's free bytes still held by the process (allocator slack: mallinfo2's fordblks).
Gathered stage-3 units are split into those the mark's blocks and the root use (at "bwd end
k": block k, done, and k - 1, next) and those held ahead of their use ("prefetch": the forward window, the last unit kept for backward,
the backward window).
"""
from __future__ import annotations

import ctypes
import os
import re
import threading
import time
import weakref

import torch

MiB = 2 ** 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / MiB


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _slack_reader():
    try:
        f = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):   # not glibc, or older than 2.33: slack stays in "unexplained"
        return lambda: 0.0
    f.restype = _Mallinfo2
    return lambda: f().fordblks / MiB


allocator_slack = _slack_reader()


def _storage_ptr(t) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:   # a wrapper subclass (FSDP2's sharded DTensor parameters)
        return 0


class _Saved:
    """The tensors autograd saved for backward, alive now (weak references), but for views of
    the parameters as the module held them when saved (a gathered unit is not an activation)."""

    def __init__(self, module):
        self.module, self.refs = module, []

    def pack(self, t):
        if _storage_ptr(t) not in {_storage_ptr(p) for p in self.module.parameters()}:
            self.refs.append(weakref.ref(t))
        return t

    def bytes(self) -> int:
        seen, n, alive = set(), 0, []
        for r in self.refs:
            t = r()
            if t is None:
                continue
            alive.append(r)
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr in seen or s.nbytes() == 0:
                continue
            seen.add(ptr)
            n += s.nbytes()
        self.refs = alive
        return n


def engine_owners(opt, blocks: int = 0) -> callable:
    """zero_ext's own accounting (opt.stats()), in MiB, by owner. With stage 3 and `blocks`
    units after the root (unit k + 1 is block k), the gathered bytes of units other than the
    root and the marked blocks are "prefetch" (split by numel: a unit's share of the meter)."""
    engine = opt.engine

    def owners(marked=frozenset()) -> dict:
        s = opt.stats()
        msb, held, buf = s["model_state_bytes"], s["held_bytes"], s["buffer_bytes"]
        gathered, ahead = buf["gathered_params"] / MiB, 0.0
        if gathered and engine.num_units == blocks + 1:
            held_units = [u for u in range(engine.num_units) if engine.unit_gathered(u) or engine.unit_requested(u)]
            numel = {u: engine.unit_numel(u) for u in held_units}
            in_use = {0} | {b + 1 for b in marked}
            ahead = gathered * sum(n for u, n in numel.items() if u not in in_use) / max(1, sum(numel.values()))
        host = s["offload"]["total"] if s["offload"] else 0   # offload="cpu": model state in this process too
        return {"model_state": (msb["parameters"] + msb["master_weights"] + msb["optimizer_states"] + host) / MiB,
                "gradients": held["gradients"] / MiB, "grad_ring": held["grad_ring"] / MiB,
                "gathered_units": gathered - ahead, "prefetch": ahead}
    return owners


def torch_owners(module, opt, blocks=()) -> callable:
    """What DDP's or FSDP2's parameters, gradients and optimizer states hold now, in MiB:
    local shards (DTensor.to_local()) as model state, unsharded parameters as gathered units
    (those of `blocks` other than the marked one as prefetch)."""
    def nbytes(t) -> int:
        return t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes

    def owners(marked=frozenset()) -> dict:
        params = [p for g in opt.param_groups for p in g["params"]]   # FSDP2: the sharded ones, always
        sharded = [p for p in params if hasattr(p, "to_local")]
        states = sum(nbytes(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        out = {"model_state": (sum(nbytes(p) for p in params) + states) / MiB,
               "gradients": sum(nbytes(p.grad) for p in params if p.grad is not None) / MiB}
        if sharded:   # FSDP2: the modules hold the unsharded parameters while gathered
            def unsharded(root):
                return {id(t): t.nbytes for m in root.modules() for t in m._parameters.values()
                        if t is not None and not hasattr(t, "to_local")}
            every = unsharded(module)
            ahead = sum(n for i, b in enumerate(blocks) if i not in marked for n in unsharded(b).values())
            out["model_state"] = (sum(nbytes(p) for p in sharded) + states) / MiB
            out["gathered_units"] = (sum(every.values()) - ahead) / MiB
            out["prefetch"] = ahead / MiB
        return out
    return owners


class Timeline:
    def __init__(self, blocks, module, owners=None, period: float = 0.0005):
        self.blocks, self.module, self.owners, self.period = list(blocks), module, owners, period
        self.samples, self.marks, self._handles = [], [], []
        self._saved = _Saved(module)
        self._stop = threading.Event()

    # -- markers
    def _owners(self, label: str) -> dict:
        out = {"activations": self._saved.bytes() / MiB, "allocator_slack": allocator_slack()}
        if self.owners is not None:
            m = re.search(r"(\d+)$", label)
            k = int(m.group(1)) if m else None
            # at "bwd end k" block k is done (its unit maybe not yet freed) and k - 1 comes next: both in use
            out.update(self.owners(set() if k is None else {k, k - 1} if label.startswith("bwd end") else {k}))
        return out

    def mark(self, label: str) -> None:
        rss = rss_mib()
        self.marks.append({"t": time.perf_counter() - self.t0, "rss": rss, "label": label,
                           "owners": self._owners(label)})

    def _hooks(self):
        def on(i, what):
            return lambda *_: self.mark(f"{what} {i}")

        for i, b in enumerate(self.blocks):
            self._handles.append(b.register_forward_pre_hook(on(i, "fwd")))

            def post(m, args, out, i=i):
                self.mark(f"fwd end {i}")
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(lambda g, i=i: self.mark(f"bwd {i}"))
                x = args[0] if args else None
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    x.register_hook(lambda g, i=i: self.mark(f"bwd end {i}"))
            self._handles.append(b.register_forward_hook(post))

    # -- the sampler
    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self.t0, rss_mib()))
            time.sleep(self.period)

    def __enter__(self):
        self.t0 = time.perf_counter()
        self._hooks()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._saved.pack, lambda t: t)
        self._ctx.__enter__()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.mark("step start")
        return self

    def __exit__(self, *exc):
        self.mark("step end")
        self._stop.set()
        self._thread.join()
        self._ctx.__exit__(*exc)
        for h in self._handles:
            h.remove()
        return False

    def result(self, base: float) -> dict:
        """Samples and marks, in MiB above `base` (the process before the model)."""
        return {"samples": [(t, r - base) for t, r in self.samples],
                "marks": [dict(m, rss=m["rss"] - base) for m in self.marks]}


OWNERS = ("model_state", "gradients", "grad_ring", "gathered_units", "prefetch", "activations",
          "allocator_slack")


def breakdown(timeline: dict) -> dict:
    """The peak sample of a recorded step, split by owner as the last mark before it saw them.
    `process` is what the process holds beyond every owner between steps (torch, the
    allocator, libraries: the last mark's resident memory minus its owners), and
    `unexplained` what no owner accounts for at the peak (autograd's temporaries between two
    marks: gradients being computed, the loss's buffers)."""
    samples, marks = timeline["samples"], timeline["marks"]
    t_peak, peak = max(samples, key=lambda s: s[1])
    at = [m for m in marks if m["t"] <= t_peak][-1]
    end = marks[-1]
    process = end["rss"] - sum(end["owners"].get(k, 0.0) for k in OWNERS)
    out = {"at": at["label"], "peak": peak, "process": process}
    out.update({k: at["owners"].get(k, 0.0) for k in OWNERS})
    out["unexplained"] = peak - process - sum(out[k] for k in OWNERS)
    return out


def loss_floor(timeline: dict) -> dict:
    """What a system must hold around the loss: the most resident between the "loss" mark and
    the next one (the loss's backward, the head's), less the units it holds gathered ahead of
    their use there. Torch, the model state, the root, the activations and the loss's own
    temporaries are all in it: a peak below this needs less of one of them."""
    samples, marks = timeline["samples"], timeline["marks"]
    i = next(i for i, m in enumerate(marks) if m["label"] == "loss")
    end = marks[i + 1]["t"] if i + 1 < len(marks) else float("inf")
    at_loss = max(r for t, r in samples if marks[i]["t"] <= t < end)
    ahead = marks[i]["owners"].get("prefetch", 0.0)
    return {"at_loss": at_loss, "ahead": ahead, "floor": at_loss - ahead}
