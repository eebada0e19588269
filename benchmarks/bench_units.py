"""Stage 3 with many small units: the cost of one unit, against DDP and FSDP2.

    python benchmarks/bench_units.py              # 5 repetitions x 20 steps
    python benchmarks/bench_units.py --quick      # 3 repetitions x 8 steps
    python benchmarks/bench_units.py --profile    # also: cProfile of stage 3 steps on rank 0

The model is 300 tiny blocks, each Linear(32, 32) + LayerNorm(32) (~0.3M parameters), so a
step is nearly all per-unit overhead: hooks, bookkeeping, collective launches, releases.
2 gloo ranks (torch.multiprocessing spawn, 1 thread each), batch 16 x 32 per rank,
AdamW. Systems, all built in the same two processes from one initial model:
  ddp          torch DistributedDataParallel + torch.optim.AdamW
  1, 2, 3      zero_ext stages 1-3; stage 3 with each block a unit (unit_modules=["TinyBlock"])
  3-single     stage 3 as above with coalesce_numel=0: one all-gather per unit and pass, the
               cost that coalescing small units' gathers removes (Note [Coalesced unit gathers])
  fsdp2        torch fully_shard on each block, then the root (examples/train_gpt.py's
               shard_fsdp2: CPU mesh, SUM reduction divided by the world size), AdamW
Each repetition runs --steps steps of every system in turn (the first system rotating), after
a warm-up; a system's time in a repetition is its median step (rank 0's clock, ranks in
lock step), ratios are taken within a repetition, then the median (min/max) over
repetitions is reported. Per-unit cost: (stage 3 step - DDP step) / units, per step (a unit
is gathered, computed and released in forward and again in backward), and each stage-3
system's collectives per step (from its counters).
Targets: stage 3 <= 2.5x DDP and <= 0.2x FSDP2; stages 1 and 2 <= 1.0x DDP.
Writes benchmarks/results/bench_units.json.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "examples", REPO / "benchmarks"):
    sys.path.insert(0, str(p))
from demo import format_table  # noqa: E402
from machine import cpu_model, interleaved, spread  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "bench_units.json"
SYSTEMS = ["ddp", "1", "2", "3", "3-single", "fsdp2"]
TARGETS = {("3", "ddp"): 2.5, ("3", "fsdp2"): 0.2, ("1", "ddp"): 1.0, ("2", "ddp"): 1.0}
WIDTH, BATCH, WORLD = 32, 16, 2


class TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)

    def forward(self, x):
        return self.ln(x + torch.tanh(self.fc(x)))


class TinyStack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(TinyBlock() for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def build(system, base):
    """(module to call, optimizer) for one system, from a copy of `base`."""
    import zero_ext
    from train_gpt import shard_fsdp2

    model = copy.deepcopy(base)
    if system == "fsdp2":
        model = shard_fsdp2(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if system == "ddp":
        return nn.parallel.DistributedDataParallel(model), opt
    units = dict(unit_modules=["TinyBlock"], min_unit_numel=0) if system.startswith("3") else {}
    if system == "3-single":
        units["coalesce_numel"] = 0
    return zero_ext.zeroify(model, opt, stage=int(system[0]), **units)


def run_steps(model, opt, steps, rank, first):
    times = []
    for s in range(steps):
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1000 * (first + s) + rank))
        t0 = time.perf_counter()
        model(x).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def worker(rank, store, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    base = TinyStack(args.blocks)
    built, skipped = {}, {}
    for system in args.systems:
        try:
            built[system] = build(system, base)
        except Exception as e:  # noqa: BLE001 - a peer that does not run is reported, not fatal
            skipped[system] = f"{type(e).__name__}: {e}"[:300]
    for model, opt in built.values():
        run_steps(model, opt, args.warmup, rank, 0)
    names = list(built)
    per_rep = interleaved(names, lambda name, rep: statistics.median(
        run_steps(*built[name], args.steps, rank, 100 * (rep + 1))), args.reps)
    profile = None
    if args.profile and "3" in built:
        prof = cProfile.Profile()
        dist.barrier()
        prof.enable()
        run_steps(*built["3"], args.steps, rank, 10_000)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        profile = text.getvalue()
    stats = {name: built[name][1].stats() for name in names if name[0] in "123"}
    for name in stats:                 # collectives per step, over one more step
        before = {k: v["calls"] for k, v in built[name][1].stats()["comm"].items()}
        run_steps(*built[name], 1, rank, 20_000)
        after = built[name][1].stats()["comm"]
        stats[name]["calls_per_step"] = {k: after[k]["calls"] - before[k] for k in before}
    if rank == 0:
        torch.save(dict(per_rep=per_rep, skipped=skipped, profile=profile,
                        units=stats.get("3", {}).get("num_units"),
                        unforeseen=stats.get("3", {}).get("out_of_order_fetches"),
                        params=sum(p.numel() for p in base.parameters()),
                        calls={name: st["calls_per_step"] for name, st in stats.items()}), out)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per system per repetition")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=300)
    ap.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    ap.add_argument("--quick", action="store_true", help="3 repetitions x 8 steps")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of stage 3 steps (rank 0)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.reps, args.steps, args.warmup = 3, 8, 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.start_processes(worker, args=(os.path.join(tmp, "store"), args, out), nprocs=WORLD,
                           start_method="spawn")
        res = torch.load(out)
    per_rep, names = res["per_rep"], list(res["per_rep"][0])
    print(f"torch {torch.__version__}, {WORLD} gloo ranks, 1 thread each, {args.blocks} blocks "
          f"({res['params']:,} parameters), stage 3 units: {res['units']}, {args.reps} reps x {args.steps} "
          f"steps; CPU: {cpu_model()}")
    for name, reason in res["skipped"].items():
        print(f"{name}: did not run: {reason}")
    systems = {}
    for name in names:
        entry = dict(step_s=spread([r[name] for r in per_rep]))
        for peer in ("ddp", "fsdp2"):
            if peer in names and peer != name:
                entry[f"vs_{peer}"] = spread([r[name] / r[peer] for r in per_rep])
        systems[name] = entry
    units = (res["units"] or 1) - 1    # the root unit holds nothing here
    for name in ("3", "3-single"):
        if name in names and "ddp" in names:
            systems[name]["per_unit_s"] = spread([(r[name] - r["ddp"]) / units for r in per_rep])
    for name, calls in res["calls"].items():
        systems[name]["collectives_per_step"] = calls
    rows = []
    for name in names:
        e = systems[name]
        cells = [name, f"{e['step_s']['median'] * 1e3:.2f} ({e['step_s']['min'] * 1e3:.2f}-{e['step_s']['max'] * 1e3:.2f})"]
        for peer in ("ddp", "fsdp2"):
            v = e.get(f"vs_{peer}")
            cells.append(f"{v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})" if v else "-")
        rows.append(cells)
    print(format_table(["system", "step ms (min-max)", "vs DDP", "vs FSDP2"], rows))
    for name in ("3", "3-single"):
        if "per_unit_s" in systems.get(name, {}):
            pu = systems[name]["per_unit_s"]
            calls = systems[name].get("collectives_per_step", {})
            print(f"{name}: cost per unit and step over DDP {pu['median'] * 1e6:.1f} us "
                  f"({pu['min'] * 1e6:.1f}-{pu['max'] * 1e6:.1f}); collectives per step: "
                  + ", ".join(f"{k} {v}" for k, v in calls.items() if v))
    print(f"unforeseen gathers in all (stage 3): {res['unforeseen']}")
    targets = {}
    for (ours, peer), limit in TARGETS.items():
        v = systems.get(ours, {}).get(f"vs_{peer}")
        if v is None:
            continue
        targets[f"stage {ours} / {peer}"] = dict(median=v["median"], target=limit, met=v["median"] <= limit)
        print(f"target: stage {ours} {v['median']:.2f}x {peer} (<= {limit}): "
              f"{'met' if v['median'] <= limit else 'NOT met'}")
    if res["profile"]:
        print(res["profile"])
    report = dict(benchmark="bench_units", torch_version=torch.__version__, cpu=cpu_model(), world_size=WORLD,
                  threads_per_rank=1, blocks=args.blocks, params=res["params"], units=res["units"],
                  reps=args.reps, steps=args.steps, quick=args.quick, systems=systems,
                  skipped=res["skipped"], per_rep=per_rep, targets=targets)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")


if __name__ == "__main__":
    main()
