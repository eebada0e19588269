"""offload="cpu"'s checks before the engine is built (Note [Optimizer offload] in csrc/engine/offload.h)."""
from __future__ import annotations

import os
import warnings

import torch

from .changes import ZeroUsageError


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        return None


def check_host_memory(model, optimizer, cfg, world: int, backend: str) -> None:
    """Raise when this node's ranks (LOCAL_WORLD_SIZE) would need more host memory for the
    offloaded state than the host has available."""
    if not isinstance(optimizer, torch.optim.Optimizer) or not isinstance(cfg.stage, int):
        return   # several optimizers / stage="auto": the engine's own allocations decide
    from .estimate import estimate_memory
    need = estimate_memory(model, world, cfg.stage, config=cfg, optimizer=optimizer, backend=backend)["offload"]
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    have = available_host_bytes()
    if have is None or not need:
        return
    total = need["total"] * local
    if total > have:
        raise ZeroUsageError(
            f"zero_ext: offload='cpu' needs {total / 2**30:.2f} GiB of host memory on this node "
            f"({local} rank(s) x {need['total'] / 2**30:.2f} GiB: master {need['master_weights'] / 2**30:.2f}, "
            f"optimizer states {need['optimizer_states'] / 2**30:.2f}, gradients {need['gradients'] / 2**30:.2f}, "
            f"pinned rings {need['pinned_ring'] / 2**20:.1f} MiB) but {have / 2**30:.2f} GiB are available; "
            f"use more ranks (the state is sharded over them), a bf16 reduce_dtype, or offload=None")


def warn_unfused(parts) -> None:
    """Once: optimizers without C kernels step as torch optimizers on the host shards."""
    slow = sorted({p.cls.__name__ for p in parts if p.kind != "fused"})
    if slow:
        warnings.warn(f"zero_ext: offload='cpu' with {', '.join(slow)}: no fused C kernel covers it, so it runs as "
                      f"the torch optimizer on the host shards (correct, slower than Adam/AdamW/SGD's kernels)",
                      stacklevel=3)
