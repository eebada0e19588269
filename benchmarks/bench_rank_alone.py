"""What rank 0 alone pays for its checkpoint and its evaluation (Note [Reading alone] in
csrc/engine/away.h): zero_ext stages 1-3, served by the other ranks' shard servers,
against DDP, where rank 0 holds everything.

    python benchmarks/bench_rank_alone.py                   # ~100M GPT, 4 ranks, 3 repetitions
    python benchmarks/bench_rank_alone.py --layers 2 --embd 128 --ranks 2 --reps 1   # quick look

4 gloo ranks (1 thread each) train a GPT (examples/gpt.py, vocabulary 50304, block 64) for
2 steps; then rank 0 alone, as a DDP script's `if master_process:` does:
  checkpoint  torch.save({"model": model.module.state_dict(), "optimizer":
              optimizer.state_dict()}) to a file (then deleted);
  evaluate    --eval-batches forwards under torch.no_grad() (batch 2 x 64 tokens);
while the other ranks go on to their next step and wait there, as they would in a script.
Times are rank 0's wall clock; each repetition runs every system once (the first rotating);
reported: median [min, max] over repetitions and the ratio to DDP within a repetition.
Goal (issue 45): both at most 2x DDP's. JSON: benchmarks/results/bench_rank_alone.json.
"""
from __future__ import annotations

import argparse
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
from machine import cpu_model, spread  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "bench_rank_alone.json"
SYSTEMS = ("ddp", "zero1", "zero2", "zero3")
BATCH, BLOCK, VOCAB = 2, 64, 50304


def build(system, args):
    from gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=args.layers, n_head=max(1, args.embd // 64),
                          n_embd=args.embd, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model), opt
    import zero_ext
    return zero_ext.zeroify(model, opt, stage=int(system[-1]))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, VOCAB, (BATCH, BLOCK + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def train_step(model, opt, rank, step):
    _, loss = model(*batch(rank, step))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(rank, world, store, args, order, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    times = {}
    for system in order:
        model, opt = build(system, args)
        for step in range(2):
            train_step(model, opt, rank, step)
        dist.barrier()
        if rank == 0:
            path = os.path.join(args.tmp, "ckpt.pt")
            t0 = time.perf_counter()
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict()}, path)
            t1 = time.perf_counter()
            os.remove(path)
            model.eval()
            with torch.no_grad():
                for k in range(args.eval_batches):
                    model(*batch(0, 10_000 + k))
            model.train()
            t2 = time.perf_counter()
            times[system] = {"checkpoint_s": t1 - t0, "evaluate_s": t2 - t1}
        train_step(model, opt, rank, 2)       # the others wait here for rank 0
        dist.barrier()
        del model, opt
    if rank == 0:
        torch.save(times, out)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    rows = {s: [] for s in SYSTEMS}
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        for rep in range(args.reps):
            order = SYSTEMS[rep % len(SYSTEMS):] + SYSTEMS[:rep % len(SYSTEMS)]
            store, out = os.path.join(tmp, f"store{rep}"), os.path.join(tmp, f"out{rep}.pt")
            mp.spawn(worker, args=(args.ranks, store, args, order, out), nprocs=args.ranks)
            got = torch.load(out)
            for s in SYSTEMS:
                rows[s].append(got[s])
            print(f"repetition {rep + 1}/{args.reps}: " + ", ".join(
                f"{s} {got[s]['checkpoint_s']:.2f} s + {got[s]['evaluate_s']:.2f} s" for s in SYSTEMS), flush=True)
    from gpt import GPT, GPTConfig
    numel = sum(p.numel() for p in GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=args.layers,
                                                 n_head=max(1, args.embd // 64), n_embd=args.embd,
                                                 bias=False)).parameters())
    report = {"machine": cpu_model(), "torch": torch.__version__, "ranks": args.ranks, "numel": numel,
              "eval_batches": args.eval_batches, "reps": args.reps, "systems": {}}
    print(f"GPT {numel / 1e6:.1f}M parameters, {args.ranks} gloo ranks, rank 0 alone; median [min, max] over "
          f"{args.reps} repetitions; ratio to DDP within a repetition")
    print(f"{'system':>8} {'checkpoint s':>22} {'vs DDP':>20} {'evaluate s':>22} {'vs DDP':>20}")
    for s in SYSTEMS:
        entry = {}
        for what in ("checkpoint_s", "evaluate_s"):
            vals = [r[what] for r in rows[s]]
            ratio = [r[what] / d[what] for r, d in zip(rows[s], rows["ddp"])]
            entry[what] = spread(vals)
            entry[what.replace("_s", "_vs_ddp")] = spread(ratio)
        report["systems"][s] = entry
        c, e = entry["checkpoint_s"], entry["evaluate_s"]
        cr, er = entry["checkpoint_vs_ddp"], entry["evaluate_vs_ddp"]
        print(f"{s:>8} {c['median']:8.2f} [{c['min']:5.2f}, {c['max']:5.2f}] {cr['median']:6.2f}x "
              f"[{cr['min']:4.2f}, {cr['max']:4.2f}] {e['median']:8.2f} [{e['min']:5.2f}, {e['max']:5.2f}] "
              f"{er['median']:6.2f}x [{er['min']:4.2f}, {er['max']:4.2f}]")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
