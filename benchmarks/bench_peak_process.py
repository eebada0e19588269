"""Memory per process as a user sees it: each system alone in its own torchrun launch, the
peak resident memory during training steps and what stays between steps, on a GPT built on
the meta device (examples/gpt.py), AdamW, gloo ranks on the CPU.

    python benchmarks/bench_peak_process.py                       # 12 layers x 768 (~98M), 2 ranks
    python benchmarks/bench_peak_process.py --layers 6 --worlds 2,4 --systems zero3,fsdp2

Per rank, in MiB above the resident memory right after init_process_group: `steady` after
the steps (gc'd), `peak` the most resident during steps 2..N (VmHWM, reset after the first
step). glibc's mmap threshold is fixed at 64 KiB so that freed tensors go back to the
kernel. For zero_ext also its own accounting at the end (opt.stats(): model state, the
gradients and ring held now) and `other` = steady minus that accounting (torch's own
allocations, which every system has: compare with DDP's and FSDP2's steady minus their
model state). Each row is the rank with the highest peak.

Systems: ddp; fsdp2 (fully_shard on each block, then the root; fp32), fsdp2-bf16
(MixedPrecisionPolicy bf16 params, fp32 reduce); zero0, zero1, zero2, zero3 (unit_modules=["Block"]),
zeroN-bf16 (param_dtype="bf16") and zeroN-offload (offload="cpu") for N = 1, 2, 3.
Writes benchmarks/results/bench_peak_process.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import cpu_model, proc_status_mib as _status

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "bench_peak_process.json"
SYSTEMS = ["ddp", "fsdp2", "fsdp2-bf16", "zero0", "zero1", "zero2", "zero3", "zero1-bf16", "zero2-bf16", "zero3-bf16",
           "zero1-offload", "zero2-offload", "zero3-offload"]
MiB = 2 ** 20


def worker(system: str, layers: int, steps: int, out: str, extra: dict, timeline: bool = False) -> None:
    import ctypes
    import gc

    import torch
    import torch.distributed as dist
    sys.path.insert(0, str(REPO / "examples"))
    from gpt import GPT

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)   # M_MMAP_THRESHOLD: freed tensors leave the process
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    base = _status("VmRSS")
    cfg = _gpt_config(layers)
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())

    def init(m):
        for p in m.parameters(recurse=False):
            torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)

    def materialize(m):
        m.to_empty(device="cpu")
        m.apply(init)

    zopt = None
    if system.startswith("zero"):
        import zero_ext
        stage = int(system[4])
        options = dict(ZERO_OPTIONS.get(system, {}), **extra)
        if stage == 3:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            model, opt = zero_ext.zeroify(model, opt, stage=3, unit_modules=["Block"], init_fn=init, **options)
        else:
            materialize(model)
            model, opt = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-4), stage=stage,
                                          **options)
        zopt = opt
    elif system.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if system == "fsdp2-bf16" else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        materialize(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        materialize(model)
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    row = {"system": system, "rank": rank, "world": world, "params": n}
    plain = getattr(model, "module", model)
    probe = None
    for it in range(steps):
        if it == 1:
            gc.collect()
            open("/proc/self/clear_refs", "w").write("5")   # VmHWM := VmRSS
        if timeline and it == steps - 1:
            from memory_timeline import Timeline, engine_owners, torch_owners
            probe = Timeline(plain.blocks, plain, engine_owners(zopt, len(plain.blocks)) if zopt is not None
                             else torch_owners(plain, opt, plain.blocks))
            probe.__enter__()
        x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=g)
        _, loss = model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
        if probe is not None:
            probe.mark("loss")
        loss.backward()
        if probe is not None:
            probe.mark("backward end")
        opt.step()
        if probe is not None:
            probe.mark("step end")
        opt.zero_grad(set_to_none=True)
        if probe is not None:
            probe.__exit__(None, None, None)
            row_timeline = probe.result(base)
    gc.collect()
    row["steady"] = _status("VmRSS") - base
    row["peak"] = _status("VmHWM") - base
    if zopt is not None:
        s = zopt.stats()
        msb, held, buf = s["model_state_bytes"], s["held_bytes"], s["buffer_bytes"]
        row["engine"] = {"parameters": msb["parameters"] / MiB, "master_weights": msb["master_weights"] / MiB,
                         "optimizer_states": msb["optimizer_states"] / MiB, "gradients_held": held["gradients"] / MiB,
                         "grad_ring_held": held["grad_ring"] / MiB, "gathered_now": buf["gathered_params"] / MiB,
                         "step_gradients": msb["gradients"] / MiB, "step_grad_ring": buf["grad_ring"] / MiB,
                         "peak_gathered": buf["peak_gathered_params"] / MiB}
        if s["offload"]:
            row["engine"]["offload_host"] = s["offload"]["total"] / MiB
        e = row["engine"]
        row["accounted"] = sum(e[k] for k in ("parameters", "master_weights", "optimizer_states", "gradients_held",
                                              "grad_ring_held", "gathered_now", "offload_host") if k in e)
        row["other"] = row["steady"] - row["accounted"]
    if probe is not None:
        row["timeline"] = row_timeline
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.destroy_process_group()


def run(system: str, world: int, layers: int, steps: int, extra: str = "{}", timeline: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "examples")]))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", __file__,
               "--worker", system, "--layers", str(layers), "--steps", str(steps), "--out", tmp, "--zero-options", extra] + (["--timeline"] if timeline else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            return {"system": system, "world": world, "error": proc.stderr[-2000:]}
        rows = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]
    top = max(rows, key=lambda r: r["peak"])
    return {**top, "ranks": rows}


ZERO_OPTIONS = {f"zero{s}-{kind}": dict(param_dtype="bf16") if kind == "bf16" else dict(offload="cpu")
                for s in (1, 2, 3) for kind in ("bf16", "offload")}


def _gpt_config(layers: int):
    sys.path.insert(0, str(REPO / "examples"))
    from gpt import GPTConfig
    return GPTConfig(vocab_size=8192, block_size=256, n_layer=layers, n_head=12, n_embd=768, bias=False)


def predicted_peak(system: str, world: int, layers: int, extra: dict) -> float:
    """zero_ext.estimate_memory(..., loss_fn=...)'s peak for this system, MiB (the model on meta)."""
    import torch

    sys.path.insert(0, str(REPO))   # this tree's estimator, not the installed zero_ext's
    import zero_ext
    cfg = _gpt_config(layers)
    from gpt import GPT
    with torch.device("meta"):
        model = GPT(cfg)

    def loss_fn(m):
        x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1))
        return m(x[:, :-1].contiguous(), x[:, 1:].contiguous())[1]

    options = dict(ZERO_OPTIONS.get(system, {}), **extra)
    if system.startswith("zero3"):
        options.setdefault("unit_modules", ["Block"])
    est = zero_ext.estimate_memory(model, world, int(system[4]), optimizer="adamw", loss_fn=loss_fn, **options)
    p = est["peak"]   # a model on meta is taken to train on a GPU: here its host state is process memory too
    return (p["model_state"] + p["gathered"] + p["activations"] + p["offload_host"]) / MiB


def _peer(results: list, r: dict):
    """The FSDP2 row r is judged against: same world, bf16 params if r's are."""
    name = "fsdp2-bf16" if r["system"].endswith("bf16") else "fsdp2"
    return next((x for x in results if x["world"] == r["world"] and x["system"] == name), None)


def summarize(results: list, layers: int, extra: dict) -> None:
    """The tables: per system, its breakdown at the peak, and the estimator against the measure."""
    print(f"{'world':>5} {'system':<14} {'steady MiB':>10} {'peak MiB':>9} {'peak/FSDP2':>10} {'peak/DDP':>9} "
          f"{'engine MiB':>10} {'other MiB':>9}")
    for r in results:
        same = {x["system"]: x for x in results if x["world"] == r["world"]}
        fsdp = (_peer(results, r) or {}).get("peak")
        ddp = same.get("ddp", {}).get("peak")
        ratio = lambda ref: f"{r['peak'] / ref:.2f}x" if ref else "-"   # noqa: E731
        acc = f"{r['accounted']:.0f}" if "accounted" in r else "-"
        other = f"{r['other']:.0f}" if "other" in r else "-"
        print(f"{r['world']:>5} {r['system']:<14} {r['steady']:>10.0f} {r['peak']:>9.0f} {ratio(fsdp):>10} "
              f"{ratio(ddp):>9} {acc:>10} {other:>9}")
    timelines = [r for r in results if "timeline" in r]
    if timelines:
        from memory_timeline import OWNERS, breakdown, loss_floor
        print("\nAt the peak, by owner (MiB; the owners as the last mark before the peak saw them):")
        cols = ("peak", "process") + OWNERS + ("unexplained",)
        print(f"{'world':>5} {'system':<14} {'at':<12} " + " ".join(f"{c[:12]:>12}" for c in cols))
        for r in timelines:
            b = r["breakdown"] = breakdown(r["timeline"])
            print(f"{r['world']:>5} {r['system']:<14} {b['at']:<12} " + " ".join(f"{b[c]:>12.0f}" for c in cols))
        print("\nAround the loss (MiB): the most resident from the loss to the next mark, the units held gathered "
              "ahead of their use there, and the rest (`floor`: torch, model state, root, activations, the loss's "
              "temporaries), against FSDP2's peak:")
        print(f"{'world':>5} {'system':<14} {'at loss':>8} {'ahead':>6} {'floor':>6} {'floor/FSDP2':>11}")
        for r in timelines:
            f = r["loss_floor"] = loss_floor(r["timeline"])
            peer = _peer(results, r)
            ratio = f"{f['floor'] / peer['peak']:.3f}" if peer else "-"
            print(f"{r['world']:>5} {r['system']:<14} {f['at_loss']:>8.0f} {f['ahead']:>6.0f} {f['floor']:>6.0f} "
                  f"{ratio:>11}")
    print("\nestimate_memory(..., loss_fn=...)'s peak against the measured peak minus what the process holds "
          "beyond zero_ext between steps (torch, libraries), MiB:")
    print(f"{'world':>5} {'system':<14} {'measured':>9} {'predicted':>9} {'ratio':>6}")
    for r in results:
        if "other" not in r:
            continue
        r["predicted_peak"] = predicted_peak(r["system"], r["world"], layers, extra)
        measured = r["peak"] - r["other"]
        print(f"{r['world']:>5} {r['system']:<14} {measured:>9.0f} {r['predicted_peak']:>9.0f} "
              f"{r['predicted_peak'] / measured:>6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--worlds", default="2")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--json", default=str(RESULTS))
    ap.add_argument("--timeline", action="store_true", help="record memory over the last step (for the plot)")
    ap.add_argument("--zero-options", default="{}", help="JSON: more zeroify options for the zero systems")
    ap.add_argument("--summarize", help="a JSON this script wrote: print its tables (and add the breakdown and "
                    "estimate to it), run nothing")
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.layers, a.steps, a.out, json.loads(a.zero_options), a.timeline)
    import torch
    if a.summarize:   # the tables again, and the breakdown and prediction written into the JSON
        path = Path(a.summarize)
        d = json.loads(path.read_text())
        summarize(d["results"], d["layers"], d.get("zero_options", {}))
        path.write_text(json.dumps(d, indent=1))
        return
    results = []
    for world in [int(w) for w in a.worlds.split(",")]:
        for s in a.systems.split(","):
            r = run(s, world, a.layers, a.steps, a.zero_options, a.timeline)
            if "error" in r:
                print(f"{world:>5} {s:<14} failed: {r['error'][-300:]}")
            else:
                results.append(r)
    summarize(results, a.layers, json.loads(a.zero_options))
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    out.write_text(json.dumps({"machine": cpu_model(), "torch": torch.__version__, "commit": commit,
                               "layers": a.layers, "steps": a.steps, "zero_options": json.loads(a.zero_options),
                               "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
