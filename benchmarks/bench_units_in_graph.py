"""Stage 3 with its units gathered inside the compiled graph (Note [Stage 3 collectives in the
graph], zero_ext/compiled.py; compiled.UNITS_IN_GRAPH) on examples/gpt.py's GPT at 2 gloo ranks:
dynamo's graph breaks and graphs compiled after step 2, every loss and the parameters after the
last step against compiled DDP (fp32; the losses' largest relative difference, the parameters'
largest difference against the model's largest element: AdamW's m/sqrt(v) turns last-bit
gradient differences of near-zero elements into visible ones, test_compile_fullgraph.py), and stage 3's gathered
bytes at most during training: eager stage 3's (the engine's peak_gathered_params: a unit and
the one prefetched, with the root) against the compiled step's (the gathered flats alive at
once, zero_ext/unit_ops.py's own accounting, plus the engine's peak: the one unit copied out of
its buffer at a time). Units: unit_modules=["Block"].

    python benchmarks/bench_units_in_graph.py                       # GPT 4 x 128, 4 steps
    python benchmarks/bench_units_in_graph.py --layers 6 --width 384
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "examples"), str(REPO / "tests")]


def _rank(rank, world, layers, width, steps):
    import torch
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_ext
    from gpt import GPT, GPTConfig
    torch._dynamo.reset()

    def model():
        torch.manual_seed(0)
        return GPT(GPTConfig(n_layer=layers, n_embd=width, n_head=max(width // 64, 1), block_size=128))

    def train(m, opt):
        losses, at_2 = [], None
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randint(0, 65, (2, 128), generator=g)
            _, loss = m(x, torch.roll(x, -1, 1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if step == 1:
                at_2 = counters["stats"]["unique_graphs"]
        return losses, at_2

    out = {}
    ref = model()
    out["ddp"] = train(DDP(torch.compile(ref)), torch.optim.AdamW(ref.parameters(), lr=1e-3))[0]
    ddp_params = [p.detach().clone() for p in ref.parameters()]
    for mode in ("eager", "ingraph"):
        zero_ext.compiled.UNITS_IN_GRAPH = mode == "ingraph"
        net = model()
        zm, zo = zero_ext.zeroify(net, torch.optim.AdamW(net.parameters(), lr=1e-3), stage=3,
                                  unit_modules=["Block"], compile_units="whole")
        counters.clear()
        losses, at_2 = train(torch.compile(zm, fullgraph=True) if mode == "ingraph" else zm, zo)
        ops, engine_peak = zm.units.ops, zo.stats()["buffer_bytes"]["peak_gathered_params"]
        with zero_ext.gathered_parameters(zm):
            params = [p.detach().clone() for p in net.parameters()]
        out[mode] = dict(
            losses=losses, breaks=dict(counters["graph_break"]), graphs=counters["stats"]["unique_graphs"],
            recompiles=counters["stats"]["unique_graphs"] - (at_2 or 0),
            loss_rel=max(abs(a - b) / abs(b) for a, b in zip(losses, out["ddp"])),
            param_rel=max((a - b).abs().max().item() for a, b in zip(params, ddp_params))
            / max(b.abs().max().item() for b in ddp_params),
            engine_peak=engine_peak,
            flats_peak=ops.peak if ops is not None else 0,
            unit_bytes=max(ops.numel) * 4 if ops is not None else None,
            gathers=(ops.gathers, ops.regathers, ops.prefetched) if ops is not None else None)
    zero_ext.compiled.UNITS_IN_GRAPH = False
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "bench_units_in_graph.json"))
    a = ap.parse_args()
    from dist_harness import run_world
    results = run_world(_rank, 2, a.layers, a.width, a.steps, timeout_s=1800)
    for rank, out in enumerate(results):
        e, g = out["eager"], out["ingraph"]
        compiled = g["flats_peak"] + g["engine_peak"]
        print(f"rank {rank}: GPT {a.layers}x{a.width}; in-graph: breaks {g['breaks']}, graphs {g['graphs']}, "
              f"compiled after step 2 {g['recompiles']}; against compiled DDP: loss rel {g['loss_rel']:.2e}, "
              f"param rel {g['param_rel']:.2e} (eager stage 3: {e['loss_rel']:.2e}, {e['param_rel']:.2e}); "
              f"gathers {g['gathers']} (all, in backward, prefetched); gathered bytes at most: eager {e['engine_peak']}, "
              f"compiled {g['flats_peak']} flats + {g['engine_peak']} engine = {compiled} "
              f"({compiled / e['engine_peak']:.3f}x; largest unit {g['unit_bytes']})")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"layers": a.layers, "width": a.width, "steps": a.steps, "world": 2,
                               "ranks": results}, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
