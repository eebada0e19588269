"""The cost of the collective sequence check (check_sequence) per training step.

    python benchmarks/bench_sequence.py            # 5 repetitions x 20 steps
    python benchmarks/bench_sequence.py --quick    # 3 repetitions x 8 steps

2 gloo ranks (torch.multiprocessing spawn, 1 thread each) train a GPT (examples/gpt.py,
--layers/--embd, block 64, batch 8 per rank, AdamW) with zero_ext stages 0, 2 and 3, each
built three times from one initial model: check_sequence=False ("off"), "every_phase"
(before: one small all-gather per phase that communicates, a barrier each) and True (the
default: digests exchanged only where a rank leaves its learned pattern, Note [Exchanges
on deviation] in csrc/engine/sequence.h). Each repetition runs --steps steps of every
system in turn (the first rotating); a system's time in a repetition is its median step
(rank 0's clock); the cost of a check is its ratio to "off" within a repetition and the
difference in microseconds, median (min/max) over repetitions. Also reported: the digest
exchanges per step after warm-up (stats()["sequence_exchanges"]). Writes
benchmarks/results/bench_sequence.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "examples", REPO / "benchmarks"):
    sys.path.insert(0, str(p))
from demo import format_table  # noqa: E402
from machine import cpu_model, interleaved, spread  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "bench_sequence.json"
STAGES = (0, 2, 3)
CHECKS = (False, "every_phase", True)
WORLD, BATCH, BLOCK = 2, 8, 64


def build(stage, check, base):
    import zero_ext

    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    units = dict(unit_modules=["Block"]) if stage == 3 else {}
    return zero_ext.zeroify(model, opt, stage=stage, check_sequence=check, **units)


def run_steps(model, opt, steps, rank, first, vocab):
    times = []
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 * (first + s) + rank)
        idx = torch.randint(0, vocab, (BATCH, BLOCK + 1), generator=g)
        t0 = time.perf_counter()
        _, loss = model(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def worker(rank, store, args, out):
    from gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=BLOCK, n_layer=args.layers, n_head=4, n_embd=args.embd, bias=False)
    base = GPT(cfg)
    built = {(stage, check): build(stage, check, base) for stage in STAGES for check in CHECKS}
    for model, opt in built.values():
        run_steps(model, opt, args.warmup, rank, 0, cfg.vocab_size)
    before = {name: opt._engine.sequence_exchanges for name, (_, opt) in built.items()}
    per_rep = interleaved(list(built), lambda name, rep: statistics.median(
        run_steps(*built[name], args.steps, rank, 100 * (rep + 1), cfg.vocab_size)), args.reps)
    exchanges = {name: (opt._engine.sequence_exchanges - before[name]) / (args.reps * args.steps)
                 for name, (_, opt) in built.items()}
    if rank == 0:
        torch.save(dict(per_rep=per_rep, exchanges=exchanges, params=sum(p.numel() for p in base.parameters())),
                   out)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="3 repetitions x 8 steps")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.reps, args.steps, args.warmup = 3, 8, 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.start_processes(worker, args=(os.path.join(tmp, "store"), args, out), nprocs=WORLD,
                           start_method="spawn")
        res = torch.load(out)
    per_rep = res["per_rep"]
    print(f"torch {torch.__version__}, {WORLD} gloo ranks, 1 thread each, GPT {args.layers} layers x {args.embd} "
          f"({res['params']:,} parameters), batch {BATCH}x{BLOCK}, {args.reps} reps x {args.steps} steps; "
          f"CPU: {cpu_model()}")
    rows, table = [], {}
    for stage in STAGES:
        off = [r[(stage, False)] for r in per_rep]
        e = dict(off_s=spread(off))
        for check, label in (("every_phase", "before"), (True, "now")):
            on = [r[(stage, check)] for r in per_rep]
            e[label] = dict(step_s=spread(on), ratio=spread([a / b for a, b in zip(on, off)]),
                            extra_us=spread([(a - b) * 1e6 for a, b in zip(on, off)]),
                            exchanges_per_step=res["exchanges"][(stage, check)])
        table[f"stage{stage}"] = e
        b, n = e["before"], e["now"]
        rows.append([str(stage), f"{e['off_s']['median'] * 1e3:.2f}",
                     f"{b['ratio']['median']:.3f}x ({b['ratio']['min']:.3f}-{b['ratio']['max']:.3f})",
                     f"{b['exchanges_per_step']:.2f}",
                     f"{n['ratio']['median']:.3f}x ({n['ratio']['min']:.3f}-{n['ratio']['max']:.3f})",
                     f"{n['extra_us']['median']:.0f} ({n['extra_us']['min']:.0f} to {n['extra_us']['max']:.0f})",
                     f"{n['exchanges_per_step']:.2f}"])
    print(format_table(["stage", "off ms/step", "every phase/off", "exch/step", "default/off (min-max)",
                        "default - off us", "exch/step"], rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(torch=torch.__version__, cpu=cpu_model(), world=WORLD, layers=args.layers,
                                        embd=args.embd, reps=args.reps, steps=args.steps, stages=table), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
