"""stage="auto": the stage that fits a per-rank memory budget with the fewest bytes
communicated per step, from zero_ext.estimate_memory. No collective is involved."""
from __future__ import annotations

import dataclasses
import os

import torch

from ._C import smallest_world
from .offload import available_host_bytes

_MAX_WORLD = 1 << 24


def _fmt(b: float) -> str:
    if b >= 2 ** 30:
        return f"{b / 2 ** 30:.2f} GiB"
    return f"{b / 2 ** 20:.1f} MiB" if b >= 2 ** 20 else f"{b / 2 ** 10:.1f} KiB"


def free_memory(model) -> tuple[int, str]:
    """(bytes, their source): the model's device's free memory; CPU: MemAvailable / LOCAL_WORLD_SIZE."""
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free), f"free memory of {dev}"
    avail = available_host_bytes()
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return avail // local, f"available RAM / {local} local rank(s)"


def _estimates(model, optimizer, cfg, world: int, backend: str, stages) -> dict:
    # imported late, as zero_ext/__init__.py does, so that `python -m zero_ext.estimate` runs clean
    from .estimate import estimate_memory
    out = {}
    for s in stages:
        c = dataclasses.replace(cfg, stage=s, process_group=None)
        out[s] = estimate_memory(model, world, s, optimizer=optimizer, backend=backend, config=c,
                                 param_dtype=cfg.param_dtype, reduce_dtype=cfg.reduce_dtype)
    return out


def choose_stage(model, optimizer, cfg, world: int, backend: str, meta: bool = False,
                 free: tuple[int, str] | None = None) -> tuple[int, str]:
    """(stage, why). Raises ValueError naming the smallest world size that fits when none does.
    free: (bytes, source) when memory_budget is None (zeroify: the smallest over ranks)."""
    if cfg.memory_budget is not None:
        budget, source = cfg.memory_budget, "memory_budget"
    else:
        budget, source = free if free is not None else free_memory(model)
    quant = cfg.grad_quant is not None or cfg.param_quant is not None
    stages = [3] if meta else [1, 2, 3] if quant else [0, 1, 2, 3]
    est = _estimates(model, optimizer, cfg, world, backend, stages)
    fits = [s for s in stages if est[s]["total"] <= budget]
    need = ", ".join(f"stage {s} {_fmt(est[s]['total'])}" for s in stages)
    accum = f", {cfg.accumulation_steps} micro-steps per step" if cfg.accumulation_steps > 1 else ""
    if not fits:
        def fit(n):   # (n, the stage that fits at world size n, its bytes), or None
            e = _estimates(model, optimizer, cfg, n, backend, stages)
            ok = [s for s in stages if e[s]["total"] <= budget]
            return (n, min(ok, key=lambda s: e[s]["total"]), min(e[s]["total"] for s in ok)) if ok else None

        n = smallest_world(world, _MAX_WORLD, lambda n: fit(n) is not None)   # csrc/engine/model_state.h
        smallest = fit(n) if n else None   # the smallest N > world at which a stage fits
        where = (f"the smallest world size at which one fits is {smallest[0]} (stage {smallest[1]}, "
                 f"{_fmt(smallest[2])} per rank)" if smallest else
                 "no world size fits: what every rank keeps whole (frozen parameters in stages 0-2, stage 3's root and "
                 "gathered units, buffers) exceeds it")
        raise ValueError(f"zero_ext: stage='auto': no stage fits the memory budget of {_fmt(budget)} per rank "
                         f"({source}) at world size {world} (model state + buffers + frozen parameters: {need}); "
                         f"{where}. Run with more ranks, lower param_dtype/reduce_dtype, or raise memory_budget")
    # Fewest bytes per step; ties go to the lower stage (fewer collectives per bucket).
    best = min(fits, key=lambda s: (est[s]["comm_bytes_per_step"], s))
    comm = ", ".join(f"stage {s} {_fmt(est[s]['comm_bytes_per_step'])}" for s in fits)
    why = (f"zero_ext: stage='auto' chose stage {best}: budget {_fmt(budget)} per rank ({source}), world size "
           f"{world}, params {cfg.param_dtype}, reduce {cfg.reduce_dtype}{accum}. Memory per rank: {need}; "
           f"fitting: {', '.join(map(str, fits))}; communication per step of those: {comm}")
    return best, why
