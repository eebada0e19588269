"""Side-by-side demo: zero_ext ZeRO stages against torch DDP, 2 CPU ranks, tiny GPT.

    make demo
    python examples/demo.py                          # columns: ddp, stages 0, 2, 3, stage 3 in bf16
    python examples/demo.py --stages ddp 0 1 2 --steps 100

Each column is one job
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --stage S --json ...
(or --ddp), all with the same seed, model, data and thread count, run one after the
other. The table compares final losses (stages 0..3 compute what DDP computes, up to
rounding, so the curves agree closely; the bf16 column computes in bf16 with fp32
master weights, so its loss differs slightly), median step time, model-state bytes per rank,
and bytes communicated per step: zero_ext's counters, the loopback interface and the
bytes the ranks wrote. Takes about 2-3 minutes on 2 cores.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TRAIN_GPT = Path(__file__).resolve().parent / "train_gpt.py"


def run_train_gpt(script_args, json_path, nproc=2, capture=False):
    """Run train_gpt.py under torchrun with nproc gloo ranks; return the summary it writes to json_path.

    capture=True keeps the job's output unless it fails (then it is printed and
    CalledProcessError raised, the output in its .output); otherwise the output streams
    to the terminal.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(TRAIN_GPT), *script_args, "--json", str(json_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")               # train_gpt.py sets torch threads itself
    result = subprocess.run(command, env=env, text=True,
                            stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.STDOUT if capture else None)
    if result.returncode != 0:
        if capture:
            print(result.stdout)
        raise subprocess.CalledProcessError(result.returncode, command, output=result.stdout)
    return json.loads(Path(json_path).read_text())


# Column names: torch DDP with torch.optim.AdamW (default, foreach or fused
# implementation), torch FSDP2 (fully_shard), torch ZeroRedundancyOptimizer (with DDP),
# DeepSpeed ZeRO-1/2 (if installed), all with torch.optim.AdamW, or a zero_ext stage.
SYSTEMS = ["ddp", "ddp-foreach", "ddp-fused", "fsdp2", "zero-redundancy", "deepspeed-1", "deepspeed-2",
           "0", "1", "2", "3"]
# Any of them with a precision suffix: "3-bf16" (zero_ext param_dtype=bf16), "ddp-bf16"
# (DDP under torch.autocast), "fsdp2-bf16" (MixedPrecisionPolicy), "2-fp16" (zero_ext only).
DTYPES = ["bf16", "fp16"]


def split_dtype(system):
    """("3", "bf16") for "3-bf16"; (system, None) without a suffix."""
    base, _, suffix = system.rpartition("-")
    return (base, suffix) if suffix in DTYPES and base else (system, None)


def check_system(system):
    base, dtype = split_dtype(system)
    if base not in SYSTEMS or (dtype == "fp16" and not base.isdigit()):
        raise argparse.ArgumentTypeError(f"unknown column {system!r}: one of {', '.join(SYSTEMS)}, optionally "
                                         f"with -bf16 (or -fp16 for zero_ext stages)")
    return system


def system_args(system):
    """train_gpt.py flags for a column name of SYSTEMS (with an optional precision suffix)."""
    system, dtype = split_dtype(system)
    if dtype is not None:
        return system_args(system) + ["--dtype", dtype]
    if system == "ddp":
        return ["--ddp"]
    if system.startswith("ddp-"):
        return ["--ddp", "--adamw", system[len("ddp-"):]]
    if system == "fsdp2":
        return ["--fsdp2"]
    if system == "zero-redundancy":
        return ["--zero-redundancy"]
    if system.startswith("deepspeed-"):
        return ["--deepspeed", system[len("deepspeed-"):]]
    return ["--stage", system]


def system_label(system):
    system, dtype = split_dtype(system)
    if dtype is not None:
        return f"{system_label(system)} {dtype}"
    if system == "ddp":
        return "DDP"
    if system.startswith("ddp-"):
        return f"DDP ({system[len('ddp-'):]} AdamW)"
    if system == "fsdp2":
        return "FSDP2"
    if system == "zero-redundancy":
        return "ZeroRedundancyOptimizer"
    if system.startswith("deepspeed-"):
        return f"DeepSpeed ZeRO-{system[len('deepspeed-'):]}"
    return f"stage {system}"


def format_table(header, rows):
    """Plain-text table: first column left-aligned, the others right-aligned."""
    table = [list(map(str, header))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]

    def line(row):
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:])]
        return "  ".join(cells)

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(table[0]), rule] + [line(row) for row in table[1:]])


def format_bytes(n):
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def max_known(values):
    """The largest of values, or None when any is unknown (None) or there are none."""
    return None if not values or None in values else max(values)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="+", default=["ddp", "0", "2", "3", "3-bf16"], type=check_system,
                        help="columns, in order: 'ddp' (torch DDP + AdamW; ddp-fused: fused AdamW), "
                             "'fsdp2' (torch fully_shard + AdamW), 'zero-redundancy' (torch "
                             "ZeroRedundancyOptimizer), 'deepspeed-1'/'deepspeed-2' (needs deepspeed) "
                             "and/or zero_ext stages; a '-bf16' suffix computes in bf16 (zero_ext: "
                             "param_dtype with fp32 masters; DDP: autocast)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()

    summaries = {}
    with tempfile.TemporaryDirectory(prefix="zero_ext_demo_") as tmp:
        for system in args.stages:
            name = system_label(system)
            print(f"\n=== {name}: torchrun --nproc_per_node={args.nproc} train_gpt.py "
                  f"{' '.join(system_args(system))} --steps {args.steps}", flush=True)
            summaries[name] = run_train_gpt(system_args(system) + ["--steps", str(args.steps)],
                                            Path(tmp) / f"{system}.json", nproc=args.nproc)

    ddp = summaries.get("DDP")
    rows = [
        ["final train loss"] + [f"{s['final_train_loss']:.4f}" for s in summaries.values()],
        ["final val loss"] + [f"{s['final_val_loss']:.4f}" for s in summaries.values()],
        ["median step time (ms)"] + [f"{s['step_time_ms']['median']:.1f}" for s in summaries.values()],
        ["step time / DDP"] + [f"{s['step_time_ms']['median'] / ddp['step_time_ms']['median']:.2f}x"
                               if ddp else "n/a" for s in summaries.values()],
        ["tokens/s"] + [f"{s['tokens_per_s']:.0f}" for s in summaries.values()],
        ["model-state bytes / rank"] + [format_bytes(max(s["model_state_bytes_per_rank"])) for s in summaries.values()],
        ["buffer bytes / rank"] + [format_bytes(s["buffer_bytes"]) for s in summaries.values()],
        ["peak RSS / rank (VmHWM)"] + [format_bytes(max_known(s.get("peak_rss_bytes_per_rank", [])))
                                       for s in summaries.values()],
        ["comm bytes / step / rank"] + [format_bytes(s["comm_bytes_per_step"]) +
                                        ({"theory": " (theory)", "written": " (written)"}.get(s["comm_source"], ""))
                                        for s in summaries.values()],
        ["loopback bytes / step"] + [format_bytes(s["wire_bytes_per_step"]) for s in summaries.values()],
        ["bytes written / step"] + [format_bytes(s["written_bytes_per_step"]) for s in summaries.values()],
    ]
    first = next(iter(summaries.values()))
    print(f"\nGPT {first['num_params']:,} parameters | {args.nproc} gloo ranks x {first['threads_per_rank']} thread | "
          f"{first['tokens_per_step']:,} tokens/step | {args.steps} steps | torch {first['torch_version']}")
    print(format_table(["metric"] + list(summaries), rows))
    print("model-state bytes: parameters + gradients + master weights + optimizer states (formulas: docs/guide/stages.md);\n"
          "comm bytes: zero_ext's counters per rank, all-reduce counted twice (ring-cost equivalent);\n"
          "  DDP: theory; FSDP2, ZeroRedundancyOptimizer, DeepSpeed: bytes written by all ranks / (ranks - 1),\n"
          "  the same convention;\n"
          "loopback bytes: all ranks, /proc/net/dev (includes other programs' loopback traffic);\n"
          "bytes written: all ranks, /proc/self/io (gloo's socket writes, plus a few log lines);\n"
          "peak RSS: VmHWM of /proc/self/status at the end of the run (the whole process).")


if __name__ == "__main__":
    main()
