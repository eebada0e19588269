"""Training-step benchmark: zero_ext stages 0-2 against torch DDP, 2 gloo ranks, tiny GPT.

    python benchmarks/bench_step.py              # 5 repetitions, 60 steps per job
    python benchmarks/bench_step.py --quick      # 3 repetitions, 30 steps per job
    python benchmarks/bench_step.py --systems ddp 2 --reps 7

Every job is `torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --json ...`
with the GPT of train_gpt.py's defaults (same seed, data, 1 thread per rank). Jobs are
interleaved, one per system per repetition (ddp 0 1 2 ddp 0 1 2 ...), and each job
reports its own median step time over the steps after warmup; the ratio to DDP is taken
within a repetition, then the median (min/max) over repetitions is printed.
Also reported: model-state bytes per rank (opt.stats(); summed tensors for DDP), bytes
communicated per step per rank (zero_ext's counters, all-reduce counted twice; DDP:
theory 2 x 4 bytes x params), the bytes sent on the loopback interface per step by all
ranks (/proc/net/dev, read by rank 0 between barriers around the timed steps; other
programs' loopback traffic only adds, so the minimum over repetitions is shown) and the
bytes the ranks wrote per step (/proc/self/io wchar summed over ranks: gloo's socket
writes, not disturbed by other programs).
Targets: stage 1/2 step time <= 1.05x DDP; bytes per step on the wire <= DDP's.
Timings drift on a shared machine: run it when nothing else is busy.
Writes benchmarks/results/bench_step.json.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
from demo import SYSTEMS, format_bytes, format_table, run_train_gpt, system_args, system_label  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "bench_step.json"
STEP_TIME_TARGET = 1.05          # stage 1/2 median step time / DDP's
WIRE_TOLERANCE = 1.01            # loopback bytes / DDP's; 1% for gloo/TCP control traffic


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=["ddp", "0", "1", "2"], choices=SYSTEMS,
                        help="'ddp' (the baseline, always needed), 'ddp-foreach'/'ddp-fused' (DDP with that "
                             "torch AdamW), zero_ext stages")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60, help="steps per job, including --warmup")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 repetitions of 30 steps (5 warmup)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("train_args", nargs="*", help="extra train_gpt.py flags after --, e.g. -- --n-layer 6")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.steps, args.warmup = 3, 30, 5
    assert "ddp" in args.systems, "the ratios need the ddp column"
    job_args = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--log-every", str(10 ** 9),
                "--eval-iters", "2", "--sample-chars", "0", *args.train_args]

    load_before = os.getloadavg()[0]         # 1-minute load average: > 0.5 means someone else is busy
    runs = {system: [] for system in args.systems}
    with tempfile.TemporaryDirectory(prefix="zero_ext_bench_") as tmp:
        for rep in range(args.reps):
            for system in args.systems:
                summary = run_train_gpt(system_args(system) + job_args, Path(tmp) / f"{system}_{rep}.json",
                                        capture=True)
                summary.pop("losses")
                runs[system].append(summary)
                print(f"rep {rep} {system:>9}: median step {summary['step_time_ms']['median']:7.2f} ms | "
                      f"loopback {format_bytes(summary['wire_bytes_per_step'])}/step | "
                      f"written {format_bytes(summary['written_bytes_per_step'])}/step", flush=True)

    ddp_ms = [r["step_time_ms"]["median"] for r in runs["ddp"]]
    ddp_wire = min(r["wire_bytes_per_step"] for r in runs["ddp"])
    ddp_written = statistics.median(r["written_bytes_per_step"] for r in runs["ddp"])
    results = {}
    for system, system_runs in runs.items():
        ms = [r["step_time_ms"]["median"] for r in system_runs]
        wire = min(r["wire_bytes_per_step"] for r in system_runs)
        written = statistics.median(r["written_bytes_per_step"] for r in system_runs)
        results[system] = {
            "step_time_ms": spread(ms),
            "ratio_vs_ddp": spread([m / d for m, d in zip(ms, ddp_ms)]),
            "model_state_bytes_per_rank": system_runs[0]["model_state_bytes_per_rank"],
            "model_state_bytes": system_runs[0]["model_state_bytes"],
            "buffer_bytes": system_runs[0]["buffer_bytes"],
            "comm_bytes_per_step": statistics.median(r["comm_bytes_per_step"] for r in system_runs),
            "comm_bytes_per_step_by_kind": system_runs[0]["comm_bytes_per_step_by_kind"],
            "comm_source": system_runs[0]["comm_source"],
            "wire_bytes_per_step": wire,                     # min over reps
            "wire_ratio_vs_ddp": wire / ddp_wire,
            "written_bytes_per_step": written,               # median over reps
            "written_ratio_vs_ddp": written / ddp_written,
            "final_val_loss": [r["final_val_loss"] for r in system_runs],
            "runs": system_runs,
        }

    load_after = os.getloadavg()[0]
    first = runs["ddp"][0]
    header = ["system", "step ms (median)", "vs DDP median [min, max]", "model state/rank", "buffers/rank",
              "comm/step/rank", "loopback/step", "vs DDP", "written/step", "vs DDP"]
    rows = []
    for system, r in results.items():
        ratio = r["ratio_vs_ddp"]
        rows.append([
            system_label(system),
            f"{r['step_time_ms']['median']:.2f}",
            f"{ratio['median']:.3f}x [{ratio['min']:.3f}, {ratio['max']:.3f}]",
            format_bytes(max(r["model_state_bytes_per_rank"])),
            format_bytes(r["buffer_bytes"]),
            format_bytes(r["comm_bytes_per_step"]) + (" (theory)" if r["comm_source"] == "theory" else ""),
            format_bytes(r["wire_bytes_per_step"]),
            f"{r['wire_ratio_vs_ddp']:.3f}x",
            format_bytes(r["written_bytes_per_step"]),
            f"{r['written_ratio_vs_ddp']:.3f}x",
        ])
    print(f"\n{cpu_model()} | torch {first['torch_version']} | ISA {first['isa']} | "
          f"{first['world_size']} gloo ranks x {first['threads_per_rank']} thread | {first['num_params']:,} params | "
          f"{first['tokens_per_step']:,} tokens/step | {args.reps} reps x {args.steps - args.warmup} timed steps | "
          f"load average {load_before:.1f} before, {load_after:.1f} after")
    print(format_table(header, rows))
    for system in ("1", "2"):
        if system in results:
            r = results[system]
            step_ok = r["ratio_vs_ddp"]["median"] <= STEP_TIME_TARGET
            wire_ok = max(r["wire_ratio_vs_ddp"], r["written_ratio_vs_ddp"]) <= WIRE_TOLERANCE
            print(f"stage {system}: step time {r['ratio_vs_ddp']['median']:.3f}x DDP "
                  f"(target <= {STEP_TIME_TARGET}x: {'met' if step_ok else 'MISSED'}); bytes on the wire "
                  f"{r['wire_ratio_vs_ddp']:.3f}x (loopback), {r['written_ratio_vs_ddp']:.3f}x (written) DDP's "
                  f"(target <= DDP, {WIRE_TOLERANCE}x tolerance: {'met' if wire_ok else 'MISSED'})")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "bench_step",
        "cpu": cpu_model(),
        "torch_version": first["torch_version"],
        "world_size": first["world_size"],
        "threads_per_rank": first["threads_per_rank"],
        "num_params": first["num_params"],
        "tokens_per_step": first["tokens_per_step"],
        "reps": args.reps,
        "steps": args.steps,
        "warmup": args.warmup,
        "load_average": {"before": load_before, "after": load_after},
        "train_args": job_args,
        "targets": {"step_time_vs_ddp": STEP_TIME_TARGET, "wire_vs_ddp": WIRE_TOLERANCE},
        "systems": results,
    }, indent=1))
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")


if __name__ == "__main__":
    main()
