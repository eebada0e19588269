"""The compiled training step (issue 54): zero_ext under torch.compile against compiled DDP and
FSDP2 compiled per block, at 2 gloo ranks (1 thread each) on this CPU.

    python benchmarks/bench_compile.py                        # GPT 6 x 384, then a ~53M Llama
    python benchmarks/bench_compile.py --models gpt           # the GPT only (--models llama: the Llama)
    python benchmarks/bench_compile.py --reps 3 --steps 2     # a quick look

Models: (a) examples/gpt.py's GPT, nanoGPT's tinyshakespeare size (6 layers, width 384, 6
heads, vocab 65, block 256; 10.7M parameters), batch 2 x 128 tokens per rank; (b) a Hugging
Face LlamaForCausalLM built from a LlamaConfig (6 layers, width 512, MLP 1536, 8 heads, vocab
32000; 53M parameters, no download), batch 1 x 64 tokens per rank, the loss taken outside
the model. AdamW (lr 1e-4), fp32, the same initial weights and data for every system.

Systems (each built from the same initial model, all alive in the same two processes):
  ddp            torch.compile(DDP(model)) (DDPOptimizer splits the graph at bucket bounds)
  fsdp2          each block compiled in place (block.compile()), then fully_shard per block and
                 the root (CPU mesh; SUM reduction divided by the world size), as torch's
                 FSDP2 docs and torchtitan do: the hooks between blocks stay outside the graphs
  zero2          zeroify(stage=2), torch.compile(model, fullgraph=True)
  zero3-per_unit zeroify(stage=3), torch.compile(model) (the default compile_units="per_unit":
                 breaks the graph at each unit, keeps stage 3's memory)
  zero3-whole    compile_units="whole", fullgraph=True (every unit gathered before the graph)
  zero3-ingraph  compile_units="whole" with compiled.UNITS_IN_GRAPH (the prototype of
                 zero_ext/unit_ops.py), fullgraph=True; a row saying why where it fails
  zero3-eager    zeroify(stage=3), not compiled: the memory reference for stage 3
Stage 3's units: unit_modules=["Block"] / ["LlamaDecoderLayer"].

Measured, per system: the first 3 steps compile (each system's compile in a fresh inductor
cache, in-memory code caches cleared, so no system reuses another's kernels); `compile s` is
steps 1-2's wall time minus twice the median step. Then --reps repetitions, every system in
each (the first one rotating, ranks in lock step), each --steps steps; a repetition's time is
the median of its steps (rank 0's clock). `x DDP` and `x FSDP2` are the medians over
repetitions of the ratio within each repetition. Dynamo's counters per system: `graphs`
(stats.unique_graphs after step 2), `breaks` (graph_break, summed), `recomp` (graphs compiled
after step 2, through the last timed step). `step peak MiB`: one more step after the timing
per system, the rise of the process's peak resident set (VmHWM, reset before it) above the
resident set before it (glibc's mmap threshold fixed at 64 KiB, so freed tensors leave the
process); the rank with the highest. `x eager3`: that over zero3-eager's.
The load average is read before and after. JSON: benchmarks/results/bench_compile.json.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "examples")]   # zero_ext, gpt.py (the spawned ranks import this file too)

from machine import cpu_model, interleaved, proc_status_mib as _status, spawn_ranks, spread  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "bench_compile.json"
SYSTEMS = ["ddp", "fsdp2", "zero2", "zero3-per_unit", "zero3-whole", "zero3-ingraph", "zero3-eager"]
WARMUP = 3      # steps 1-2 compile (forward, backward); step 3 checks no recompile
MiB = 2 ** 20


# -- models: (build, blocks, unit class, batch(generator) -> (x, y), loss(model, x, y))
def gpt_model():
    import torch
    from gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384, bias=False)

    def batch(g):
        idx = torch.randint(0, cfg.vocab_size, (2, 129), generator=g)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    def loss(model, x, y):
        return model(x, y)[1]
    return dict(name="gpt", build=lambda: GPT(cfg), blocks=lambda m: m.blocks, unit="Block", batch=batch, loss=loss,
                config="GPT 6 layers x 384, 6 heads, vocab 65, block 256; batch 2 x 128 per rank")


def llama_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                      tie_word_embeddings=False, attention_dropout=0.0)

    def batch(g):
        idx = torch.randint(0, cfg.vocab_size, (1, 65), generator=g)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    def loss(model, x, y):   # outside the model: labels= logs a warning that stops fullgraph
        logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
    return dict(name="llama", build=lambda: LlamaForCausalLM(cfg), blocks=lambda m: m.model.layers,
                unit="LlamaDecoderLayer", batch=batch, loss=loss,
                config="LlamaForCausalLM 6 layers x 512, MLP 1536, 8 heads, vocab 32000, untied; batch 1 x 64 per rank")


# -- systems
def build_system(name: str, base, spec, world: int):
    """(model to call, optimizer) for one system, from a copy of base."""
    import torch
    import torch.distributed as dist

    import zero_ext
    model = copy.deepcopy(base)
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-4)   # noqa: E731
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return torch.compile(DDP(model)), adamw(model.parameters())
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in spec["blocks"](model):
            block.compile()
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(float(world))
        return model, adamw(model.parameters())
    stage = int(name[4])
    kw = {}
    if stage == 3:
        kw = dict(unit_modules=[spec["unit"]])
        if name in ("zero3-whole", "zero3-ingraph"):
            kw["compile_units"] = "whole"
    zm, zo = zero_ext.zeroify(model, adamw(model.parameters()), stage=stage, **kw)
    if name == "zero3-eager":
        return zm, zo
    return torch.compile(zm, fullgraph=name != "zero3-per_unit"), zo


def worker(rank, world, store, out_dir, args):
    import ctypes

    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    import zero_ext
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)   # M_MMAP_THRESHOLD: freed tensors leave the process
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64   # several models share torch.nn/transformers code objects
    torch._inductor.config.fx_graph_cache = False
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result = {}
    for spec in [{"gpt": gpt_model, "llama": llama_model}[m]() for m in args["models"]]:
        torch.manual_seed(0)
        base = spec["build"]()
        n_params = sum(p.numel() for p in base.parameters())
        systems, rows = {}, {}
        gen = torch.Generator().manual_seed(1 + rank)

        def step(name):
            model, opt = systems[name]
            zero_ext.compiled.UNITS_IN_GRAPH = name == "zero3-ingraph"
            x, y = spec["batch"](gen)
            t0 = time.perf_counter()
            spec["loss"](model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        for name in args["systems"]:
            dist.barrier()
            counters.clear()
            row = rows[name] = {}
            try:
                with fresh_cache():
                    systems[name] = build_system(name, base, spec, world)
                    warm = [step(name) for _ in range(2)]
                row["graphs"] = counters["stats"]["unique_graphs"]
                row["breaks"] = sum(counters["graph_break"].values())
                row["break_reasons"] = sorted(counters["graph_break"])[:5]
                warm.append(step(name))
                row["warm_s"] = warm
                row["recompiles"] = counters["stats"]["unique_graphs"] - row["graphs"]
            except Exception as e:   # the prototype's row says why it does not run
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                systems.pop(name, None)
            zero_ext.compiled.UNITS_IN_GRAPH = False
            if rank == 0:
                print(f"{spec['name']} {name}: {row.get('error') or {k: row[k] for k in ('graphs', 'breaks')}}, "
                      f"first steps {[round(t, 1) for t in row.get('warm_s', [])]} s", flush=True)
        names = [n for n in args["systems"] if n in systems]

        def time_one(name, rep):
            before = counters["stats"]["unique_graphs"]
            times = [step(name) for _ in range(args["steps"])]
            rows[name]["recompiles"] += counters["stats"]["unique_graphs"] - before
            return statistics.median(times)
        per_rep = interleaved(names, time_one, args["reps"])
        for name in names:
            gc.collect()
            dist.barrier()
            open("/proc/self/clear_refs", "w").write("5")   # VmHWM := VmRSS
            rss = _status("VmRSS")
            step(name)
            rows[name]["step_peak_mib"] = _status("VmHWM") - rss
            rows[name]["times"] = [r[name] for r in per_rep]
        zero_ext.compiled.UNITS_IN_GRAPH = False
        result[spec["name"]] = {"config": spec["config"], "params": n_params, "rows": rows}
        del systems
        torch._dynamo.reset()
        gc.collect()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _ratio(rows, name, ref):
    if ref not in rows or "times" not in rows[ref] or "times" not in rows[name]:
        return None
    return spread([a / b for a, b in zip(rows[name]["times"], rows[ref]["times"])])


def summarize(ranks: list) -> dict:
    """Rank 0's times, the highest rank's peak; ratios per repetition."""
    out = {}
    for model, r0 in ranks[0].items():
        rows = {}
        for name, row in r0["rows"].items():
            s = dict(row)
            if "times" in row:
                s["ms"] = spread([t * 1e3 for t in row["times"]])
                med = statistics.median(row["times"])
                if row["graphs"]:   # zero3-eager compiles nothing
                    s["compile_s"] = sum(row["warm_s"][:2]) - 2 * med
                s["step_peak_mib"] = max(rk[model]["rows"][name]["step_peak_mib"] for rk in ranks)
                s["recompiles"] = max(rk[model]["rows"][name]["recompiles"] for rk in ranks)
            rows[name] = s
        for name, s in rows.items():
            s["vs_ddp"], s["vs_fsdp2"] = _ratio(rows, name, "ddp"), _ratio(rows, name, "fsdp2")
            if "compile_s" in s and "compile_s" in rows.get("ddp", {}):
                s["compile_vs_ddp"] = s["compile_s"] / rows["ddp"]["compile_s"]
            eager = rows.get("zero3-eager", {}).get("step_peak_mib")
            if name.startswith("zero3") and eager and "step_peak_mib" in s:
                s["peak_vs_eager3"] = s["step_peak_mib"] / eager
        out[model] = {"config": r0["config"], "params": r0["params"], "rows": rows}
    return out


def goals(rows: dict) -> list:
    """Issue 54's goals, met or not, for one model."""
    g = []

    def ratio(name, key):
        v = rows.get(name, {}).get(key)
        return v["median"] if isinstance(v, dict) else v

    for name in ("zero3-per_unit", "zero3-whole", "zero3-ingraph"):
        for key, limit, what in (("vs_ddp", 1.0, "compiled DDP"), ("vs_fsdp2", 0.8, "FSDP2")):
            v = ratio(name, key)
            g.append((f"{name} <= {limit}x {what}", v, v is not None and v <= limit))
    v = ratio("zero2", "vs_ddp")
    g.append(("zero2 <= 0.95x compiled DDP", v, v is not None and v <= 0.95))
    for name in rows:
        if name not in ("ddp", "zero3-eager"):
            v = ratio(name, "compile_vs_ddp")
            g.append((f"{name} compile time <= 1.5x compiled DDP's", v, v is not None and v <= 1.5))
    for name in ("zero3-per_unit", "zero3-whole", "zero3-ingraph"):
        v = ratio(name, "peak_vs_eager3")
        g.append((f"{name} step peak <= 1.05x zero3 eager", v, v is not None and v <= 1.05))
    return g


def print_report(report: dict) -> None:
    fmt = lambda v, f="{:.2f}x": "-" if v is None else f.format(v["median"] if isinstance(v, dict) else v)  # noqa
    for model, m in report["models"].items():
        print(f"\n{model}: {m['config']}; {m['params'] / 1e6:.1f}M parameters; 2 gloo ranks, 1 thread each; "
              f"median [min, max] of {report['reps']} repetitions x {report['steps']} steps")
        print(f"{'system':<15} {'ms/step':>22} {'x DDP':>6} {'x FSDP2':>7} {'compile s':>9} {'x DDP':>6} "
              f"{'graphs':>6} {'breaks':>6} {'recomp':>6} {'step peak MiB':>13} {'x eager3':>8}")
        for name, s in m["rows"].items():
            if "error" in s:
                print(f"{name:<15} does not run: {s['error'][:200]}")
                continue
            ms = s["ms"]
            print(f"{name:<15} {ms['median']:>8.1f} [{ms['min']:>5.1f}, {ms['max']:>5.1f}] {fmt(s['vs_ddp']):>6} "
                  f"{fmt(s['vs_fsdp2']):>7} {fmt(s.get('compile_s'), '{:.1f}'):>9} {fmt(s.get('compile_vs_ddp')):>6} "
                  f"{s['graphs']:>6} {s['breaks']:>6} {s['recompiles']:>6} {s['step_peak_mib']:>13.1f} "
                  f"{fmt(s.get('peak_vs_eager3')):>8}")
        print("goals (issue 54):")
        for what, v, met in m["goals"]:
            print(f"  {'met    ' if met else 'NOT met'} {what}: {'-' if v is None else f'{v:.2f}x'}")
    print(f"\nload average before / after: {report['load_before']} / {report['load_after']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--models", default="gpt,llama", help="gpt, llama or both")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--json", type=Path, default=RESULTS)
    ap.add_argument("--raw", type=Path, help="summarize the ranks' results a run saved (JSON.raw), run nothing")
    a = ap.parse_args()
    os.environ.update(OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    import torch
    load_before = open("/proc/loadavg").read().split()[:3]
    t0 = time.time()
    if a.raw:
        raw = json.loads(a.raw.read_text())
        ranks, load_before, t0 = raw["ranks"], raw["load_before"], time.time() - raw["wall_s"]
    else:
        ranks = spawn_ranks(worker, 2, dict(reps=a.reps, steps=a.steps, models=a.models.split(","),
                                            systems=a.systems.split(",")))
        a.json.parent.mkdir(parents=True, exist_ok=True)   # kept before anything can fail
        Path(str(a.json) + ".raw").write_text(json.dumps({"ranks": ranks, "load_before": load_before,
                                                          "wall_s": time.time() - t0}))
    models = summarize(ranks)
    for m in models.values():
        m["goals"] = goals(m["rows"])
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    report = {"machine": cpu_model(), "torch": torch.__version__, "commit": commit, "world": 2, "threads": 1,
              "reps": a.reps, "steps": a.steps, "warmup": WARMUP, "wall_s": time.time() - t0,
              "load_before": load_before, "load_after": open("/proc/loadavg").read().split()[:3],
              "command": "python benchmarks/bench_compile.py " + " ".join(sys.argv[1:]), "models": models}
    print_report(report)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
