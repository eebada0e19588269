"""Communication-reducing modes side by side: exact vs quantized gradient reduction
(grad_quant int8 / int4, with and without error feedback) and quantized parameter
gathers (param_quant int8, alone and with int8 gradients), GPT on tinyshakespeare.

    python benchmarks/bench_comm.py                      # 4 gloo ranks, stage 2, 300 steps
    python benchmarks/bench_comm.py --steps 60 --world 2 # quick look
    python benchmarks/bench_comm.py --stage 3 --modes q8gather q8gather_int8

All modes train in the same processes in lockstep: at every step each mode does its
own forward/backward/step on the same batch (every rank draws its own batches from a
generator seeded with 1000 * rank + step), so the loss curves share their data and the
step times are interleaved (A B C A B C ...). Per mode it reports: the final loss (mean
of the last 20 steps) and its ratio to the exact run's, reduce-scatter bytes per step
and rank and all-gather bytes per step and rank (logical: what the exact run moves;
wire: what the collectives carried, codes + scales, from opt.stats()), and the median
step time as a ratio to the exact
mode's (same run; timings drift on a shared machine). The model is examples/gpt.py's
GPT, 2 layers, n_embd 64, block 64, batch 8 per rank, AdamW lr 3e-3, 1 thread per rank.
Writes benchmarks/results/bench_comm.json (loss curves included, for the notebook).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from machine import spawn_ranks  # noqa: E402  (benchmarks/, the script's directory)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "bench_comm.json"
DATA = REPO / "examples" / "data" / "tinyshakespeare.txt"

MODES = {
    "exact": {},
    "int8": {"grad_quant": "int8"},
    "int4": {"grad_quant": "int4"},
    "int4_ef": {"grad_quant": "int4", "grad_quant_error_feedback": True},
    "int8_ef": {"grad_quant": "int8", "grad_quant_error_feedback": True},
    "q8gather": {"param_quant": "int8"},
    "q8gather_int8": {"param_quant": "int8", "grad_quant": "int8"},
}


def start_rank(rank, world, store, n_layer=2, n_embd=64):
    """One benchmark rank (also bench_comm_hier.py's): the repository and examples/
    importable, one thread, the gloo process group, tinyshakespeare and the GPT config
    (block 64, 4 heads). Returns (data, config)."""
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "examples"))
    import torch.distributed as dist

    from gpt import CharDataset, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    data = CharDataset(str(DATA))
    return data, GPTConfig(vocab_size=data.vocab_size, block_size=64, n_layer=n_layer, n_head=4, n_embd=n_embd)


def gpt_and_adamw(cfg):
    """The same initial GPT and AdamW in every mode."""
    from gpt import GPT

    torch.manual_seed(1234)
    model = GPT(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def worker(rank, world, store, out_dir, args):
    import torch.distributed as dist

    import zero_ext

    data, cfg = start_rank(rank, world, store)
    runs = {}
    for name in args.modes:
        zm, zo = zero_ext.zeroify(*gpt_and_adamw(cfg), stage=args.stage, quant_block_numel=args.block,
                                  **MODES[name])
        runs[name] = (zm, zo, [], [])
    for step in range(args.steps):
        gen_seed = 1000 * rank + step
        for name, (zm, zo, losses, times) in runs.items():
            x, y = data.get_batch("train", 8, 64, torch.Generator().manual_seed(gen_seed))
            t0 = time.perf_counter()
            _, loss = zm(x, y)
            loss.backward()
            zo.clip_grad_norm_(1.0)
            zo.step()
            zo.zero_grad()
            times.append(time.perf_counter() - t0)
            ls = loss.detach().reshape(1)
            dist.all_reduce(ls)
            losses.append(float(ls) / world)
    out = {}
    for name, (zm, zo, losses, times) in runs.items():
        st = zo.stats()
        rs, ag = st["comm"]["reduce_scatter"], st["comm"]["all_gather"]
        out[name] = {"losses": losses, "median_step_s": statistics.median(times[10:] or times),
                     "reduce_scatter_bytes": rs["bytes"], "reduce_scatter_wire_bytes": rs["wire_bytes"],
                     "all_gather_bytes": ag["bytes"], "all_gather_wire_bytes": ag["wire_bytes"],
                     "reductions": st["reductions"], "num_params": st["num_params"],
                     "quant_residual_bytes": st["buffer_bytes"]["quant_residual"]}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--block", type=int, default=256, help="quant_block_numel")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if "exact" not in args.modes:
        args.modes = ["exact"] + args.modes
    t0 = time.time()
    ranks = spawn_ranks(worker, args.world, args)
    r0 = ranks[0]
    exact = r0["exact"]
    tail = 20
    rows, summary = [], {}
    for name in args.modes:
        m = r0[name]
        final = sum(m["losses"][-tail:]) / tail
        steps = m["reductions"]
        ratio_t = statistics.median(r[name]["median_step_s"] / r["exact"]["median_step_s"] for r in ranks)
        summary[name] = {
            "options": MODES[name], "final_loss": final,
            "final_loss_vs_exact": final / (sum(exact["losses"][-tail:]) / tail) - 1.0,
            "reduce_scatter_bytes_per_step": m["reduce_scatter_bytes"] / steps,
            "reduce_scatter_wire_bytes_per_step": m["reduce_scatter_wire_bytes"] / steps,
            "wire_vs_exact": m["reduce_scatter_wire_bytes"] / exact["reduce_scatter_wire_bytes"],
            "all_gather_bytes_per_step": m["all_gather_bytes"] / steps,
            "all_gather_wire_bytes_per_step": m["all_gather_wire_bytes"] / steps,
            "all_gather_wire_vs_exact": m["all_gather_wire_bytes"] / exact["all_gather_wire_bytes"],
            "step_time_vs_exact": ratio_t, "quant_residual_bytes": m["quant_residual_bytes"],
            "losses": m["losses"],
        }
        s = summary[name]
        rows.append([name, f"{final:.4f}", f"{100 * s['final_loss_vs_exact']:+.2f}%",
                     f"{s['reduce_scatter_bytes_per_step'] / 1024:.1f}", f"{s['reduce_scatter_wire_bytes_per_step'] / 1024:.1f}",
                     f"{s['wire_vs_exact']:.3f}", f"{s['all_gather_bytes_per_step'] / 1024:.1f}",
                     f"{s['all_gather_wire_bytes_per_step'] / 1024:.1f}", f"{s['all_gather_wire_vs_exact']:.3f}",
                     f"{ratio_t:.2f}"])
    head = ["mode", f"loss (last {tail})", "vs exact", "RS KiB/step logical", "RS KiB/step wire",
            "RS wire / exact", "AG KiB/step logical", "AG KiB/step wire", "AG wire / exact", "step time / exact"]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head] + rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    print(f"world {args.world}, stage {args.stage}, {args.steps} steps, block {args.block}, "
          f"{r0['exact']['num_params']} parameters, torch {torch.__version__}, {time.time() - t0:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"world": args.world, "stage": args.stage, "steps": args.steps,
                                    "block": args.block, "torch": torch.__version__,
                                    "command": "python benchmarks/bench_comm.py " + " ".join(sys.argv[1:]),
                                    "modes": summary}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
