"""What is alive at a training step's peak, by owner: bench_peak_gpu.py --snapshot DIR.

    rec = recorder(device)          # CUDA: torch.cuda.memory's history; CPU: a stand-in
    rec.begin()                     # before the step: the live blocks now, then every event
    step(x, y, mark=rec.phase)      # mark("forward"), ("backward"), ... as the step goes
    snap = rec.end()                # the history, as torch.cuda.memory._snapshot() gives it
    s = summarize(snap, owners, sizes)

Note [The live set at the peak]
  A snapshot is the allocator's state when it is taken, not at the peak; with the
  history recorded, the state at any moment in between can be rebuilt. begin() takes a
  snapshot (its live blocks, and a "snapshot" entry in the trace) and end() another,
  whose trace holds every event since: replaying alloc (+) and free_completed (-) from
  the first snapshot's blocks gives the allocated bytes after each event; the largest
  is the peak (checked against max_memory_allocated), and a second replay up to it
  gives the blocks alive there. Each block gets an owner: a tensor the system still
  holds that lies inside it (masters, states, parameters: allocated before the
  recording, so without frames), else its Python frames (zero_ext's gathers, FSDP2's
  all-gathers, the model's forward), else its size (a zero_ext ring slot), else the
  phase it was allocated in (backward: autograd's gradients). Reserved minus allocated
  at the peak is the allocator's slack. The CPU stand-in records op outputs' storages
  through a dispatch mode (alloc when a new storage appears, free when it dies), which
  misses storage resized in C++ (stage 3's gathers): it exercises this code, it
  measures nothing.
"""
from __future__ import annotations

import bisect
import gzip
import pickle
import traceback
import weakref

MAX_ENTRIES = 2_000_000     # events kept by the CUDA history: one 1.31B step is ~1e4
ROUND = 512                 # the caching allocator's block granularity


class CudaRecorder:
    """torch.cuda.memory's allocator history (Python frames) around one step."""

    def __init__(self, device):
        import torch
        self.torch, self.device = torch, device
        self.has_metadata = hasattr(torch.cuda.memory, "_set_memory_metadata")

    def begin(self):
        self.torch.cuda.synchronize()
        self.torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
        self.torch.cuda.reset_peak_memory_stats()
        self.start = self.torch.cuda.memory._snapshot()

    def phase(self, name: str):
        """Tags what is allocated from now on (torch's user metadata, where this torch has it)."""
        if self.has_metadata:
            self.torch.cuda.memory._set_memory_metadata(name)

    def end(self) -> dict:
        self.torch.cuda.synchronize()
        self.phase("")
        snap = self.torch.cuda.memory._snapshot()
        self.torch.cuda.memory._record_memory_history(enabled=None)
        return {"start": self.start, "end": snap, "device_index": self.torch.cuda.current_device(),
                "max_allocated": self.torch.cuda.max_memory_allocated(), "stand_in": False}


class CpuRecorder:
    """The stand-in (Note [The live set at the peak]): the same snapshot shape from a dispatch mode."""

    def __init__(self, device):
        from torch.utils._python_dispatch import TorchDispatchMode
        rec = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                rec._saw(out)
                return out

        self.mode_cls, self.live, self.trace, self.meta = Mode, {}, [], ""

    def _saw(self, out):
        import torch
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            try:
                st = t.untyped_storage()
                addr, size = st.data_ptr(), st.nbytes()
            except (RuntimeError, NotImplementedError):   # no data of its own (a DTensor's wrapper, ...)
                continue
            if size == 0 or addr in self.live:
                continue
            frames = [{"filename": f.filename, "line": f.lineno, "name": f.name}
                      for f in reversed(traceback.extract_stack()[:-3])]
            self.live[addr] = size
            self.trace.append({"action": "alloc", "addr": addr, "size": size, "frames": frames,
                               "user_metadata": self.meta})
            weakref.finalize(st, self._freed, addr, size)

    def _freed(self, addr, size):
        if self.live.pop(addr, None) is not None:
            self.trace.append({"action": "free_completed", "addr": addr, "size": size, "frames": []})

    def begin(self):
        self.trace.append({"action": "snapshot", "addr": 0, "size": 0, "frames": []})
        self.start = {"segments": [], "device_traces": [[]]}   # what existed before is not seen
        self.mode = self.mode_cls()
        self.mode.__enter__()

    def phase(self, name: str):
        self.meta = name

    def end(self) -> dict:
        self.mode.__exit__(None, None, None)
        self.meta = ""
        live = [{"address": a, "size": s, "requested_size": s, "state": "active_allocated", "frames": []}
                for a, s in self.live.items()]
        end = {"segments": [{"address": 0, "total_size": 0, "blocks": live}], "device_traces": [list(self.trace)]}
        return {"start": self.start, "end": end, "device_index": 0,
                "max_allocated": None, "stand_in": True}


def recorder(device):
    return CudaRecorder(device) if device.type == "cuda" else CpuRecorder(device)


# ----------------------------------------------------------------------------- the replay
def _live_blocks(snap) -> dict:
    return {b["address"]: b for seg in snap["segments"] for b in seg["blocks"]
            if b["state"] in ("active_allocated", "active_awaiting_free")}


def _events(rec) -> list:
    """The events after begin()'s snapshot (Note [The live set at the peak])."""
    trace = rec["end"]["device_traces"][rec["device_index"]]
    first = next((i for i, e in enumerate(trace) if e["action"] == "snapshot"), None)
    return trace[first + 1:] if first is not None else trace


def peak(rec) -> dict:
    """Allocated and reserved bytes at the step's peak and the blocks alive there."""
    start = _live_blocks(rec["start"])
    events = _events(rec)
    alloc = sum(b["size"] for b in start.values())
    reserved = sum(seg["total_size"] for seg in rec["start"]["segments"])
    best, best_at, best_reserved = alloc, -1, reserved
    for i, e in enumerate(events):
        a = e["action"]
        if a == "alloc":
            alloc += e["size"]
        elif a == "free_completed":
            alloc -= e["size"]
        elif a == "segment_alloc":
            reserved += e["size"]
        elif a == "segment_free":
            reserved -= e["size"]
        if alloc > best:
            best, best_at, best_reserved = alloc, i, reserved
    live = {a: dict(b, phase="before the step") for a, b in start.items()}
    for e in events[:best_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = {"address": e["addr"], "size": e["size"], "frames": e.get("frames") or [],
                               "phase": e.get("user_metadata") or ""}
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return {"allocated": best, "reserved": best_reserved if reserved or best_reserved else None,
            "events": len(events), "peak_event": best_at, "max_allocated": rec["max_allocated"],
            "blocks": sorted(live.values(), key=lambda b: -b["size"])}


# ----------------------------------------------------------------------------- owners
def _round(n: int) -> int:
    return (n + ROUND - 1) // ROUND * ROUND


def _by_frames(frames) -> str | None:
    """An owner from the Python frames of an allocation (innermost first), or None."""
    for f in frames:
        path, name = f.get("filename", ""), f.get("name", "")
        if "/zero_ext/" in path:
            if any(k in name for k in ("gather", "prefetch", "_need", "unshard")):
                return "gathered unit (zero_ext)"
            if name in ("hook", "mark_ready", "finalize_backward") or "reduce" in name:
                return "gradient reduction (zero_ext: ring, staging)"   # the grad hook enters C++ here
            if "step" in name:
                return "optimizer step (zero_ext)"
            return f"zero_ext {path.rsplit('/zero_ext/', 1)[1]}:{name}"
        if "/fsdp/" in path:
            names = [g.get("name", "") for g in frames if "/fsdp/" in g.get("filename", "")]
            if any(k in n for n in names for k in ("all_gather", "unshard", "copy_in")):
                return "gathered unit (FSDP2 all-gather)"
            if any(k in n for n in names for k in ("reduce", "post_backward")):
                return "gradient reduce-scatter (FSDP2)"
            return f"FSDP2 {path.rsplit('/', 1)[1]}:{name}"
        if "/torch/optim/" in path:
            return "optimizer step (temporaries)"
        if path.endswith("gpt.py"):
            return "activations (forward)"
    return None


def owner_of(block, owners, sizes) -> str:
    """Note [The live set at the peak]: held tensor inside it > frames > size > phase."""
    lo, hi = block["address"], block["address"] + block["size"]
    for name, (starts, ends) in owners.items():
        k = bisect.bisect_left(starts, lo)
        if k < len(starts) and starts[k] < hi and ends[k] <= hi:
            return name
    by_frames = _by_frames(block.get("frames") or [])
    if by_frames:
        return by_frames
    for name, nbytes in sizes.items():
        if nbytes and block["size"] == _round(nbytes):
            return name
    phase = block.get("phase") or ""
    if phase == "backward":
        return "backward (autograd: gradients, activation gradients)"
    if phase == "before the step":
        return "held across steps (not named)"
    return f"{phase or 'no phase'} (no Python frame)"


def held(named_tensors) -> dict:
    """{owner: (sorted data_ptrs, their ends)} from {owner: [tensor, ...]}; empty ones left out."""
    out = {}
    for name, tensors in named_tensors.items():
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                       for t in tensors if t is not None and t.numel() > 0)
        if spans:
            out[name] = ([s for s, _ in spans], [e for _, e in spans])
    return out


def summarize(rec, owners: dict, sizes: dict, top: int = 25) -> dict:
    """The peak, bytes by owner (allocator slack included), and the largest live blocks."""
    p = peak(rec)
    by_owner: dict = {}
    rows = []
    for b in p["blocks"]:
        o = owner_of(b, owners, sizes)
        by_owner[o] = by_owner.get(o, 0) + b["size"]
        if len(rows) < top:
            where = [f"{f.get('filename', '?').rsplit('/', 2)[-1]}:{f.get('line', '?')} {f.get('name', '?')}"
                     for f in (b.get("frames") or [])[:3]]
            rows.append({"bytes": b["size"], "owner": o, "phase": b.get("phase", ""), "frames": where})
    if p["reserved"] is not None:
        by_owner["allocator slack (reserved - allocated)"] = p["reserved"] - p["allocated"]
    return {"stand_in": rec["stand_in"], "allocated_at_peak": p["allocated"], "reserved_at_peak": p["reserved"],
            "max_memory_allocated": p["max_allocated"], "events": p["events"], "peak_event": p["peak_event"],
            "live_blocks": len(p["blocks"]), "by_owner": dict(sorted(by_owner.items(), key=lambda kv: -kv[1])),
            "largest_blocks": rows}


def save(rec, path) -> None:
    """Both snapshots, gzipped (pytorch.org/memory_viz reads the "end" one: gunzip, then load)."""
    with gzip.open(path, "wb") as f:
        pickle.dump({k: rec[k] for k in ("start", "end")}, f)


def lines(system: str, s: dict) -> list:
    """A short text report of summarize()'s dict."""
    GiB = 2 ** 30
    head = (f"{system}: allocated at the peak {s['allocated_at_peak'] / GiB:.3f} GiB"
            + (f" (max_memory_allocated {s['max_memory_allocated'] / GiB:.3f})" if s["max_memory_allocated"] else "")
            + (f", reserved {s['reserved_at_peak'] / GiB:.3f}" if s["reserved_at_peak"] is not None else "")
            + f"; {s['live_blocks']} live blocks, peak at event {s['peak_event']} of {s['events']}"
            + (" [CPU stand-in: exercises the code, measures nothing]" if s["stand_in"] else ""))
    out = [head, "  by owner (GiB):"]
    out += [f"    {v / GiB:9.3f}  {k}" for k, v in s["by_owner"].items()]
    out.append("  largest live blocks:")
    out += [f"    {r['bytes'] / GiB:9.4f}  {r['owner']:<45} {r['phase']:<16} {' < '.join(r['frames'])}"
            for r in s["largest_blocks"][:10]]
    return out

