"""Memory over one training step, zero_ext stage 3 beside FSDP2, from bench_peak_process's JSON.

    python benchmarks/plot_memory_step.py benchmarks/reference/<machine>/bench_peak_process.json \
        --out docs/img/memory-step.png

Each panel is one system at one world size: the resident memory sampled every 0.5 ms (the
line) over the owners its marks saw (stacked: what the process holds beyond them between steps,
model state, gradients, ring, gathered units, prefetch, activations, allocator slack), time as a fraction of the step.
On the CPU a gradient shard or ring slot is resident only where written, so the line may
run below the stack while they fill.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from memory_timeline import OWNERS

COLORS = ("#d9d9d9", "#9ecae1", "#fdae6b", "#fd8d3c", "#a1d99b", "#c7e9c0", "#bcbddc", "#f0f0f0")
LABELS = ("the process (torch, libraries: between steps)", "model state", "gradients (allocated)",
          "grad ring (allocated)", "gathered units (root, this block)", "gathered ahead (prefetch)",
          "activations (saved for backward)", "allocator slack (glibc's free bytes)")


def plot(results: list, out: Path, world: int, systems: tuple = ("zero3", "fsdp2")) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for s in systems for r in results if r["system"] == s and r["world"] == world and "timeline" in r]
    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], rows):
        tl = r["timeline"]
        end = tl["marks"][-1]["t"]
        xs = [m["t"] / end for m in tl["marks"]]
        last = tl["marks"][-1]
        process = last["rss"] - sum(last["owners"].get(k, 0.0) for k in OWNERS)
        stacks = [[process] * len(xs)] + [[m["owners"].get(k, 0.0) for m in tl["marks"]] for k in OWNERS]
        ax.stackplot(xs, *stacks, step="post", labels=LABELS, colors=COLORS, alpha=0.8)
        ax.plot([t / end for t, _ in tl["samples"]], [v for _, v in tl["samples"]], color="black", lw=0.8,
                label="resident (sampled)")
        for m in tl["marks"]:
            if m["label"] in ("loss", "backward end"):
                ax.axvline(m["t"] / end, color="grey", ls=":", lw=0.8)
                ax.text(m["t"] / end, 0, " " + m["label"], rotation=90, va="bottom", fontsize=7, color="grey")
        ax.set_title(f"{r['system']}, {world} ranks: peak {r['peak']:.0f} MiB")
        ax.set_xlabel("fraction of the step")
    axes[0][0].set_ylabel("MiB above the process after init_process_group")
    axes[0][-1].legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--out", default="docs/img/memory-step.png")
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args()
    plot(json.loads(Path(a.json).read_text())["results"], Path(a.out), a.world)


if __name__ == "__main__":
    main()
