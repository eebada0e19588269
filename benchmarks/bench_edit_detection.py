"""What detecting in-place parameter edits costs per training step.

    python benchmarks/bench_edit_detection.py            # 1-2 min on 2 busy cores
    python benchmarks/bench_edit_detection.py --reps 9 --steps 40

The model is the worst case for a per-tensor check: 1,202 small tensors (300
blocks of Linear 32x32 + LayerNorm 32, and a Linear 32->1 head), zero_ext stage 2
with param_dtype="bf16" (where edits must be folded into the fp32 master; fp32
stages 0-2 check nothing), one process. Training steps (forward, backward,
opt.step(), zero_grad) are timed with the check on and off, interleaved
(on off off on ...), `--reps` repetitions of `--steps` steps each; the table shows
the median [min, max] of the per-repetition ratio on/off. The check alone
(ModelGuard.check_edits with nothing edited) is also timed over many calls and
shown as a fraction of the median step. Writes benchmarks/results/bench_edit_detection.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import zero_ext  # noqa: E402
from machine import cpu_model  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "bench_edit_detection.json"


class TinyBlocks(nn.Module):
    def __init__(self, blocks=300, width=32):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))
                                    for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x).float().square().mean()


def timed_steps(zm, zo, x, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        zm(x).backward()
        zo.step()
        zo.zero_grad()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyBlocks()
    n_tensors = sum(1 for _ in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    zm, zo = zero_ext.zeroify(model, opt, stage=2, param_dtype=args.dtype)
    guard = zo._guard
    x = torch.randn(16, 32)
    timed_steps(zm, zo, x, 5)                               # warm up

    on, off, ratios = [], [], []
    for rep in range(args.reps):
        times = {}
        for mode in (("on", "off") if rep % 2 == 0 else ("off", "on")):
            zo._guard = guard if mode == "on" else None
            times[mode] = timed_steps(zm, zo, x, args.steps)
        zo._guard = guard
        on.append(times["on"])
        off.append(times["off"])
        ratios.append(times["on"] / times["off"])

    calls = 2000
    t0 = time.perf_counter()
    for _ in range(calls):
        guard.check_edits()
    check_s = (time.perf_counter() - t0) / calls
    step_s = statistics.median(off)
    r_med = statistics.median(ratios)
    result = {
        "torch": torch.__version__, "cpu": cpu_model(), "threads": 1, "world_size": 1, "stage": 2,
        "param_dtype": args.dtype, "tensors": n_tensors, "reps": args.reps, "steps_per_rep": args.steps,
        "step_s_off": off, "step_s_on": on, "ratio_on_off": ratios,
        "ratio_median": r_med, "ratio_min": min(ratios), "ratio_max": max(ratios),
        "check_s": check_s, "check_fraction_of_step": check_s / step_s,
    }
    print(f"edit detection, stage 2 {args.dtype}, {n_tensors} tensors, 1 process x 1 thread, torch {torch.__version__}")
    print("| measure | value |")
    print("|---|---|")
    print(f"| step, check off (median of {args.reps}) | {step_s * 1e3:.2f} ms |")
    print(f"| step, check on / off (median [min, max]) | {r_med:.4f}x [{min(ratios):.4f}, {max(ratios):.4f}] |")
    print(f"| check alone (mean of {calls} calls) | {check_s * 1e6:.1f} us |")
    print(f"| check alone / step | {100 * check_s / step_s:.2f}% |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
