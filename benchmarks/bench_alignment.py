"""What 16-byte parameter starts cost (Note [Aligned pieces], csrc/core/zx_core.h): the engine's
own planner (zero_ext._C.plan_layout, Layout::make) on a model's parameter sizes, packed tight
(param_align_bytes=0) and aligned (16), padded elements per stage and world size. No process
group, no tensors: the model is built on the meta device.

    python benchmarks/bench_alignment.py                      # the 1.31B GPT of bench_step_gpu.py
    python benchmarks/bench_alignment.py --layers 12 --width 768 --vocab 50257 --bias   # GPT-2 small
"""
import argparse
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--bias", action="store_true")
    ap.add_argument("--worlds", default="2,8,64")
    args = ap.parse_args()
    from gpt import GPT, GPTConfig

    from zero_ext import _C
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                    n_head=max(1, args.width // 128), n_embd=args.width, bias=args.bias)
    with torch.device("meta"):
        model = GPT(cfg)
    named = list(model.named_parameters())          # tied weights appear once
    numel = [p.numel() for _, p in named]
    # stage 3: one unit per block, the rest in the root unit (unit 0)
    units = [int(n.split(".")[1]) + 1 if n.startswith("blocks.") else 0 for n, _ in named]
    groups = [0] * len(numel)
    psi = sum(numel)
    print(f"GPT {args.layers} layers x {args.width}, vocab {args.vocab}, bias {args.bias}: "
          f"{len(numel)} parameters, {psi / 1e6:.1f}M elements")
    print(f"{'stage':>5} {'N':>4} {'dtype':>5} {'padded tight':>13} {'padded aligned':>15} {'extra elements':>15} "
          f"{'extra shard B/rank':>19}")
    bucket = min(16 << 20, max(1 << 20, 4 * psi // 8))    # bucket_bytes "auto"
    for stage in (1, 2, 3):
        for world in (int(w) for w in args.worlds.split(",")):
            for dtype, size in ((0, 4), (1, 2)):
                def padded(align_bytes):
                    rows = _C.plan_layout(numel, groups, units if stage == 3 else [], stage, world, bucket, 1 << 20,
                                          16 if world <= 64 else 1, dtype, param_align_bytes=align_bytes)
                    return sum(r[3] for r in rows)
                tight, aligned = padded(0), padded(16)
                extra = aligned - tight
                print(f"{stage:>5} {world:>4} {('fp32', 'bf16')[dtype]:>5} {tight:>13} {aligned:>15} {extra:>15} "
                      f"{extra * size / world:>19.0f}")


if __name__ == "__main__":
    main()
