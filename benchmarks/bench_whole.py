"""Muon + AdamW (the usual recipe: Muon over the hidden matrices, AdamW over
embeddings, norms and biases) under zero_ext stages 1 and 2 against DDP with the
same torch optimizers, GPT on tinyshakespeare.

    python benchmarks/bench_whole.py                 # 4 gloo ranks, 4 layers, n_embd 128, 30 steps
    python benchmarks/bench_whole.py --world 2 --steps 10

Per system: the median step time (forward, backward, clip, both steps, zero_grad)
as a ratio to DDP's, measured interleaved in the same processes (each repetition
runs every system once after a barrier, the first one rotating); the optimizer
state each rank holds after training (DDP: torch's Muon and AdamW states, whole on
every rank; zero_ext: stats()["model_state_bytes"]["optimizer_states"], the fused
AdamW windows plus torch's Muon state of the tensors the rank owns), max/mean over
ranks; the planned max/mean (stats()["atomic"]["state_balance"]), parameters cut to
fill Muon's padding (Note [Cut parameters] in csrc/engine/fill.cpp), and the final
loss (mean of the last 5 steps) against DDP's. 1 thread per rank. Writes
benchmarks/results/bench_whole.json.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_comm import start_rank  # noqa: E402
from machine import cpu_model, interleaved, spawn_ranks  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "bench_whole.json"
SYSTEMS = ["ddp", "zero_s1", "zero_s2"]


def gpt_muon_adamw(cfg):
    """The same initial GPT and the Muon + AdamW pair for every system."""
    from gpt import GPT

    torch.manual_seed(1234)
    model = GPT(cfg)
    emb = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    mats = [p for p in model.parameters() if p.ndim == 2 and id(p) not in emb]
    rest = [p for p in model.parameters() if not (p.ndim == 2 and id(p) not in emb)]
    return model, [torch.optim.Muon(mats, lr=2e-2, weight_decay=0.1, momentum=0.95),
                   torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)]


def state_bytes(opts) -> int:
    return sum(t.nbytes for o in opts for st in o.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim() > 0)


def worker(rank, world, store, out_dir, args):
    import torch.distributed as dist

    import zero_ext

    data, cfg = start_rank(rank, world, store, n_layer=args.n_layer, n_embd=args.n_embd)
    runs = {}
    model, opts = gpt_muon_adamw(cfg)
    runs["ddp"] = (torch.nn.parallel.DistributedDataParallel(model), opts)
    for stage in (1, 2):
        zm, zos = zero_ext.zeroify(*gpt_muon_adamw(cfg), stage=stage)
        runs[f"zero_s{stage}"] = (zm, zos)
    losses = {name: [] for name in runs}

    def one_step(name, step):
        model, opts = runs[name]
        x, y = data.get_batch("train", 8, 64, torch.Generator().manual_seed(1000 * rank + step))
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        if name == "ddp":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            opts[0].clip_grad_norm_(1.0)   # one global norm over both
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()
        dt = time.perf_counter() - t0
        ls = loss.detach().reshape(1)
        dist.all_reduce(ls)
        losses[name].append(float(ls) / world)
        return dt

    times = interleaved(SYSTEMS, one_step, args.steps)
    out = {"times": times, "losses": losses, "state": {}}
    for name, (model, opts) in runs.items():
        if name == "ddp":
            out["state"][name] = state_bytes(opts)
        else:
            s = opts[0].stats()
            out["state"][name] = s["model_state_bytes"]["optimizer_states"]
            out[name] = {"planned_balance": s["atomic"]["state_balance"], "cut_params": s["atomic"]["cut_params"],
                         "filled_numel": s["atomic"]["filled_numel"], "num_params": s["num_params"]}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="repetitions left out of the medians")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    t0 = time.time()
    ranks = spawn_ranks(worker, args.world, args)
    r0 = ranks[0]
    summary, rows = {}, []
    for name in SYSTEMS:
        # per repetition the slowest rank sets the pace; ratio of medians to DDP's
        per_rep = [max(r["times"][k][name] for r in ranks) for k in range(args.warmup, args.steps)]
        ddp_rep = [max(r["times"][k]["ddp"] for r in ranks) for k in range(args.warmup, args.steps)]
        held = [r["state"][name] for r in ranks]
        final = sum(r0["losses"][name][-5:]) / 5
        final_ddp = sum(r0["losses"]["ddp"][-5:]) / 5
        summary[name] = {
            "median_step_s": statistics.median(per_rep),
            "step_time_vs_ddp": statistics.median(per_rep) / statistics.median(ddp_rep),
            "state_bytes_per_rank": held, "state_max_over_mean": max(held) / (sum(held) / len(held)),
            "state_max_vs_ddp": max(held) / max(r["state"]["ddp"] for r in ranks),
            "final_loss": final, "final_loss_vs_ddp": final / final_ddp - 1.0,
            **r0.get(name, {}),
        }
        s = summary[name]
        rows.append([name, f"{1000 * s['median_step_s']:.1f}", f"{s['step_time_vs_ddp']:.2f}",
                     f"{max(held) / 1024:.0f}", f"{s['state_max_vs_ddp']:.3f}", f"{s['state_max_over_mean']:.3f}",
                     f"{s.get('planned_balance', 1.0):.3f}", str(s.get("cut_params", "-")),
                     f"{final:.4f}", f"{100 * s['final_loss_vs_ddp']:+.2f}%"])
    head = ["system", "step ms", "vs DDP", "state KiB (max rank)", "vs DDP", "max/mean held", "max/mean planned",
            "cut", "loss (last 5)", "vs DDP"]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head] + rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    print(f"world {args.world}, GPT {args.n_layer} layers n_embd {args.n_embd}, "
          f"{r0['zero_s2']['num_params']} parameters, {args.steps} steps ({args.warmup} warm-up), "
          f"torch {torch.__version__}, {cpu_model()}, {time.time() - t0:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"world": args.world, "steps": args.steps, "n_layer": args.n_layer,
                                    "n_embd": args.n_embd, "torch": torch.__version__, "cpu": cpu_model(),
                                    "command": "python benchmarks/bench_whole.py " + " ".join(sys.argv[1:]),
                                    "systems": summary}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
