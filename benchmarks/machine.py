"""What the benchmarks say about the machine they ran on (shared by bench_*.py)."""
import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or what platform knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def proc_status_mib(key: str) -> float:
    """A /proc/self/status field in MiB ("VmRSS", "VmHWM"), 0 where absent."""
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    return 0.0


def spread(values) -> dict:
    """Median, min and max of a list of numbers."""
    import statistics

    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def interleaved(names: list, time_one, reps: int) -> list:
    """Run every system once per repetition, the first one rotating, after a barrier
    (ranks in lock step): [{name: time_one(name, rep)} per repetition]."""
    import torch.distributed as dist

    per_rep = []
    for rep in range(reps):
        row = {}
        for k in range(len(names)):
            name = names[(rep + k) % len(names)]
            dist.barrier()
            row[name] = time_one(name, rep)
        per_rep.append(row)
    return per_rep


def spawn_ranks(worker, world: int, args) -> list:
    """Run worker(rank, world, store_path, out_dir, args) in `world` spawned processes,
    each saving its results to out_dir/rank<rank>.pt; return them in rank order."""
    import os
    import tempfile

    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(world, os.path.join(tmp, "store"), tmp, args),
                           nprocs=world, start_method="spawn")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
