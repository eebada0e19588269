"""GPU optimizer step: zero_ext's fused AdamW + bf16 copy-out vs the memory ceiling and vs torch.

    python benchmarks/bench_optimizer_gpu.py                       # sizes 16M,64M,256M,1B
    python benchmarks/bench_optimizer_gpu.py --sizes 16M,256M --reps 7

Needs a CUDA GPU and zero_ext built with CUDA; otherwise it says so and exits 0.
Per size n (fp32 master, grad, m, v; bf16 copy of the parameter), in one run,
interleaved A B C A B C ... (>= 5 reps, median/min/max, torch.cuda.Event timing):
  ours          zero_ext._C.cuda_adam_step(..., param_lp=bf16): one pass, 30 bytes/param
                (read p, g, m, v; write p, m, v, p16)
  torch         torch.optim.AdamW(fused=True).step() + p16.copy_(p) (what a torch user runs)
  copy          dst.copy_(src) of n fp32: the device-to-device copy ceiling (2*4n bytes)
Reported: ours in GB/s and as a fraction of the copy's GB/s (target >= 0.90), and
torch time / ours time (target >= 1.15). Then "many small tensors" (default 2000
tensors of 4K..256K elements): ours on their flat concatenation (one launch, as the
ZeRO shard is laid out) vs torch fused AdamW over the list + torch._foreach_copy_ to bf16.
Then the split master (Note [Split master], stages 0-2 with bf16 parameters: the master kept as
the bf16 parameter + a 16-bit remainder + a tie bit) at --split-size: the engine's step, chunk by
chunk of 2^24 elements (join into fp32 scratch, the same Adam kernel, split back), against the
step on an fp32 master, the fused step (cuda_adam_step_split: join, Adam and split in one pass,
28.25 bytes/param, what the engine runs for Adam with fp32 states), and join + split alone
against the copy ceiling (16.25 bytes/param: read hi, rem, ties and write fp32; read fp32 and hi,
write rem and ties).
JSON goes to benchmarks/results/bench_optimizer_gpu.json.
"""
import argparse
import datetime
import json
import math
import pathlib
import statistics
import sys

import torch

ADAM_BYTES_PER_PARAM = 30  # fp32 p, g, m, v read; p, m, v written; bf16 p written
LR, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01


def parse_size(text):
    units = {"K": 2 ** 10, "M": 2 ** 20, "B": 2 ** 30, "G": 2 ** 30}
    text = text.strip().upper()
    if text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def fmt_size(n):
    for unit, scale in (("B", 2 ** 30), ("M", 2 ** 20), ("K", 2 ** 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def time_once(fn, iters):
    """Milliseconds per call of fn, over `iters` back-to-back calls."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def bench_interleaved(variants, reps, warmup, min_rep_ms):
    """variants: {name: fn}. Returns {name: [ms per call, one per rep]}, interleaved A B A B."""
    iters = {}
    for name, fn in variants.items():
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        est = time_once(fn, 1)
        iters[name] = max(1, math.ceil(min_rep_ms / max(est, 1e-3)))
    times = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            times[name].append(time_once(fn, iters[name]))
    return times


def summary(ms):
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "reps": len(ms)}


def adam_tensors(n, seed):
    """(param, grad, exp_avg, exp_avg_sq) of n fp32 elements on the GPU, states at zero."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    p = torch.randn(n, device=dev, generator=gen)
    g = torch.randn(n, device=dev, generator=gen) * 1e-2
    return p, g, torch.zeros(n, device=dev), torch.zeros(n, device=dev)


def bench_size(C, n, args):
    dev = torch.device("cuda")
    p, g, m, v = adam_tensors(n, 0)
    p16 = torch.empty(n, device=dev, dtype=torch.bfloat16)
    copy_dst = torch.empty(n, device=dev)
    ref = torch.nn.Parameter(p.clone())
    ref.grad = g  # torch's optimizer reads the same gradient buffer
    ref16 = torch.empty(n, device=dev, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([ref], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD, fused=True)
    step = [0]

    def ours():
        step[0] += 1
        C.cuda_adam_step(p, g, m, v, None, p16, LR, BETA1, BETA2, EPS, WD, step[0], True, False, False, 1.0)

    def torch_fused_copy():
        opt.step()
        ref16.copy_(ref.detach())

    def copy():
        copy_dst.copy_(g)

    times = bench_interleaved({"ours": ours, "torch_fused+copy": torch_fused_copy, "copy": copy},
                              args.reps, args.warmup, args.min_rep_ms)
    med = {k: statistics.median(t) for k, t in times.items()}
    ours_gbps = ADAM_BYTES_PER_PARAM * n / (med["ours"] * 1e-3) / 1e9
    copy_gbps = 2 * 4 * n / (med["copy"] * 1e-3) / 1e9
    result = {
        "numel": n,
        "times": {k: summary(t) for k, t in times.items()},
        "ours_GBps": ours_gbps,
        "copy_GBps": copy_gbps,
        "ours_fraction_of_copy": ours_gbps / copy_gbps,
        "ours_Gparams_per_s": n / (med["ours"] * 1e-3) / 1e9,
        "speedup_vs_torch_fused_plus_copy": med["torch_fused+copy"] / med["ours"],
    }
    del p, g, m, v, p16, copy_dst, ref, ref16, opt
    torch.cuda.empty_cache()
    return result


def bench_small(C, args):
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(1)
    sizes = torch.randint(args.small_min, args.small_max + 1, (args.small_count,), generator=gen).tolist()
    total = sum(sizes)
    flat = [torch.randn(total, device=dev) if k == 0 else torch.zeros(total, device=dev) for k in range(4)]
    flat[1].normal_().mul_(1e-2)
    fp, fg, fm, fv = flat
    f16 = torch.empty(total, device=dev, dtype=torch.bfloat16)
    params, lps = [], []
    offset = 0
    for s in sizes:
        t = torch.nn.Parameter(fp[offset:offset + s].clone())
        t.grad = fg[offset:offset + s].clone()
        params.append(t)
        lps.append(torch.empty(s, device=dev, dtype=torch.bfloat16))
        offset += s
    opt = torch.optim.AdamW(params, lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD, fused=True)
    detached = [t.detach() for t in params]
    step = [0]

    def ours_flat():
        step[0] += 1
        C.cuda_adam_step(fp, fg, fm, fv, None, f16, LR, BETA1, BETA2, EPS, WD, step[0], True, False, False, 1.0)

    def torch_fused_list():
        opt.step()
        torch._foreach_copy_(lps, detached)

    times = bench_interleaved({"ours_flat": ours_flat, "torch_fused_list+foreach_copy": torch_fused_list},
                              args.reps, args.warmup, args.min_rep_ms)
    med = {k: statistics.median(t) for k, t in times.items()}
    result = {
        "tensors": len(sizes),
        "numel_min": min(sizes),
        "numel_max": max(sizes),
        "numel_total": total,
        "times": {k: summary(t) for k, t in times.items()},
        "ours_GBps": ADAM_BYTES_PER_PARAM * total / (med["ours_flat"] * 1e-3) / 1e9,
        "speedup_vs_torch": med["torch_fused_list+foreach_copy"] / med["ours_flat"],
    }
    del flat, fp, fg, fm, fv, f16, params, lps, opt, detached
    torch.cuda.empty_cache()
    return result


SPLIT_BYTES_PER_PARAM = 16.25   # join: 2 + 2 + 1/8 read, 4 written; split: 4 + 2 read, 2 + 1/8 written
FUSED_BYTES_PER_PARAM = 28.25   # read hi, rem, ties, g, m, v (16.125); write hi, rem, ties, m, v (12.125)
SPLIT_CHUNK = 1 << 24           # MasterSplit::chunk_numel on a GPU (csrc/engine/master_split.cpp)


def bench_split_master(C, n, args):
    dev = torch.device("cuda")
    master, g, m, v = adam_tensors(n, 2)
    p16 = master.to(torch.bfloat16)
    rem = torch.empty(n, device=dev, dtype=torch.int16)
    ties = torch.empty((n + 7) // 8, device=dev, dtype=torch.uint8)
    C.cuda_master_split(master, p16, rem, ties)
    scratch = torch.empty(min(n, SPLIT_CHUNK), device=dev)
    copy_src, copy_dst = torch.empty(n, device=dev), torch.empty(n, device=dev)
    step = [0, 0, 0]

    def fp32_master():
        step[0] += 1
        C.cuda_adam_step(master, g, m, v, None, p16, LR, BETA1, BETA2, EPS, WD, step[0], True, False, False, 1.0)

    def chunked(step_chunk):
        """As the engine: each chunk joined into fp32 scratch, step_chunk(scratch, a, b), split back."""
        for a in range(0, n, SPLIT_CHUNK):
            b = min(n, a + SPLIT_CHUNK)
            s, t = scratch[: b - a], ties[a // 8:(b + 7) // 8]
            C.cuda_master_join(p16[a:b], rem[a:b], t, s)
            step_chunk(s, a, b)
            C.cuda_master_split(s, p16[a:b], rem[a:b], t)

    def split_master():
        step[1] += 1
        chunked(lambda s, a, b: C.cuda_adam_step(s, g[a:b], m[a:b], v[a:b], None, p16[a:b], LR, BETA1, BETA2, EPS,
                                                 WD, step[1], True, False, False, 1.0))

    def fused_split():
        step[2] += 1
        C.cuda_adam_step_split(p16, rem, ties, g, m, v, None, LR, BETA1, BETA2, EPS, WD, step[2], True, False, False,
                               1.0)

    def join_split():
        chunked(lambda s, a, b: None)

    def copy():
        copy_dst.copy_(copy_src)

    times = bench_interleaved({"fp32_master": fp32_master, "split_master": split_master,
                               "fused_split": fused_split, "join_split": join_split,
                               "copy": copy}, args.reps, args.warmup, args.min_rep_ms)
    med = {k: statistics.median(t) for k, t in times.items()}
    copy_gbps = 2 * 4 * n / (med["copy"] * 1e-3) / 1e9
    js_gbps = SPLIT_BYTES_PER_PARAM * n / (med["join_split"] * 1e-3) / 1e9
    result = {
        "numel": n, "chunk": SPLIT_CHUNK, "times": {k: summary(t) for k, t in times.items()},
        "split_over_fp32_master": med["split_master"] / med["fp32_master"],
        "ideal_split_over_fp32_master": (ADAM_BYTES_PER_PARAM + SPLIT_BYTES_PER_PARAM) / ADAM_BYTES_PER_PARAM,
        "fused_over_fp32_master": med["fused_split"] / med["fp32_master"],
        "ideal_fused_over_fp32_master": FUSED_BYTES_PER_PARAM / ADAM_BYTES_PER_PARAM,
        "fused_fraction_of_copy": FUSED_BYTES_PER_PARAM * n / (med["fused_split"] * 1e-3) / 1e9 / copy_gbps,
        "join_split_GBps": js_gbps, "copy_GBps": copy_gbps, "join_split_fraction_of_copy": js_gbps / copy_gbps,
    }
    del master, g, m, v, p16, rem, ties, scratch, copy_src, copy_dst
    torch.cuda.empty_cache()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16M,64M,256M,1B", help="comma-separated param counts (K/M/B suffixes)")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per variant (>= 5)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--min-rep-ms", type=float, default=20.0, help="calls per rep are chosen to last this long")
    parser.add_argument("--small-count", type=int, default=2000)
    parser.add_argument("--small-min", type=int, default=4 * 1024)
    parser.add_argument("--small-max", type=int, default=256 * 1024)
    parser.add_argument("--skip-small", action="store_true")
    parser.add_argument("--split-size", default="256M", help="elements of the split-master comparison (0: skip)")
    parser.add_argument("--json", default=str(pathlib.Path(__file__).resolve().parent / "results" / "bench_optimizer_gpu.json"))
    args = parser.parse_args()
    if args.reps < 5:
        parser.error("--reps must be >= 5")

    if not torch.cuda.is_available():
        print("bench_optimizer_gpu: no CUDA device (torch.cuda.is_available() is False); nothing to measure.")
        return 0
    try:
        from zero_ext import _C as C
    except ImportError as exc:
        print(f"bench_optimizer_gpu: zero_ext._C is not built ({exc}); nothing to measure.")
        return 0
    if not hasattr(C, "cuda_adam_step"):
        print("bench_optimizer_gpu: zero_ext was built without CUDA (no cuda_adam_step); nothing to measure.")
        return 0

    props = torch.cuda.get_device_properties(0)
    meta = {
        "device": props.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "reps": args.reps,
        "bytes_per_param_ours": ADAM_BYTES_PER_PARAM,
        "hparams": {"lr": LR, "betas": [BETA1, BETA2], "eps": EPS, "weight_decay": WD},
    }
    print(f"device: {props.name}  torch {torch.__version__}  CUDA {torch.version.cuda}  reps {args.reps}")
    print(f"{'size':>6} {'ours ms':>9} {'torch ms':>9} {'copy ms':>9} {'ours GB/s':>10} {'copy GB/s':>10} "
          f"{'of copy':>8} {'vs torch':>9}   (median [min, max] ms in the JSON)")
    sizes = []
    for text in args.sizes.split(","):
        n = parse_size(text)
        free, _ = torch.cuda.mem_get_info()
        need = n * (4 * 4 + 2 + 4 * 3 + 2 + 4) * 1.05  # ours + torch's state + copy scratch
        if need > free:
            print(f"{fmt_size(n):>6} skipped: needs ~{need / 2 ** 30:.1f} GiB, {free / 2 ** 30:.1f} GiB free")
            sizes.append({"numel": n, "skipped": "not enough GPU memory"})
            continue
        r = bench_size(C, n, args)
        t = r["times"]
        print(f"{fmt_size(n):>6} {t['ours']['median_ms']:9.3f} {t['torch_fused+copy']['median_ms']:9.3f} "
              f"{t['copy']['median_ms']:9.3f} {r['ours_GBps']:10.0f} {r['copy_GBps']:10.0f} "
              f"{r['ours_fraction_of_copy']:8.3f} {r['speedup_vs_torch_fused_plus_copy']:8.2f}x")
        sizes.append(r)
    small = None
    if not args.skip_small:
        small = bench_small(C, args)
        t = small["times"]
        print(f"many small tensors: {small['tensors']} tensors of {small['numel_min']}..{small['numel_max']} "
              f"({small['numel_total'] / 2 ** 20:.0f}M params): ours flat {t['ours_flat']['median_ms']:.3f} ms "
              f"({small['ours_GBps']:.0f} GB/s), torch fused list + foreach copy "
              f"{t['torch_fused_list+foreach_copy']['median_ms']:.3f} ms -> {small['speedup_vs_torch']:.2f}x")
    split = None
    if parse_size(args.split_size) > 0 and hasattr(C, "cuda_master_join"):
        split = bench_split_master(C, parse_size(args.split_size), args)
        t = split["times"]
        print(f"split master, {fmt_size(split['numel'])} elements in chunks of {fmt_size(split['chunk'])}: step "
              f"{t['split_master']['median_ms']:.3f} ms vs {t['fp32_master']['median_ms']:.3f} ms on an fp32 master "
              f"({split['split_over_fp32_master']:.2f}x; bytes alone would give "
              f"{split['ideal_split_over_fp32_master']:.2f}x); join + split {t['join_split']['median_ms']:.3f} ms, "
              f"{split['join_split_GBps']:.0f} GB/s = {split['join_split_fraction_of_copy']:.2f} of copy")
        print(f"  fused (one pass, what the engine runs for Adam): {t['fused_split']['median_ms']:.3f} ms = "
              f"{split['fused_over_fp32_master']:.2f}x the fp32-master step (bytes alone: "
              f"{split['ideal_fused_over_fp32_master']:.2f}x), {split['fused_fraction_of_copy']:.2f} of copy")
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "sizes": sizes, "many_small_tensors": small, "split_master": split},
                              indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
