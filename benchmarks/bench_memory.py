"""Model-state memory per rank against world size, from torch's `fake` backend.

    python benchmarks/bench_memory.py                      # N = 1, 2, 4, ..., 1024; stages 0-3; ~67M params
    python benchmarks/bench_memory.py --quick              # N = 1, 4, 64, 1024; a ~2M-parameter model
    python benchmarks/bench_memory.py --stages 1,3 --worlds 8,64 --out /tmp/m.json

One process initializes `dist.init_process_group("fake", store=FakeStore(), rank=r,
world_size=N)` (torch.testing._internal.distributed.fake_pg): collectives do nothing,
but every allocation is the one rank r of N would make, so memory at N = 1024 can be
read on one machine. Each (stage, N) point runs in a fresh subprocess (this script in
--worker mode): the fake group cannot be re-initialized reliably in one process.

The worker builds a stack of residual MLP blocks (LayerNorm, d -> 4d -> d) on the meta
device, wraps it with zeroify(stage=s) and an fp32 torch.optim.AdamW, and runs one
forward/backward/step so the Adam moments exist. Stages 0-2 materialize the model on
the CPU first (uninitialized values then a constant fill: values do not change
memory); stage 3 is built sharded with `init_fn`, `unit_modules=["Block"]`.
It reports opt.stats()["model_state_bytes"] (the "measured" column) and
["buffer_bytes"]: "buffers" is its total (gradient staging/receive rings, fixed by the
config, which the formulas leave out), "gathered peak" the most stage-3
full units held at once (transient, not in the total). Peak RSS (VmHWM) of the worker,
torch's own ~300 MiB included, is shown for context.

Formulas (fp32, Adam; Psi trainable parameters, N ranks; the README's table):
    stage 0  16 Psi            stage 2  4 Psi + 12 Psi / N
    stage 1  8 Psi + 8 Psi / N stage 3  16 Psi / N
A point is "within 1%" when |measured - formula| <= 1% of the formula (bucket padding
to a multiple of N x align is the only expected difference). Nothing is asserted: the
same bound is asserted by tests/test_memory.py and tests/test_stage3.py.

Writes benchmarks/results/bench_memory.json (--quick: bench_memory_quick.json; --out
overrides either).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from machine import cpu_model

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "bench_memory.json"
MiB = 2 ** 20

FORMULAS = {
    0: ("16Ψ", lambda psi, n: 16 * psi),
    1: ("8Ψ + 8Ψ/N", lambda psi, n: 8 * psi + 8 * psi / n),
    2: ("4Ψ + 12Ψ/N", lambda psi, n: 4 * psi + 12 * psi / n),
    3: ("16Ψ/N", lambda psi, n: 16 * psi / n),
}
FULL = dict(width=1024, layers=8, worlds=[2 ** k for k in range(11)])      # 67.2M parameters
QUICK = dict(width=256, layers=4, worlds=[1, 4, 64, 1024])                 # 2.1M parameters


# ----------------------------------------------------------------------------- worker

def worker(stage, world, rank, width, layers, threads):
    """One (stage, N) point in this process; returns a JSON-able dict."""
    import ctypes

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zero_ext

    try:  # freed stage-3 units leave at once instead of staying resident (README, Stage 3)
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)
    except OSError:
        pass
    torch.set_num_threads(threads)

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))

    class Net(nn.Module):
        def __init__(self, d, n):
            super().__init__()
            self.blocks = nn.ModuleList(Block(d) for _ in range(n))
            self.ln_f = nn.LayerNorm(d)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.ln_f(x)

    def fill(m):
        for p in m.parameters(recurse=False):
            with torch.no_grad():
                p.fill_(0.01)

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Net(width, layers)
    psi = sum(p.numel() for p in model.parameters())
    if stage == 3:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        zm, zo = zero_ext.zeroify(model, opt, stage=3, unit_modules=["Block"], init_fn=fill)
    else:
        model.to_empty(device="cpu")
        model.apply(fill)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        zm, zo = zero_ext.zeroify(model, opt, stage=stage)
    x = torch.randn(4, width)
    zm(x).square().mean().backward()
    zo.step()
    zo.zero_grad()
    seconds = time.perf_counter() - t0
    s = zo.stats()
    dist.destroy_process_group()
    peak_rss = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM"):
                    peak_rss = int(line.split()[1]) * 1024
    except OSError:
        pass
    msb, buf = s["model_state_bytes"], s["buffer_bytes"]
    formula = FORMULAS[stage][1](s["num_params"], world)
    return {
        "stage": stage, "world_size": world, "rank": rank,
        "stats_world_size": s["world_size"], "stats_rank": s["rank"], "stats_stage": s["stage"],
        "num_params": s["num_params"], "num_params_model": psi, "padded_numel": s["padded_numel"],
        "shard_numel": s["shard_numel"], "num_buckets": s["num_buckets"], "num_units": s.get("num_units"),
        "isa": s["isa"], "fused": s["fused"],
        "model_state_bytes": msb, "buffer_bytes": buf,
        "formula": FORMULAS[stage][0], "formula_bytes": formula,
        "ratio": msb["total"] / formula, "within_1pct": abs(msb["total"] - formula) <= 0.01 * formula,
        "peak_rss_bytes": peak_rss, "seconds_build_step": seconds,
    }


def run_point(stage, world, args):
    rank = world - 1 if args.rank < 0 else min(args.rank, world - 1)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", f"{stage},{world},{rank}",
           "--width", str(args.width), "--layers", str(args.layers), "--threads", str(args.threads)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    lines = [l for l in p.stdout.splitlines() if l.startswith("ZX_RESULT ")]
    if p.returncode != 0 or not lines:
        return {"stage": stage, "world_size": world, "rank": rank, "error": (p.stderr or p.stdout)[-2000:],
                "returncode": p.returncode, "seconds_wall": wall}
    r = json.loads(lines[-1][len("ZX_RESULT "):])
    r["seconds_wall"] = wall
    return r


# ----------------------------------------------------------------------------- driver

def ints(text):
    return [int(t) for t in text.split(",") if t.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N = 1,4,64,1024 and a ~2M-parameter model")
    ap.add_argument("--stages", type=ints, default=[0, 1, 2, 3], help="comma-separated (default 0,1,2,3)")
    ap.add_argument("--worlds", type=ints, default=None, help="comma-separated N (default 1,2,4,...,1024)")
    ap.add_argument("--width", type=int, default=None, help="block width d (params per block ~ 8 d^2)")
    ap.add_argument("--layers", type=int, default=None, help="number of blocks")
    ap.add_argument("--rank", type=int, default=0, help="rank r of N to allocate as (-1: the last)")
    ap.add_argument("--jobs", type=int, default=2, help="points run at once (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per point")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/bench_memory.json)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    size = QUICK if args.quick else FULL
    args.width = args.width or size["width"]
    args.layers = args.layers or size["layers"]
    if args.worker:
        stage, world, rank = ints(args.worker)
        r = worker(stage, world, rank, args.width, args.layers, args.threads)
        print("ZX_RESULT " + json.dumps(r), flush=True)
        return
    worlds = args.worlds or size["worlds"]
    if args.out is None:
        args.out = RESULTS.with_name("bench_memory_quick.json") if args.quick else RESULTS

    import torch  # only for the report's version line

    points = [(s, n) for s in args.stages for n in worlds]
    print(f"bench_memory: torch {torch.__version__}, {cpu_model()}, fake backend, "
          f"{len(points)} points in subprocesses ({args.jobs} at a time), "
          f"model: {args.layers} blocks of width {args.width}, fp32 AdamW", flush=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda sn: run_point(sn[0], sn[1], args), points))
    total_s = time.perf_counter() - t0

    ok = [r for r in results if "error" not in r]
    psi = ok[0]["num_params"] if ok else None
    print(f"Ψ = {psi:,} trainable parameters ({psi * 4 / MiB:.1f} MiB fp32)" if psi else "no point succeeded")
    hdr = (f"{'stage':>5} {'N':>5} {'rank':>4} {'measured MiB':>13} {'formula MiB':>12} {'formula':>11} "
           f"{'ratio':>7} {'buffers MiB':>11} {'gathered peak':>13} {'peak RSS MiB':>12}  within 1%")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        if "error" in r:
            print(f"{r['stage']:>5} {r['world_size']:>5} {r['rank']:>4}  FAILED (rc {r['returncode']}): "
                  f"{r['error'].strip().splitlines()[-1] if r['error'].strip() else ''}")
            continue
        rss = r["peak_rss_bytes"] / MiB if r["peak_rss_bytes"] else float("nan")
        gathered = r["buffer_bytes"].get("peak_gathered_params", 0) / MiB
        print(f"{r['stage']:>5} {r['world_size']:>5} {r['rank']:>4} {r['model_state_bytes']['total'] / MiB:>13.3f} "
              f"{r['formula_bytes'] / MiB:>12.3f} {r['formula']:>11} {r['ratio']:>7.4f} "
              f"{r['buffer_bytes']['total'] / MiB:>11.3f} {gathered:>13.3f} {rss:>12.1f}  {'yes' if r['within_1pct'] else 'NO'}")
    n_ok = sum(r["within_1pct"] for r in ok)
    print(f"{n_ok}/{len(results)} points within 1% of the formula; {len(results) - len(ok)} failed; "
          f"{total_s:.1f} s")

    report = {
        "benchmark": "bench_memory",
        "torch_version": torch.__version__,
        "cpu": cpu_model(),
        "backend": "fake (torch.testing._internal.distributed.fake_pg)",
        "quick": args.quick,
        "optimizer": "torch.optim.AdamW (fp32), one step",
        "model": {"kind": "residual MLP blocks (LayerNorm, d->4d->d) + final LayerNorm",
                  "width": args.width, "layers": args.layers, "num_params": psi,
                  "stage3": {"built_on": "meta", "unit_modules": ["Block"]}},
        "formulas": {str(s): FORMULAS[s][0] for s in FORMULAS},
        "stages": args.stages,
        "worlds": worlds,
        "seconds": total_s,
        "points": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
