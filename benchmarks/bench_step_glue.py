"""What the public opt.step() costs beyond its kernel: stage 1, world size 1, in process.

    python benchmarks/bench_step_glue.py                # 2^19 parameters (in cache), 1 and 2 threads
    python benchmarks/bench_step_glue.py --numel 4194304 --params 64 --reps 9

One model of --params equal nn.Linear-free parameters (plain nn.Parameter tensors summing to
--numel elements), AdamW (lr 1e-3, wd 0.01), zeroify(stage=1), one backward so that every
gradient exists; then, per thread count, interleaved within each repetition:
  kernel       zero_ext._C.adam_step over one flat fp32 array of the same size (the C kernel
               the engine calls, on the same intra-op threads): the floor
  public       opt.step() of the zeroified optimizer (fp32 parameters: the kernel over the
               same shard, plus everything the Python and C++ glue do around it)
  public bf16  the same with param_dtype="bf16" (the kernel also writes the bf16 copy;
               the master kept as a remainder, Note [Split master in the engine])
  bf16 fp32 master  the same with master_remainder=False (a separate fp32 master shard)
  sgd bf16, adamw bf16 states  SGD with momentum, AdamW with state_dtype="bf16", bf16 parameters
               with the split master, each also with master_remainder=False ("... fp32 master")
  torch fused  torch.optim.AdamW(fused=True) over the same parameters (a peer on the same path)
Each timing covers enough steps for >= 20 ms; the median (min/max) over --reps repetitions
is reported, and the ratios public / kernel and 2-thread / 1-thread are taken within a
repetition. Targets (issue: the public step costs what its kernels cost): public <= 1.1x
kernel; public 2-thread / 1-thread <= 0.6.
Writes benchmarks/results/bench_step_glue.json.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import zero_ext  # noqa: E402
from machine import cpu_model, spread  # noqa: E402
from zero_ext import _C  # noqa: E402


class Params(torch.nn.Module):
    def __init__(self, numel: int, count: int):
        super().__init__()
        sizes = [numel // count + (1 if i < numel % count else 0) for i in range(count)]
        g = torch.Generator().manual_seed(0)
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n, generator=g) * 0.02) for n in sizes)

    def forward(self):
        return sum((p * p).sum() for p in self.ps)


def per_step(fn, min_s=0.02):
    """Seconds per call of fn, over enough calls for >= min_s."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_s and calls >= 3:
            return elapsed / calls


def contenders(numel: int, count: int):
    out = {}
    flat = [torch.randn(numel) * 0.02, torch.randn(numel) * 1e-3, torch.zeros(numel), torch.zeros(numel)]
    steps = iter(range(1, 1 << 40))
    isa = _C.best_isa()
    out["kernel"] = lambda: _C.adam_step(isa, flat[0], flat[1], flat[2], flat[3], None, None, 1e-3, 0.9, 0.999,
                                         1e-8, 0.01, next(steps), True, False, False, 1.0)
    for name, pdt, remainder in (("public", "fp32", True), ("public bf16", "bf16", True),
                                 ("bf16 fp32 master", "bf16", False)):
        model = Params(numel, count)
        zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01),
                                  stage=1, param_dtype=pdt, master_remainder=remainder)
        zm().backward()
        out[name] = zo.step
    # the other fused steps over the split master (Note [Fused split-master step]): SGD with
    # momentum, AdamW with bf16 states; each against the same step with an fp32 master
    for name, make, kw in (("sgd bf16", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9), {}),
                           ("adamw bf16 states", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
                            dict(state_dtype="bf16"))):
        for suffix, remainder in (("", True), (" fp32 master", False)):
            model = Params(numel, count)
            zm, zo = zero_ext.zeroify(model, make(model.parameters()), stage=1, param_dtype="bf16",
                                      master_remainder=remainder, **kw)
            zm().backward()
            out[name + suffix] = zo.step
    model = Params(numel, count)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    model().backward()
    out["torch fused"] = opt.step
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 19)
    ap.add_argument("--params", type=int, default=8, help="how many parameter tensors hold them")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_step_glue.json"))
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    sides = contenders(args.numel, args.params)
    names = list(sides)
    times = {t: {n: [] for n in names} for t in threads}
    for rep in range(args.reps):
        for t in threads:
            torch.set_num_threads(t)
            for k in range(len(names)):   # the first side rotates
                name = names[(rep + k) % len(names)]
                times[t][name].append(per_step(sides[name]))
    rows, result = [], {"benchmark": "bench_step_glue", "cpu": cpu_model(), "torch": torch.__version__,
                        "isa": _C.best_isa(), "numel": args.numel, "params": args.params, "reps": args.reps,
                        "threads": {}}
    for t in threads:
        r = {n: spread([x * 1e6 for x in times[t][n]]) for n in names}
        ratio = {n: spread([a / b for a, b in zip(times[t][n], times[t]["kernel"])]) for n in names if n != "kernel"}
        result["threads"][t] = {"us": r, "over_kernel": ratio}
        for n in names:
            extra = f"{ratio[n]['median']:.2f}x" if n in ratio else "1.00x"
            rows.append(f"{t:>7} {n:<29} {r[n]['median']:>9.1f} ({r[n]['min']:.1f}/{r[n]['max']:.1f}) {extra:>9}")
    if len(threads) > 1:
        a, b = threads[0], threads[-1]
        result["scaling"] = {n: spread([y / x for x, y in zip(times[a][n], times[b][n])]) for n in names}
    print(f"{args.numel} parameters in {args.params} tensors, AdamW, stage 1, world 1, {cpu_model()}, "
          f"ISA {_C.best_isa()}, {args.reps} repetitions")
    print(f"{'threads':>7} {'side':<29} {'us/step':>9} {'(min/max)':<14} {'/kernel':>6}")
    print("\n".join(rows))
    if "scaling" in result:
        print(f"{threads[-1]}-thread / {threads[0]}-thread time: " +
              ", ".join(f"{n} {v['median']:.2f}" for n, v in result["scaling"].items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
