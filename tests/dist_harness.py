"""Run a function on N real processes joined by a gloo process group.

    results = run_world(fn, world_size, *args, timeout_s=300)

fn(rank, world_size, *args) runs in each process after init_process_group('gloo')
(FileStore rendezvous in a temp dir, so no ports); its return value comes back
per rank. A worker's exception fails the call with the worker's traceback, and a
run that outlives timeout_s is killed, so no test can hang.

backend= picks another init_process_group backend: "cuda:gloo" (a CUDA-only gloo
group, so several ranks can share one GPU: NCCL refuses two ranks on one device)
or "nccl". With a backend that carries CUDA tensors each rank first makes
cuda:(rank % device count) its current device, so on one GPU every rank is on cuda:0.
"""
from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def uses_cuda(backend: str) -> bool:
    """Whether a process group of this backend string carries CUDA tensors."""
    return backend == "nccl" or "cuda" in backend


def _entry(rank, world, store_path, out_dir, fn, args, init_pg, backend="gloo"):
    for p in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")):
        if p not in sys.path:
            sys.path.insert(0, p)
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if uses_cuda(backend):
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if init_pg:
            dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        torch.save({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        # Drop every reference to the process group (a saved exception's frames hold
        # one) before destroying it, then leave without interpreter finalization:
        # gloo's threads can abort ("terminate called without an active exception")
        # when a process group is torn down during Py_Finalize. The result is saved.
        gc.collect()
        if init_pg and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _joined(ctx, expect_errors: bool) -> bool:
    """True once every rank has exited. With expect_errors a rank may be killed on
    purpose (SIGKILL): poll instead of ctx.join(), which would terminate the others
    before they report how they failed."""
    if not expect_errors:
        return ctx.join(timeout=1.0)
    if any(p.is_alive() for p in ctx.processes):
        time.sleep(0.2)
        return False
    return True


def run_world(fn, world_size: int, *args, timeout_s: float = 300, init_pg: bool = True,
              expect_errors: bool = False, backend: str = "gloo"):
    """Returns [result of rank 0, ..., result of rank N-1]. With expect_errors=True
    returns the per-rank dicts {"ok", "result"|"error"} instead of raising."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(_entry, args=(world_size, store, tmp, fn, args, init_pg, backend),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not _joined(ctx, expect_errors):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout_s}s "
                                       f"(a rank is hanging)")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        outs = []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pt")
            if not os.path.exists(path):
                if not expect_errors:
                    raise RuntimeError(f"rank {r} of {fn.__name__} exited without a result")
                outs.append({"ok": False, "error": "exited without a result", "trace": ""})
                continue
            outs.append(torch.load(path, weights_only=False, map_location="cpu"))   # CUDA results too
    if expect_errors:
        return outs
    failed = [(r, o) for r, o in enumerate(outs) if not o["ok"]]
    if failed:
        # a rank's own error first; "connection closed" on the others is its echo
        failed.sort(key=lambda ro: "Connection closed" in ro[1]["error"])
        raise AssertionError("\n".join(f"rank {r} failed: {o['error']}\n{o['trace']}" for r, o in failed))
    return [o["result"] for o in outs]
