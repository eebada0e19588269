"""Training-step benchmark: zero_ext stages 0-3 against torch DDP, FSDP2, ZeroRedundancyOptimizer and
DeepSpeed ZeRO-1/2 (when installed), 2 gloo ranks, tiny GPT.

    python benchmarks/bench_step.py              # 5 repetitions, 60 steps per job
    python benchmarks/bench_step.py --quick      # 3 repetitions, 30 steps per job
    python benchmarks/bench_step.py --systems ddp 2 --reps 7

Every job is `torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --json ...`
with the GPT of train_gpt.py's defaults (same seed, data, 1 thread per rank). Jobs are
interleaved, one per system per repetition (ddp 0 1 2 3 fsdp2 ddp 0 ...), and each job
reports its own median step time over the steps after warmup; the ratios to DDP and to
FSDP2 are taken within a repetition, then the median (min/max) over repetitions is printed.
FSDP2 is torch's fully_shard (train_gpt.py --fsdp2: each Block, then the root, on a CPU
device mesh, SUM reduction forced and divided by the world size, torch.optim.AdamW on the
DTensor shards). Should it fail to run (a torch without gloo support for it), its row
and JSON entry say "did not run: <reason>" and the other systems are still measured.
ZeroRedundancyOptimizer is torch's (train_gpt.py --zero-redundancy: DDP for the gradients,
the same AdamW sharded by whole parameters), DeepSpeed's ZeRO-1/2 engine runs on its CPU
accelerator over gloo (--deepspeed 1|2; `make bench` installs deepspeed, `make test` does
not); both are optional in the same way, and a DeepSpeed that is not installed is reported
as such without launching a job.
Also reported: the exposed communication per step of zero_ext's systems (rank 0's host time
blocked waiting for collectives, stats()["comm_wait_s"]: on the CPU what overlap did not hide;
`-- --comm-delay-ms 5` delays every zero_ext collective to show it under a slower link, see
tests/test_overlap.py), model-state bytes per rank (opt.stats(); summed tensors for DDP, summed
local DTensor shards of parameters, gradients and AdamW states for FSDP2), the peak
resident set size per rank (VmHWM from /proc/self/status at the end of each job: the
whole process, interpreter and data included; the largest rank, median over
repetitions), bytes communicated per step per rank (zero_ext's counters, all-reduce
counted twice; DDP: theory 2 x 4 bytes x params; FSDP2 has no counters: the bytes its
ranks wrote, below, divided by N - 1, the same convention), the bytes sent on the loopback interface per step by all
ranks (/proc/net/dev, read by rank 0 between barriers around the timed steps; other
programs' loopback traffic only adds, so the minimum over repetitions is shown) and the
bytes the ranks wrote per step (/proc/self/io wchar summed over ranks: gloo's socket
writes, not disturbed by other programs).
Every system also gets the theory for its bytes per step per rank (theory_comm_bytes_per_step,
the counters' convention: DDP and stages 0-2 2Ψ, stage 3, FSDP2, ZeroRedundancyOptimizer and
DeepSpeed 3Ψ elements of 4 bytes) and for the loopback bytes of all ranks ((N - 1) x that: each
rank of a ring sends (N - 1)/N of every collective), and "checks" records whether stages 1/2
move no more than DDP and fewer than ZeroRedundancyOptimizer and DeepSpeed, and stage 3 no
more than FSDP2, on the counters and on the wire.
Targets: stage 1/2 step time <= 1.05x DDP; bytes per step on the wire <= DDP's;
stage 3 step time <= 1.3x DDP and <= 1.0x FSDP2.
Timings drift on a shared machine: run it when nothing else is busy.
Writes benchmarks/results/bench_step.json.
"""

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
from machine import cpu_model  # noqa: E402
from demo import SYSTEMS, format_bytes, format_table, run_train_gpt, system_args, system_label  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "bench_step.json"
STEP_TIME_TARGET = 1.05          # stage 1/2 median step time / DDP's
STAGE3_VS_DDP_TARGET = 1.3       # stage 3 median step time / DDP's
STAGE3_VS_FSDP2_TARGET = 1.0     # stage 3 median step time / FSDP2's
# peers that may not run on this torch/backend or not be installed: reported, not fatal
OPTIONAL_SYSTEMS = {"fsdp2", "zero-redundancy", "deepspeed-1", "deepspeed-2"}
DEFAULT_SYSTEMS = ["ddp", "0", "1", "2", "3", "fsdp2", "zero-redundancy", "deepspeed-1", "deepspeed-2"]
BYTES_PER_ELEMENT = 4            # fp32 gradients and parameters on the wire
# Communication per rank per step in elements of Ψ, the ZeRO paper's cost model (a collective
# at its full tensor size, all-reduce twice), and what each system issues.
THEORY = {
    "ddp": (2, "all-reduce of the gradients 2Ψ"),
    "0": (2, "all-reduce of the gradients 2Ψ"),
    "1": (2, "reduce-scatter Ψ + all-gather Ψ"),
    "2": (2, "reduce-scatter Ψ + all-gather Ψ"),
    "3": (3, "all-gather Ψ (forward) + all-gather Ψ (backward) + reduce-scatter Ψ"),
    "fsdp2": (3, "all-gather Ψ (forward) + all-gather Ψ (backward) + reduce-scatter Ψ"),
    "zero-redundancy": (3, "DDP's all-reduce 2Ψ + each owner broadcasts its parameters, Ψ in all"),
    "deepspeed-1": (3, "all-reduce of the gradient buckets 2Ψ (a bucket spanning several ranks' partitions "
                       "is all-reduced: use_multi_rank_bucket_allreduce, on by default) + all-gather Ψ"),
    "deepspeed-2": (3, "all-reduce of the gradient buckets 2Ψ (as ZeRO-1) + all-gather Ψ"),
}
WIRE_TOLERANCE = 1.01            # loopback bytes / DDP's; 1% for gloo/TCP control traffic


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def failure_reason(output):
    """The most telling line of a failed job's output: a rank's last exception (not torchrun's
    ChildFailedError wrapper), else the last line."""
    lines = [line.strip() for line in (output or "").splitlines() if line.strip()]
    for line in reversed(lines):
        match = re.search(r"([A-Za-z_][\w.]*(?:Error|Exception)): (.*)", line)
        if match and not match.group(1).endswith("ChildFailedError"):
            return f"{match.group(1)}: {match.group(2)}"[:300]
    return lines[-1][:300] if lines else "no output"


def theory_comm_bytes(system, num_params):
    """(bytes per rank per step in the counters' convention, formula) for a system of SYSTEMS."""
    elements, formula = THEORY["ddp" if system.startswith("ddp") else system]
    return elements * BYTES_PER_ELEMENT * num_params, formula


def communication_checks(results, world_size):
    """Issue claims: stages 1/2 move no more than DDP and fewer than ZeroRedundancyOptimizer and
    DeepSpeed, stage 3 no more than FSDP2; on our counters (peers: theory for DDP, bytes written /
    (N - 1) for the others), on the loopback wire and on the bytes written. "No more" allows
    WIRE_TOLERANCE for gloo/TCP control traffic. A pair with a system that did not run is skipped
    with the reason."""
    claims = [(ours, peer, relation) for ours in ("1", "2")
              for peer, relation in (("ddp", "<="), ("zero-redundancy", "<"), ("deepspeed-1", "<"),
                                     ("deepspeed-2", "<"))] + [("3", "fsdp2", "<=")]
    checks = {}
    for ours, peer, relation in claims:
        name = f"stage {ours} {relation} {peer}"
        if ours not in results or peer not in results:
            continue
        if "did_not_run" in results[ours] or "did_not_run" in results[peer]:
            checks[name] = {"skipped": results[peer].get("did_not_run") or results[ours].get("did_not_run")}
            continue
        check = {}
        for metric in ("comm_bytes_per_step", "wire_bytes_per_step", "written_bytes_per_step"):
            a, b = results[ours][metric], results[peer][metric]
            if a is None or b is None:
                check[metric] = None
                continue
            ok = a <= b * WIRE_TOLERANCE if relation == "<=" else a < b
            check[metric] = {"ours": a, "peer": b, "ratio": a / b, "holds": ok}
        check["holds"] = all(c["holds"] for c in check.values() if c is not None)
        checks[name] = check
    return checks


def median_known(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=DEFAULT_SYSTEMS, choices=SYSTEMS,
                        help="'ddp' (the baseline, always needed), 'ddp-foreach'/'ddp-fused' (DDP with that "
                             "torch AdamW), 'fsdp2' (torch fully_shard), 'zero-redundancy' (torch "
                             "ZeroRedundancyOptimizer), 'deepspeed-1'/'deepspeed-2', zero_ext stages")
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
    did_not_run = {}                         # system -> reason, for OPTIONAL_SYSTEMS that failed
    if importlib.util.find_spec("deepspeed") is None:
        install_log = REPO / "benchmarks" / "results" / "deepspeed_install.log"
        reason = "deepspeed is not installed in this Python (`make bench` installs it: pip install " \
                 "--no-build-isolation deepspeed==0.19.8)"
        if install_log.exists() and install_log.read_text().strip():
            reason += "; make bench's install failed: " + failure_reason(install_log.read_text())
        for system in args.systems:
            if system.startswith("deepspeed-"):
                did_not_run[system] = reason
    with tempfile.TemporaryDirectory(prefix="zero_ext_bench_") as tmp:
        for rep in range(args.reps):
            for system in args.systems:
                if system in did_not_run:
                    continue
                try:
                    summary = run_train_gpt(system_args(system) + job_args, Path(tmp) / f"{system}_{rep}.json",
                                            capture=True)
                except subprocess.CalledProcessError as error:
                    if system not in OPTIONAL_SYSTEMS:
                        raise
                    did_not_run[system] = failure_reason(error.output)
                    print(f"rep {rep} {system:>9}: did not run: {did_not_run[system]}", flush=True)
                    continue
                summary.pop("losses")
                runs[system].append(summary)
                print(f"rep {rep} {system:>9}: median step {summary['step_time_ms']['median']:7.2f} ms | "
                      f"loopback {format_bytes(summary['wire_bytes_per_step'])}/step | "
                      f"written {format_bytes(summary['written_bytes_per_step'])}/step", flush=True)

    ddp_ms = [r["step_time_ms"]["median"] for r in runs["ddp"]]
    fsdp2_ms = None if "fsdp2" in did_not_run else [r["step_time_ms"]["median"] for r in runs.get("fsdp2", [])] or None
    ddp_wire = min(r["wire_bytes_per_step"] for r in runs["ddp"])
    ddp_written = statistics.median(r["written_bytes_per_step"] for r in runs["ddp"])
    num_params = runs["ddp"][0]["num_params"]
    world_size = runs["ddp"][0]["world_size"]
    results = {}
    for system, system_runs in runs.items():
        theory, formula = theory_comm_bytes(system, num_params)
        if system in did_not_run:
            results[system] = {"did_not_run": did_not_run[system],
                               "theory_comm_bytes_per_step": theory, "theory_formula": formula,
                               "command": "torchrun --standalone --nproc_per_node=2 examples/train_gpt.py "
                                          + " ".join(system_args(system) + job_args)}
            continue
        ms = [r["step_time_ms"]["median"] for r in system_runs]
        wire = min(r["wire_bytes_per_step"] for r in system_runs)
        written = statistics.median(r["written_bytes_per_step"] for r in system_runs)
        peak_rss = [None if None in r["peak_rss_bytes_per_rank"] else max(r["peak_rss_bytes_per_rank"])
                    for r in system_runs]
        results[system] = {
            "step_time_ms": spread(ms),
            "ratio_vs_ddp": spread([m / d for m, d in zip(ms, ddp_ms)]),
            # same repetition's FSDP2 job; None where FSDP2 was not in --systems or did not run
            "ratio_vs_fsdp2": spread([m / f for m, f in zip(ms, fsdp2_ms)]) if fsdp2_ms else None,
            "model_state_bytes_per_rank": system_runs[0]["model_state_bytes_per_rank"],
            "model_state_bytes": system_runs[0]["model_state_bytes"],
            "buffer_bytes": system_runs[0]["buffer_bytes"],
            # VmHWM (/proc/self/status) at the end of the job, largest rank; median over repetitions
            "peak_rss_bytes_per_rank": median_known(peak_rss),
            "peak_rss_source": "VmHWM of /proc/self/status at the end of the job, max over ranks, median over reps",
            "comm_bytes_per_step": median_known(r["comm_bytes_per_step"] for r in system_runs),
            "comm_bytes_per_step_by_kind": system_runs[0]["comm_bytes_per_step_by_kind"],
            "comm_source": system_runs[0]["comm_source"],
            "wire_bytes_per_step": wire,                     # min over reps
            "wire_ratio_vs_ddp": wire / ddp_wire,
            "written_bytes_per_step": written,               # median over reps
            "written_ratio_vs_ddp": written / ddp_written,
            # theory: per rank, counters' convention; on the wire: all ranks, (N - 1) x that
            "theory_comm_bytes_per_step": theory,
            "theory_formula": formula,
            "theory_wire_bytes_per_step": theory * (world_size - 1),
            "comm_vs_theory": median_known(r["comm_bytes_per_step"] for r in system_runs) / theory
            if median_known(r["comm_bytes_per_step"] for r in system_runs) is not None else None,
            "wire_vs_theory": wire / (theory * (world_size - 1)) if world_size > 1 else None,
            "written_vs_theory": written / (theory * (world_size - 1)) if world_size > 1 else None,
            # zero_ext: rank 0's host time blocked in collective waits per step (stats()["comm_wait_s"])
            "exposed_comm_ms_per_step": median_known(r.get("exposed_comm_ms_per_step") for r in system_runs),
            "final_val_loss": [r["final_val_loss"] for r in system_runs],
            "runs": system_runs,
        }

    checks = communication_checks(results, world_size)
    load_after = os.getloadavg()[0]
    first = runs["ddp"][0]
    header = ["system", "step ms (median)", "vs DDP median [min, max]", "vs FSDP2 median [min, max]",
              "exposed comm ms", "model state/rank", "buffers/rank", "peak RSS/rank", "comm/step/rank", "theory/rank",
              "loopback/step", "vs DDP", "vs theory", "written/step", "vs DDP"]

    def ratio_text(ratio):
        return "n/a" if ratio is None else f"{ratio['median']:.3f}x [{ratio['min']:.3f}, {ratio['max']:.3f}]"

    rows = []
    for system, r in results.items():
        if "did_not_run" in r:
            rows.append([system_label(system), "did not run"] + ["-"] * (len(header) - 2))
            continue
        rows.append([
            system_label(system),
            f"{r['step_time_ms']['median']:.2f}",
            ratio_text(r["ratio_vs_ddp"]),
            ratio_text(r["ratio_vs_fsdp2"]),
            "n/a" if r["exposed_comm_ms_per_step"] is None else f"{r['exposed_comm_ms_per_step']:.2f}",
            format_bytes(max(r["model_state_bytes_per_rank"])),
            format_bytes(r["buffer_bytes"]),
            format_bytes(r["peak_rss_bytes_per_rank"]),
            format_bytes(r["comm_bytes_per_step"])
            + {"theory": " (theory)", "written": " (written)"}.get(r["comm_source"], ""),
            format_bytes(r["theory_comm_bytes_per_step"]),
            format_bytes(r["wire_bytes_per_step"]),
            f"{r['wire_ratio_vs_ddp']:.3f}x",
            "n/a" if r["wire_vs_theory"] is None else f"{r['wire_vs_theory']:.3f}x",
            format_bytes(r["written_bytes_per_step"]),
            f"{r['written_ratio_vs_ddp']:.3f}x",
        ])
    print(f"\n{cpu_model()} | torch {first['torch_version']} | ISA {first['isa']} | "
          f"{first['world_size']} gloo ranks x {first['threads_per_rank']} thread | {first['num_params']:,} params | "
          f"{first['tokens_per_step']:,} tokens/step | {args.reps} reps x {args.steps - args.warmup} timed steps | "
          f"load average {load_before:.1f} before, {load_after:.1f} after")
    print(format_table(header, rows))
    for system, reason in did_not_run.items():
        print(f"{system_label(system)}: did not run: {reason}")
    print("model state: parameters + gradients + master weights + optimizer states held by the rank between steps "
          "(FSDP2: local DTensor shards); peak RSS: VmHWM of the whole rank process at the end of the job;\n"
          "comm/step/rank: zero_ext's counters, DDP's all-reduce in theory, the other peers' bytes written / (ranks - 1); "
          "loopback and written: all ranks together; theory/rank: the system's collectives in the counters' "
          "convention, wire theory (N - 1) x that.")
    for name, check in checks.items():
        if "skipped" in check:
            print(f"{name}: skipped ({check['skipped']})")
            continue
        parts = [f"{metric.split('_')[0]} {c['ratio']:.3f}x" for metric, c in check.items()
                 if isinstance(c, dict)]
        print(f"{name} (bytes per step, ours / peer): {', '.join(parts)}: {'holds' if check['holds'] else 'FAILS'}")
    for system in ("1", "2"):
        if system in results and "did_not_run" not in results[system]:
            r = results[system]
            step_ok = r["ratio_vs_ddp"]["median"] <= STEP_TIME_TARGET
            wire_ok = max(r["wire_ratio_vs_ddp"], r["written_ratio_vs_ddp"]) <= WIRE_TOLERANCE
            print(f"stage {system}: step time {r['ratio_vs_ddp']['median']:.3f}x DDP "
                  f"(target <= {STEP_TIME_TARGET}x: {'met' if step_ok else 'MISSED'}); bytes on the wire "
                  f"{r['wire_ratio_vs_ddp']:.3f}x (loopback), {r['written_ratio_vs_ddp']:.3f}x (written) DDP's "
                  f"(target <= DDP, {WIRE_TOLERANCE}x tolerance: {'met' if wire_ok else 'MISSED'})")
    if "3" in results:
        r = results["3"]
        vs_ddp = r["ratio_vs_ddp"]["median"]
        text = (f"stage 3: step time {vs_ddp:.3f}x DDP (target <= {STAGE3_VS_DDP_TARGET}x: "
                f"{'met' if vs_ddp <= STAGE3_VS_DDP_TARGET else 'MISSED'}); ")
        if r["ratio_vs_fsdp2"] is not None:
            vs_fsdp2 = r["ratio_vs_fsdp2"]["median"]
            text += (f"{vs_fsdp2:.3f}x FSDP2 (target <= {STAGE3_VS_FSDP2_TARGET}x: "
                     f"{'met' if vs_fsdp2 <= STAGE3_VS_FSDP2_TARGET else 'MISSED'})")
        else:
            text += "vs FSDP2: n/a (" + (f"FSDP2 did not run: {did_not_run['fsdp2']}" if "fsdp2" in did_not_run
                                         else "fsdp2 not in --systems") + ")"
        print(text)

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
        "targets": {"step_time_vs_ddp": STEP_TIME_TARGET, "wire_vs_ddp": WIRE_TOLERANCE,
                    "stage3_step_time_vs_ddp": STAGE3_VS_DDP_TARGET,
                    "stage3_step_time_vs_fsdp2": STAGE3_VS_FSDP2_TARGET},
        "systems": results,
        "checks": checks,
    }, indent=1))
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")


if __name__ == "__main__":
    main()
