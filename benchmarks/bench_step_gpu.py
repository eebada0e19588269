"""One training step of a >= 1B-parameter bf16 GPT on one GPU, world size 1:
plain torch (autocast bf16 + AdamW fused=True), zero_ext stages 1-3 (param_dtype bf16,
fp32 masters: stages 1-2 keep them as the bf16 parameter + a remainder by default, the
*_fp32master systems as fp32) and FSDP2 fully_shard (MixedPrecisionPolicy bf16), interleaved.

    python benchmarks/bench_step_gpu.py                 # 1.3B GPT, 5 reps x 5 steps
    python benchmarks/bench_step_gpu.py --layers 4 --width 1024   # quick look

Needs a CUDA GPU and zero_ext built with CUDA; otherwise it says so and exits 0.
Reported per system: step time (median [min, max] over reps), ratio to plain torch
(target <= 1.03) and to FSDP2 (target <= 1.0 for our stage 3), tokens/s, peak memory.
JSON: benchmarks/results/bench_step_gpu.json.
"""
import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def build(args):
    from gpt import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50304, block_size=args.seq, n_layer=args.layers, n_head=args.width // 128,
                    n_embd=args.width, bias=False)
    with torch.device("cuda"):
        return GPT(cfg)


def make_system(name, args):
    import zero_ext
    model = build(args)
    if name == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    if name == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step(x, y):
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    # "zero1" .. "zero3"; "zero1_fp32master": the same with an fp32 master shard instead of
    # the bf16 parameter + remainder (master_remainder=False), the split master's cost
    stage = int(name[4])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    zm, zo = zero_ext.zeroify(model, opt, stage=stage, param_dtype="bf16",
                              master_remainder=not name.endswith("_fp32master"))

    def step(x, y):
        zm(x, y)[1].backward()
        zo.step()
        zo.zero_grad()
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per rep")
    parser.add_argument("--systems", default="torch,fsdp2,zero1,zero2,zero3,zero1_fp32master,zero2_fp32master")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "bench_step_gpu.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_step_gpu: no CUDA device (torch.cuda.is_available() is False); nothing to measure.")
        return 0
    from zero_ext import _C
    if not hasattr(_C, "cuda_adam_step"):
        print("bench_step_gpu: zero_ext was built without CUDA (no cuda_adam_step); nothing to measure.")
        return 0
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, 50304, (args.batch, args.seq), device="cuda", generator=g)
    y = torch.randint(0, 50304, (args.batch, args.seq), device="cuda", generator=g)
    names = args.systems.split(",")
    times = {n: [] for n in names}
    peak = {}
    errors = {}
    numel = None
    # Build one system at a time (a 1.3B model with its optimizer fills ~20 GB), time it in
    # reps, and interleave by cycling the systems over the reps.
    for rep in range(args.reps):
        for n in names:
            if n in errors:
                continue
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                step = make_system(n, args)
                step(x, y)                      # warm-up (also allocates optimizer state)
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(args.steps):
                    step(x, y)
                b.record()
                torch.cuda.synchronize()
                times[n].append(a.elapsed_time(b) / args.steps)
                peak[n] = max(peak.get(n, 0), torch.cuda.max_memory_allocated())
            except Exception as e:  # a system that cannot run is reported, not fatal
                errors[n] = f"{type(e).__name__}: {e}"[:500]
            finally:
                step = None
        if numel is None:
            numel = sum(p.numel() for p in build(args).parameters())
            torch.cuda.empty_cache()
    tokens = args.batch * args.seq
    med = {n: statistics.median(t) for n, t in times.items() if t}
    rows = {}
    print(f"GPT {numel / 1e9:.2f}B params, batch {args.batch} x {args.seq}, {torch.cuda.get_device_name(0)}")
    print(f"{'system':>16} {'ms/step':>9} {'[min, max]':>18} {'vs torch':>9} {'vs fsdp2':>9} {'tok/s':>9} {'peak GiB':>9}")
    for n in names:
        if n in errors:
            print(f"{n:>16} did not run: {errors[n]}")
            rows[n] = {"did_not_run": errors[n]}
            continue
        t = times[n]
        r = {"median_ms": med[n], "min_ms": min(t), "max_ms": max(t), "tokens_per_s": tokens / med[n] * 1e3,
             "peak_bytes": peak[n], "vs_torch": med[n] / med["torch"] if "torch" in med else None,
             "vs_fsdp2": med[n] / med["fsdp2"] if "fsdp2" in med else None}
        rows[n] = r
        vt = f"{r['vs_torch']:.3f}" if r["vs_torch"] else "-"
        vf = f"{r['vs_fsdp2']:.3f}" if r["vs_fsdp2"] else "-"
        print(f"{n:>16} {med[n]:9.1f} [{min(t):7.1f}, {max(t):7.1f}] {vt:>9} {vf:>9} "
              f"{r['tokens_per_s']:9.0f} {peak[n] / 2 ** 30:9.2f}")
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": {"numel": numel, "args": vars(args), "torch": torch.__version__,
                                        "device": torch.cuda.get_device_name(0),
                                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat()},
                               "systems": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
