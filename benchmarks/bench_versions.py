"""The training step of this tree against another build of zero_ext, interleaved: what a
change costs on the step path when no rank does anything unusual.

    git worktree add /tmp/base 16f954d && (cd /tmp/base && python setup.py -q build_clib build_ext --inplace)
    python benchmarks/bench_versions.py --baseline /tmp/base          # 15 repetitions
    python benchmarks/bench_versions.py --baseline /tmp/base --reps 3 --steps 8   # quick look

Each repetition runs, for each tree in turn (the first alternating), a fresh pair of gloo
ranks (1 thread each) that imports that tree's zero_ext and trains bench_sequence.py's GPT
(4 layers x 128, block 64, batch 8 per rank, AdamW, the default check_sequence) in stages
0, 2 and 3 (--stages for others): --warmup steps, then --steps timed steps; a stage's time is its median step
(rank 0's clock). Reported per stage: this tree's time over the baseline's within each
repetition, median [min, max]. Goal (issue 45): within 2%.
JSON: benchmarks/results/bench_versions.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGES = (0, 2, 3)
WORLD, BATCH, BLOCK = 2, 8, 64


def worker(rank, store, args, out):
    import torch
    import torch.distributed as dist

    import zero_ext
    from gpt import GPT, GPTConfig
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=256, block_size=BLOCK, n_layer=4, n_head=4, n_embd=128, bias=False))
    result = {"zero_ext": os.path.dirname(zero_ext.__file__)}
    for stage in args.stages:
        import copy
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        zm, zo = zero_ext.zeroify(model, opt, stage=stage, **(dict(unit_modules=["Block"]) if stage == 3 else {}))
        times = []
        for s in range(args.warmup + args.steps):
            g = torch.Generator().manual_seed(1000 * s + rank)
            idx = torch.randint(0, 256, (BATCH, BLOCK + 1), generator=g)
            t0 = time.perf_counter()
            _, loss = zm(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
            loss.backward()
            zo.step()
            zo.zero_grad()
            times.append(time.perf_counter() - t0)
        result[stage] = statistics.median(times[args.warmup:])
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run_tree(tree: Path, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = dict(os.environ, ZX_BENCH_TREE=str(tree), OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, __file__, "--worker", out, "--steps", str(args.steps),
                        "--warmup", str(args.warmup), "--stages", ",".join(map(str, args.stages))], env=env, check=True)
        return json.loads(Path(out).read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="a checkout of another commit, built in place")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stages", type=lambda v: [int(x) for x in v.split(",")], default=list(STAGES),
                    help="comma-separated stages (default 0,2,3)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_versions.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        tree = Path(os.environ["ZX_BENCH_TREE"])
        sys.path[:0] = [str(tree), str(REPO / "examples")]
        import torch.multiprocessing as mp
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(worker, args=(os.path.join(tmp, "store"), args, args.worker), nprocs=WORLD,
                               start_method="spawn")
        return
    if args.baseline is None:
        ap.error("--baseline DIR is required")
    trees = {"this": REPO, "baseline": args.baseline.resolve()}
    runs = {name: [] for name in trees}
    for rep in range(args.reps):
        for name in (("this", "baseline") if rep % 2 == 0 else ("baseline", "this")):
            got = run_tree(trees[name], args)
            assert Path(got["zero_ext"]).resolve().parent == trees[name], (name, got["zero_ext"])
            runs[name].append(got)
        print(f"repetition {rep + 1}/{args.reps}: " + ", ".join(
            f"stage {s} {runs['this'][-1][str(s)] * 1e3:.2f} / {runs['baseline'][-1][str(s)] * 1e3:.2f} ms"
            for s in args.stages), flush=True)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    base = subprocess.run(["git", "-C", str(trees["baseline"]), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True)
    report = {"this": head.stdout.strip(), "baseline": base.stdout.strip(), "reps": args.reps, "steps": args.steps,
              "stages": {}}
    print(f"\nthis tree ({report['this']}) over the baseline ({report['baseline']}), per stage, median "
          f"[min, max] over {args.reps} repetitions of {args.steps} steps")
    for s in args.stages:
        ratios = [a[str(s)] / b[str(s)] for a, b in zip(runs["this"], runs["baseline"])]
        this_ms = [a[str(s)] * 1e3 for a in runs["this"]]
        base_ms = [b[str(s)] * 1e3 for b in runs["baseline"]]
        report["stages"][s] = {"ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
                               "this_ms": statistics.median(this_ms), "baseline_ms": statistics.median(base_ms)}
        r = report["stages"][s]["ratio"]
        print(f"  stage {s}: {statistics.median(this_ms):.2f} ms vs {statistics.median(base_ms):.2f} ms: "
              f"{r['median']:.3f}x [{r['min']:.3f}, {r['max']:.3f}]")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
