"""Optimizer offload (offload="cpu"): step time beside the run without offload and beside
its floor, on the same GPT (examples/gpt.py), the same data and hyperparameters.

    python benchmarks/bench_offload.py                   # CPU engine: world 1 and 2 (gloo)
    python benchmarks/bench_offload.py --worlds 2 --reps 7
    python benchmarks/bench_offload.py --gpu             # one GPU: + FSDP2's CPUOffloadPolicy (skips without CUDA)

Each system trains --steps steps per repetition (the first --warmup not timed), the systems
interleaved within every repetition (benchmarks/machine.py: interleaved), every rank in
lock step; figures are medians [min, max] over repetitions of the mean time per step.

CPU (the machine's only device): "device" buffers are host memory too, so offload cannot
gain anything here; what it must not do is cost much. Reported per stage (1, 2):
  step      forward + backward + opt.step(), with and without offload; ratio offload / none
  opt.step  the optimizer call alone, with and without offload
  floor     the offloaded opt.step()'s floor: the opt.step() without offload (the same kernel
            and the parameter all-gather) + the bytes the rings copy (stats()["offload"]: down +
            up bytes of one step) once at the measured memcpy bandwidth; ratio offload
            opt.step / floor (goal on a GPU: <= 1.3). The fused Adam kernel alone over the
            shard (_C.adam_step, same ISA and threads) is reported beside it.

GPU (--gpu, torch.cuda.is_available()): one rank (nccl), bf16 parameters and reduce, AdamW:
zero_ext stage 2 with offload="cpu" beside FSDP2 (fully_shard per Block, MixedPrecisionPolicy
bf16/fp32... reduce bf16, CPUOffloadPolicy()) and beside zero_ext without offload; the floor is
PCIe bytes (stats()["offload"] down + up bytes per step) / measured pinned copy bandwidth (both
directions) + the CPU Adam kernel over the model at this host's threads. Also the device peak
(torch.cuda.max_memory_allocated) of each. Goal: within 1.3x of the floor, ahead of FSDP2.

Writes benchmarks/results/bench_offload.json (machine, torch, git HEAD, every figure).
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "examples"), os.path.join(REPO, "benchmarks")]

from machine import cpu_model, interleaved, spawn_ranks, spread  # noqa: E402

RESULTS = os.path.join(REPO, "benchmarks", "results", "bench_offload.json")


def gpt_config(size: str, vocab: int):
    from gpt import GPTConfig
    dims = {"small": dict(n_layer=4, n_head=4, n_embd=256, block_size=64),
            "medium": dict(n_layer=8, n_head=8, n_embd=512, block_size=128),
            "large": dict(n_layer=24, n_head=16, n_embd=2048, block_size=256)}[size]
    return GPTConfig(vocab_size=vocab, dropout=0.0, bias=False, **dims)


def memcpy_gbps(numel: int = 1 << 25, reps: int = 5) -> float:
    """Host memory copy bandwidth (read + write counted once, as a link copy is)."""
    a = torch.empty(numel, dtype=torch.float32).uniform_()
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def adam_kernel_s(numel: int, isa: str, reps: int = 5) -> float:
    """The fused AdamW kernel alone over numel fp32 elements (the floor's CPU part)."""
    from zero_ext import _C
    p, g, m, v = (torch.randn(numel) for _ in range(4))
    v.abs_()
    best = float("inf")
    for step in range(1, reps + 1):
        t = time.perf_counter()
        _C.adam_step(isa, p, g, m, v, None, None, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                     step=step, decoupled=True, amsgrad=False, maximize=False, grad_scale=1.0)
        best = min(best, time.perf_counter() - t)
    return best


def _cpu_worker(rank, world, store, out_dir, args):
    import torch.distributed as dist

    import zero_ext
    from gpt import GPT, CharDataset
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    data = CharDataset(os.path.join(REPO, "examples", "data", "tinyshakespeare.txt"))
    cfg = gpt_config(args.size, data.vocab_size)
    out = {}
    for stage in args.stages:
        runs = {}
        for name, offload in (("none", None), ("offload", "cpu")):
            torch.manual_seed(1)
            model = GPT(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
            zm, zo = zero_ext.zeroify(model, opt, stage=stage, offload=offload)
            runs[name] = (zm, zo)
        gen = torch.Generator().manual_seed(rank)
        batches = [data.get_batch("train", args.batch, cfg.block_size, gen) for _ in range(args.steps)]
        step_s = {}

        def one(name, rep):
            zm, zo = runs[name]
            total = opt_total = 0.0
            for k, (x, y) in enumerate(batches):
                t0 = time.perf_counter()
                _, loss = zm(x, y)
                loss.backward()
                t1 = time.perf_counter()
                zo.step()
                zo.zero_grad()
                t2 = time.perf_counter()
                if k >= args.warmup:
                    total += t2 - t0
                    opt_total += t2 - t1
            n = len(batches) - args.warmup
            return total / n, opt_total / n

        per_rep = interleaved(list(runs), one, args.reps)
        for name in runs:
            step_s[name] = spread([r[name][0] for r in per_rep])
            step_s[name + "_opt"] = spread([r[name][1] for r in per_rep])
        zo = runs["offload"][1]
        s = zo.stats()
        steps_done = s["steps"]
        off = s["offload"]
        down = off["down_bytes"] / steps_done
        up = off["up_bytes"] / steps_done
        ratio = spread([r["offload"][0] / r["none"][0] for r in per_rep])
        ratio_opt = spread([r["offload"][1] / r["none"][1] for r in per_rep])
        out[stage] = dict(step_s=step_s, ratio_step=ratio, ratio_opt=ratio_opt, down_bytes_per_step=down,
                          up_bytes_per_step=up, shard_numel=s["shard_numel"], isa=s["isa"],
                          host_bytes=off, num_params=s["num_params"])
        del runs
    bw = memcpy_gbps()
    for stage, r in out.items():
        kern = adam_kernel_s(r["shard_numel"], r["isa"])
        copies = (r["down_bytes_per_step"] + r["up_bytes_per_step"]) / (bw * 1e9)
        floor = r["step_s"]["none_opt"]["median"] + copies
        r.update(memcpy_GBps=bw, adam_kernel_s=kern, copies_s=copies, floor_s=floor,
                 opt_over_floor=r["step_s"]["offload_opt"]["median"] / floor)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _gpu_worker(rank, world, store, out_dir, args):
    """One GPU: zero_ext offload / zero_ext in memory / FSDP2 CPUOffloadPolicy, bf16."""
    import torch.distributed as dist

    import zero_ext
    from gpt import GPT
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    dev = torch.device("cuda", rank)
    cfg = gpt_config(args.gpu_size, 50304)
    out = {}

    def build(system):
        torch.manual_seed(1)
        with torch.device(dev):
            model = GPT(cfg)
        if system == "fsdp2_offload":
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            for block in model.blocks:
                fully_shard(block, mp_policy=mp, offload_policy=CPUOffloadPolicy())
            fully_shard(model, mp_policy=mp, offload_policy=CPUOffloadPolicy())
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
            return model, opt
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        return zero_ext.zeroify(model, opt, stage=2, param_dtype="bf16", reduce_dtype="bf16",
                                offload="cpu" if system == "zero_ext_offload" else None)

    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), device=dev)
    for system in args.gpu_systems:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            model, opt = build(system)
            times = []
            for k in range(args.steps):
                torch.cuda.synchronize()
                t = time.perf_counter()
                _, loss = model(x, x)
                loss.backward()
                opt.step()
                opt.zero_grad()
                torch.cuda.synchronize()
                if k >= args.warmup:
                    times.append(time.perf_counter() - t)
            r = dict(step_s=spread(times), peak_bytes=torch.cuda.max_memory_allocated() - base)
            if system == "zero_ext_offload":
                s = opt.stats()
                r["link_bytes_per_step"] = (s["offload"]["down_bytes"] + s["offload"]["up_bytes"]) / s["steps"]
                r["shard_numel"] = s["shard_numel"]
                r["isa"] = s["isa"]
            out[system] = r
            del model, opt
        except Exception as e:  # noqa: BLE001 - a system that cannot run is reported, not fatal
            out[system] = {"did_not_run": f"{type(e).__name__}: {str(e)[:300]}"}
    # the floor: pinned copies both ways, and the CPU kernel
    if "zero_ext_offload" in out and "did_not_run" not in out["zero_ext_offload"]:
        n = 1 << 26
        host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        devt = torch.empty(n, dtype=torch.bfloat16, device=dev)
        bws = []
        for src, dst in ((devt, host), (host, devt)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            bws.append(host.nbytes / (time.perf_counter() - t) / 1e9)
        r = out["zero_ext_offload"]
        kern = adam_kernel_s(r["shard_numel"], r["isa"])
        floor = r["link_bytes_per_step"] / (min(bws) * 1e9) + kern
        r.update(pcie_GBps=bws, adam_kernel_s=kern, floor_s=floor, over_floor=r["step_s"]["median"] / floor)
        if "fsdp2_offload" in out and "did_not_run" not in out["fsdp2_offload"]:
            r["vs_fsdp2_offload"] = r["step_s"]["median"] / out["fsdp2_offload"]["step_s"]["median"]
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--size", default="small", choices=["small", "medium", "large"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    ap.add_argument("--gpu", action="store_true", help="the one-GPU comparison (skips without CUDA)")
    ap.add_argument("--gpu-size", default="large", choices=["small", "medium", "large"])
    ap.add_argument("--gpu-systems", nargs="+", default=["zero_ext_offload", "zero_ext", "fsdp2_offload"])
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    result = {"machine": {"cpu": cpu_model(), "cores": os.cpu_count()}, "torch": torch.__version__,
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "args": vars(args), "cpu": {}}
    print(f"offload on the CPU engine: GPT '{args.size}', {args.steps - args.warmup} timed steps x {args.reps} "
          f"reps, {args.threads} thread(s) per rank; median [min, max]")
    print(f"{'N':>2} {'stage':>5} {'step none':>10} {'step offl':>10} {'offl/none':>20} "
          f"{'opt none':>9} {'opt offl':>9} {'floor':>8} {'opt/floor':>9}")
    for world in args.worlds:
        ranks = spawn_ranks(_cpu_worker, world, args)
        worst = {}
        for stage in args.stages:   # the slowest rank's figures
            worst[stage] = max((r[stage] for r in ranks), key=lambda x: x["step_s"]["offload"]["median"])
            r = worst[stage]
            st = r["step_s"]
            rt = r["ratio_step"]
            print(f"{world:>2} {stage:>5} {st['none']['median'] * 1e3:>8.1f}ms {st['offload']['median'] * 1e3:>8.1f}ms "
                  f"{rt['median']:>6.3f}x [{rt['min']:.3f}, {rt['max']:.3f}] "
                  f"{st['none_opt']['median'] * 1e3:>7.2f}ms {st['offload_opt']['median'] * 1e3:>7.2f}ms "
                  f"{r['floor_s'] * 1e3:>6.2f}ms {r['opt_over_floor']:>8.2f}x")
        result["cpu"][str(world)] = {"per_rank": [{str(k): v for k, v in r.items()} for r in ranks]}
    if args.gpu:
        if not torch.cuda.is_available():
            print("--gpu: skipped, no CUDA device (torch.cuda.is_available() is False)")
            result["gpu"] = {"skipped": "no CUDA device"}
        else:
            gpu = spawn_ranks(_gpu_worker, 1, args)[0]
            result["gpu"] = gpu
            print(f"\none GPU ({torch.cuda.get_device_name(0)}), GPT '{args.gpu_size}', bf16:")
            for system, r in gpu.items():
                if "did_not_run" in r:
                    print(f"  {system:<18} did not run: {r['did_not_run']}")
                    continue
                extra = ""
                if "floor_s" in r:
                    extra = f"  floor {r['floor_s'] * 1e3:.1f} ms ({r['over_floor']:.2f}x)"
                    if "vs_fsdp2_offload" in r:
                        extra += f"  vs FSDP2 offload {r['vs_fsdp2_offload']:.2f}x"
                print(f"  {system:<18} step {r['step_s']['median'] * 1e3:8.1f} ms  peak "
                      f"{r['peak_bytes'] / 2**30:6.2f} GiB{extra}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=float)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
