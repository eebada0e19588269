"""CPU AdamW step benchmark: zero_ext's kernel against torch.optim.AdamW.

    python benchmarks/bench_optimizer.py                  # 64M parameters, 7 repetitions
    python benchmarks/bench_optimizer.py --quick          # 1M parameters, 5 repetitions (smoke test)
    python benchmarks/bench_optimizer.py --numel 134217728 --reps 9 --threads 2

One flat fp32 parameter of --numel elements, AdamW (lr 1e-3, wd 0.01). Contenders:
  ours fp32           zero_ext._C.adam_step on the best ISA
  ours + bf16 out     the same step also writing a bf16 copy of the parameters
  torch foreach       torch.optim.AdamW(foreach=True)
  torch fused         torch.optim.AdamW(fused=True)         (skipped if CPU fused is missing)
  torch fused + copy  the fused step, then bf16_copy.copy_(param)
and a reference copy: dst.copy_(src) of >= 256 MiB fp32, whose bandwidth counts the
bytes read plus the bytes written. Every side runs with torch.set_num_threads(--threads)
(our kernel splits over the same intra-op pool). Timings are interleaved, one step of
each contender per repetition (A B C ... B C A ..., the first side rotating), after
warm-up steps; we report the
median (min/max) step time, parameters/s, and the fraction of the copy bandwidth that
the step's minimum traffic reaches: 28 bytes/parameter for an fp32 AdamW step (read p,
g, m, v; write p, m, v), 30 with the bf16 copy-out (+ write p16). (copy_ also pays a
write-allocate read of dst that a read-modify-write step does not, so a one-pass
step can exceed 1.0 of it.)
Targets: ours >= 1.3x torch fused; ours >= 0.8 of copy bandwidth; ours + bf16 out >= 1.3x
torch fused + bf16 copy.

Thread scaling (then, unless --no-scaling): ours fp32 against torch fused at every thread
count from 1 to all cores (--scaling-threads), for an in-cache size (2^19 parameters: p, g,
m, v are 8 MiB) and a DRAM size (64M), interleaved over thread counts and sides within
each repetition; the copy is re-measured at each thread count. An in-cache step takes
~0.1 ms, so each timing covers enough steps for >= 20 ms. Targets: in cache, 2 threads
take <= 0.6x the 1-thread time; at the DRAM size ours >= torch fused at every count.
Writes benchmarks/results/bench_optimizer.json (--quick: bench_optimizer_quick.json).
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import zero_ext._C as C
from machine import cpu_model

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "bench_optimizer.json"
SPEEDUP_TARGET = 1.3        # ours / torch fused (parameters per second)
SCALING_TARGET = 0.6        # in cache: 2-thread time / 1-thread time, at most
BATCH_S = 0.02              # scaling: steps per timing so that one timing lasts this long
COPY_FRACTION_TARGET = 0.8  # ours effective bandwidth / copy bandwidth
BYTES_FP32 = 28             # read p, g, m, v; write p, m, v
BYTES_BF16 = 30             # ... + write the bf16 copy
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


class Ours:
    """One AdamW step of zero_ext's kernel, optionally with a bf16 copy-out."""

    def __init__(self, numel, grad, isa, bf16_out):
        self.isa = isa
        self.p = torch.randn(numel)
        self.g = grad
        self.m = torch.zeros(numel)
        self.v = torch.zeros(numel)
        self.lp = torch.empty(numel, dtype=torch.bfloat16) if bf16_out else None
        self.step_count = 0

    def step(self):
        self.step_count += 1
        C.adam_step(self.isa, self.p, self.g, self.m, self.v, None, self.lp, LR, BETAS[0], BETAS[1],
                    EPS, WD, self.step_count, True, False, False, 1.0)


class Torch:
    """One torch.optim.AdamW step (foreach or fused), optionally followed by a bf16 copy."""

    def __init__(self, numel, grad, fused, bf16_copy):
        self.p = torch.nn.Parameter(torch.randn(numel))
        self.p.grad = grad
        kw = dict(fused=True) if fused else dict(foreach=True)
        self.opt = torch.optim.AdamW([self.p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
        self.lp = torch.empty(numel, dtype=torch.bfloat16) if bf16_copy else None

    def step(self):
        self.opt.step()
        if self.lp is not None:
            with torch.no_grad():
                self.lp.copy_(self.p)


class Copy:
    """dst.copy_(src): the bandwidth yardstick (bytes read + bytes written)."""

    def __init__(self, numel):
        self.src = torch.randn(numel)
        self.dst = torch.empty(numel)

    def step(self):
        self.dst.copy_(self.src)


def cpu_flag(name):
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return name in line.split()
    except OSError:
        pass
    return False


def fused_cpu_available():
    try:
        p = torch.nn.Parameter(torch.zeros(16))
        p.grad = torch.zeros(16)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, ValueError, TypeError):
        return False


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def format_table(rows, header):
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def default_thread_counts():
    """1, 2, 4, ... and every core."""
    n = os.cpu_count() or 1
    counts = [1]
    while counts[-1] * 2 < n:
        counts.append(counts[-1] * 2)
    return counts + ([n] if n > 1 else [])


def scaling(sizes, thread_counts, reps, isa, copy):
    """Ours fp32 vs torch fused, seconds per step at each (size, thread count), plus the
    copy's bandwidth at each thread count. Interleaved: each repetition visits every
    thread count, and at each one every side (the first side rotating)."""
    sides = {}
    for numel in sizes:
        grad = torch.randn(numel) * 1e-2
        sides[numel] = [("ours", Ours(numel, grad, isa, bf16_out=False)),
                        ("torch fused", Torch(numel, grad, fused=True, bf16_copy=False))]
    batch = {}                                         # steps per timing, at one thread
    torch.set_num_threads(1)
    for numel, pair in sides.items():
        for name, obj in pair:
            one = min(timed(obj.step) for _ in range(3))
            batch[numel, name] = max(1, round(BATCH_S / one))
    times = {(numel, t, name): [] for numel in sizes for t in thread_counts for name in ("ours", "torch fused")}
    copy_times = {t: [] for t in thread_counts}
    for rep in range(reps):
        for t in thread_counts:
            torch.set_num_threads(t)
            todo = [("copy", None, copy, 1)] + [(name, numel, obj, batch[numel, name])
                                               for numel, pair in sides.items() for name, obj in pair]
            for k in range(len(todo)):
                name, numel, obj, steps = todo[(rep + k) % len(todo)]
                s = timed(lambda: [obj.step() for _ in range(steps)]) / steps
                (copy_times[t] if name == "copy" else times[numel, t, name]).append(s)
    copy_bw = {t: 8 * copy.src.numel() / statistics.median(v) for t, v in copy_times.items()}
    rows = []
    for numel in sizes:
        for t in thread_counts:
            row = dict(numel=numel, threads=t, copy_GBps=copy_bw[t] / 1e9)
            for name in ("ours", "torch fused"):
                v = times[numel, t, name]
                med = statistics.median(v)
                base = statistics.median(times[numel, thread_counts[0], name])
                row[name] = dict(median_s=med, min_s=min(v), max_s=max(v), steps_per_timing=batch[numel, name],
                                 params_per_s=numel / med, fraction_of_copy_bw=numel * BYTES_FP32 / med / copy_bw[t],
                                 time_vs_1_thread=med / base)
            row["ours_speedup_vs_fused"] = row["torch fused"]["median_s"] / row["ours"]["median_s"]
            rows.append(row)
    return rows


def scaling_verdict(rows, in_cache, dram):
    def at(numel, t):
        return next((r for r in rows if r["numel"] == numel and r["threads"] == t), None)

    two = at(in_cache, 2)
    ratio = two["ours"]["time_vs_1_thread"] if two else None
    dram_rows = [r for r in rows if r["numel"] == dram]
    worst = min((r["ours_speedup_vs_fused"] for r in dram_rows), default=None)
    return dict(in_cache_numel=in_cache, in_cache_2t_over_1t=ratio, in_cache_target=SCALING_TARGET,
                in_cache_met=bool(ratio is not None and ratio <= SCALING_TARGET),
                dram_numel=dram, dram_worst_speedup_vs_fused=worst,
                dram_met=bool(worst is not None and worst >= 1.0))


def print_scaling(rows, verdict):
    table = []
    for r in rows:
        o, f = r["ours"], r["torch fused"]
        table.append([f"{r['numel']:,}", r["threads"], f"{o['median_s'] * 1e3:.3f}", f"{o['time_vs_1_thread']:.2f}",
                      f"{o['params_per_s'] / 1e9:.3f}", f"{o['fraction_of_copy_bw']:.2f}",
                      f"{f['median_s'] * 1e3:.3f}", f"{f['time_vs_1_thread']:.2f}", f"{f['params_per_s'] / 1e9:.3f}",
                      f"{f['fraction_of_copy_bw']:.2f}", f"{r['ours_speedup_vs_fused']:.2f}x",
                      f"{r['copy_GBps']:.1f}"])
    print(format_table(table, ["params", "threads", "ours ms", "vs 1t", "Gparams/s", "of copy bw",
                               "fused ms", "vs 1t", "Gparams/s", "of copy bw", "ours vs fused", "copy GB/s"]))
    v = verdict
    if v["in_cache_2t_over_1t"] is not None:
        print(f"targets: in cache ({v['in_cache_numel']:,}) 2 threads take {v['in_cache_2t_over_1t']:.2f}x the "
              f"1-thread time (target <= {SCALING_TARGET}: {'met' if v['in_cache_met'] else 'NOT met'})")
    if v["dram_worst_speedup_vs_fused"] is not None:
        print(f"         DRAM ({v['dram_numel']:,}) ours vs torch fused at worst {v['dram_worst_speedup_vs_fused']:.2f}x "
              f"over thread counts (target >= 1.0: {'met' if v['dram_met'] else 'NOT met'})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=64 * 2**20, help="parameters (default 64M)")
    ap.add_argument("--reps", type=int, default=7, help="interleaved repetitions (>= 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per contender")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads, all sides")
    ap.add_argument("--isa", default="auto", help="our kernel's ISA (default: the best this CPU runs)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1M parameters, 5 repetitions")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--no-scaling", action="store_true", help="skip the thread-scaling table")
    ap.add_argument("--scaling-sizes", default=f"{2**19},{64 * 2**20}",
                    help="in-cache and DRAM sizes, comma separated (default 2^19,64M)")
    ap.add_argument("--scaling-threads", default=",".join(map(str, default_thread_counts())),
                    help="thread counts, comma separated (default 1, 2, 4, ... all cores)")
    args = ap.parse_args()
    if args.quick:
        args.numel, args.reps, args.warmup = 2**20, 5, 1
        args.scaling_sizes = f"{2**19},{2**22}"
    args.reps = max(args.reps, 5)
    torch.set_num_threads(args.threads)
    isa = C.best_isa() if args.isa == "auto" else args.isa
    copy_numel = max(args.numel, 64 * 2**20)  # >= 256 MiB of fp32
    print(f"torch {torch.__version__}, {args.threads} threads, isa {isa}, {args.numel:,} parameters, "
          f"{args.reps} reps; CPU: {cpu_model()}")

    grad = torch.randn(args.numel) * 1e-2  # shared by every contender (read-only)
    contenders = {
        "ours fp32": (Ours(args.numel, grad, isa, bf16_out=False), BYTES_FP32),
        "ours + bf16 out": (Ours(args.numel, grad, isa, bf16_out=True), BYTES_BF16),
        "torch foreach": (Torch(args.numel, grad, fused=False, bf16_copy=False), BYTES_FP32),
    }
    fused = fused_cpu_available()
    if fused:
        contenders["torch fused"] = (Torch(args.numel, grad, fused=True, bf16_copy=False), BYTES_FP32)
        contenders["torch fused + bf16 copy"] = (Torch(args.numel, grad, fused=True, bf16_copy=True), BYTES_BF16)
    else:
        print("torch.optim.AdamW(fused=True) does not run on CPU in this torch: skipped")
    copy = Copy(copy_numel)

    for _ in range(args.warmup):
        copy.step()
        for obj, _ in contenders.values():
            obj.step()
    times = {name: [] for name in contenders}
    copy_times = []
    sides = [("copy", copy)] + [(name, obj) for name, (obj, _) in contenders.items()]
    for rep in range(args.reps):
        # interleaved, one step of each side per repetition; the starting side rotates
        # so that no contender always runs right after the big copy
        for k in range(len(sides)):
            name, obj = sides[(rep + k) % len(sides)]
            (copy_times if name == "copy" else times[name]).append(timed(obj.step))

    copy_bytes = 2 * 4 * copy_numel
    copy_bw = copy_bytes / statistics.median(copy_times)
    print(f"copy bandwidth: {copy_bw / 1e9:.2f} GB/s (dst.copy_(src), {4 * copy_numel / 2**20:.0f} MiB, "
          f"read + write; min/max {copy_bytes / max(copy_times) / 1e9:.2f}/{copy_bytes / min(copy_times) / 1e9:.2f})")

    fused_median = statistics.median(times["torch fused"]) if fused else None
    results, rows = [], []
    for name, (_, bytes_per_param) in contenders.items():
        t = times[name]
        med = statistics.median(t)
        pps = args.numel / med
        frac = pps * bytes_per_param / copy_bw
        speedup = fused_median / med if fused_median else None
        results.append(dict(name=name, median_s=med, min_s=min(t), max_s=max(t), times_s=t,
                            params_per_s=pps, bytes_per_param=bytes_per_param,
                            effective_GBps=pps * bytes_per_param / 1e9, fraction_of_copy_bw=frac,
                            speedup_vs_torch_fused=speedup))
        rows.append([name, f"{med * 1e3:.1f}", f"{min(t) * 1e3:.1f}/{max(t) * 1e3:.1f}", f"{pps / 1e9:.3f}",
                     bytes_per_param, f"{pps * bytes_per_param / 1e9:.2f}", f"{frac:.2f}",
                     f"{speedup:.2f}x" if speedup else "-"])
    print(format_table(rows, ["contender", "median ms", "min/max ms", "Gparams/s", "B/param",
                              "GB/s", "of copy bw", "vs fused"]))

    ours = results[0]
    by_name = {r["name"]: r for r in results}
    # The mixed-precision comparison: one pass with the bf16 copy-out against torch's fused step
    # followed by a separate copy_ into a bf16 tensor (what a mixed-precision loop does).
    bf16_vs = (by_name["torch fused + bf16 copy"]["median_s"] / by_name["ours + bf16 out"]["median_s"]
               if "torch fused + bf16 copy" in by_name else None)
    verdict = dict(
        bf16_copyout_speedup=bf16_vs,
        bf16_copyout_target=SPEEDUP_TARGET,
        bf16_copyout_met=bool(bf16_vs and bf16_vs >= SPEEDUP_TARGET),
        speedup_vs_fused=ours["speedup_vs_torch_fused"],
        speedup_target=SPEEDUP_TARGET,
        speedup_met=bool(ours["speedup_vs_torch_fused"] and ours["speedup_vs_torch_fused"] >= SPEEDUP_TARGET),
        copy_fraction=ours["fraction_of_copy_bw"],
        copy_fraction_target=COPY_FRACTION_TARGET,
        copy_fraction_met=ours["fraction_of_copy_bw"] >= COPY_FRACTION_TARGET,
    )
    print(f"targets: ours fp32 {verdict['speedup_vs_fused'] or float('nan'):.2f}x torch fused "
          f"(target >= {SPEEDUP_TARGET}x: {'met' if verdict['speedup_met'] else 'NOT met'}); "
          f"{verdict['copy_fraction']:.2f} of copy bandwidth "
          f"(target >= {COPY_FRACTION_TARGET}: {'met' if verdict['copy_fraction_met'] else 'NOT met'})")
    if bf16_vs is not None:
        print(f"         ours + bf16 out {bf16_vs:.2f}x torch fused + bf16 copy_ "
              f"(target >= {SPEEDUP_TARGET}x: {'met' if verdict['bf16_copyout_met'] else 'NOT met'})")

    scaling_rows, scaling_targets = None, None
    if not args.no_scaling and fused:
        sizes = [int(x) for x in args.scaling_sizes.split(",")]
        counts = [int(x) for x in args.scaling_threads.split(",")]
        print(f"\nthread scaling, ours fp32 vs torch fused, {args.reps} reps, threads {counts}:")
        scaling_rows = scaling(sizes, counts, args.reps, isa, copy)
        scaling_targets = scaling_verdict(scaling_rows, sizes[0], sizes[-1])
        print_scaling(scaling_rows, scaling_targets)
        torch.set_num_threads(args.threads)

    report = dict(
        benchmark="bench_optimizer", torch_version=torch.__version__, isa=isa,
        cpu_has_avx512_bf16=cpu_flag("avx512_bf16"),
        cpu=cpu_model(), threads=args.threads, numel=args.numel, reps=args.reps, quick=args.quick,
        copy=dict(numel=copy_numel, bytes_moved=copy_bytes, median_s=statistics.median(copy_times),
                  min_s=min(copy_times), max_s=max(copy_times), GBps=copy_bw / 1e9),
        hyperparameters=dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD),
        results=results, targets=verdict, scaling=scaling_rows, scaling_targets=scaling_targets,
    )
    if args.quick and args.out == RESULTS:
        args.out = RESULTS.with_name("bench_optimizer_quick.json")  # keep the full run's file
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")


if __name__ == "__main__":
    main()
