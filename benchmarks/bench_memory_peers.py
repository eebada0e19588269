"""Model-state bytes per parameter by category, per rank: zero_ext beside FSDP2 and DeepSpeed
stage 3, on the same GPT (examples/gpt.py), real gloo ranks on the CPU; and, with a GPU, the
GPU peak of zero_ext stage 3 bf16 beside FSDP2 bf16.

    python benchmarks/bench_memory_peers.py                    # N = 2 and 4, every system below
    python benchmarks/bench_memory_peers.py --worlds 2 --systems zero_ext,fsdp2
    python benchmarks/bench_memory_peers.py --gpu-only         # only the GPU peak (skips without CUDA)

Systems (each family runs in its own N spawned processes, gloo over a file store, one
forward/backward/AdamW step on a batch of random tokens, then counted; same model, seed,
batch and torch.optim.AdamW hyperparameters for all):

  zero_ext  stage 3 fp32; bf16 params + fp32 reduce; bf16 + bf16 reduce (unit_modules=["Block"]);
            stages 1 and 2 with bf16 params, fp32 and bf16 reduce.
            Counted: opt.stats()["model_state_bytes"]. Predicted: zero_ext.estimate_memory(model,
            world_size=N, optimizer=opt, backend="gloo", same options) before zeroify; the two
            are compared category by category, byte for byte, on every rank.
  fsdp2     torch.distributed.fsdp.fully_shard on each Block, then the root, CPU mesh over all
            ranks (SUM reduction, divided by N, as examples/train_gpt.py), MixedPrecisionPolicy
            fp32 (no policy); param bf16 + reduce fp32; param bf16 + reduce bf16.
            Counted after the step and model.reshard(): the local shards (DTensor.to_local()) of
            the parameters (fp32: the parameter; bf16 policy: the fp32 master, its bf16 copies are
            transient), of their .grad, and of the AdamW state tensors. to_local() is the unpadded
            chunk: FSDP2's own padding of each parameter to a multiple of N rows is left out.
  deepspeed stage 3 (DS_ACCELERATOR=cpu) with the same AdamW as client optimizer: fp32; bf16
            (its default gradient accumulation dtype = bf16); bf16 + "grad_accum_dtype": "fp32".
            stage3_param_persistence_threshold 0 (DeepSpeed's default 1e5 would keep whole
            copies of every tensor under 100k elements on every rank: most of this small model,
            a negligible part of a large one) and reduce/prefetch buckets of 1M elements.
            Counted from its ZeRO-3 optimizer's objects, each storage once:
            fp16_partitioned_groups_flat (the low-precision partition; with fp32 it is the
            parameter and the fp32 partition shares it), fp32_partitioned_groups_flat (the
            master), grad_partitions_flat_buffer (the gradient partition), optimizer.state
            (Adam's moments), + whole copies of persisted parameters (ds_persist) if any.
            Runs only where `import deepspeed` works (`make bench` installs it).

B/param = per-rank bytes x N / Ψ (Ψ trainable parameters, tied weights once): a fully
sharded state reads as its bytes per element (stage 3 bf16: 4 master + 4 grad + 8 Adam =
16), a replicated one (stage 1-2 parameters, stage 1 gradients) as N times its element
size. Each row is the rank with the largest total (every rank is in the JSON).

GPU (when torch.cuda.is_available() and zero_ext has CUDA kernels): zero_ext stage 3 bf16
(fp32 reduce) and FSDP2 bf16 (MixedPrecisionPolicy bf16/fp32) on one GPU (world size 1, nccl;
--gpu-world N spawns N ranks on N GPUs), a larger GPT, --gpu-steps steps each, interleaved
over --gpu-reps repetitions; torch.cuda.max_memory_allocated() of the steps and
memory_allocated() between steps, both above what was allocated before the model was built.
Goal: zero_ext's peak below FSDP2's.

Writes benchmarks/results/bench_memory_peers.json (machine, torch, git HEAD, every rank's bytes).
"""

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "examples"))

from machine import cpu_model  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "bench_memory_peers.json"
CATS = ("parameters", "gradients", "master_weights", "optimizer_states")
MiB = 2 ** 20

# (label, zeroify options)
ZERO_CONFIGS = [
    ("stage 3 fp32", dict(stage=3, param_dtype="fp32", reduce_dtype="fp32")),
    ("stage 3 bf16, reduce fp32", dict(stage=3, param_dtype="bf16", reduce_dtype="fp32")),
    ("stage 3 bf16, reduce bf16", dict(stage=3, param_dtype="bf16", reduce_dtype="bf16")),
    ("stage 1 bf16, reduce fp32", dict(stage=1, param_dtype="bf16", reduce_dtype="fp32")),
    ("stage 1 bf16, reduce bf16", dict(stage=1, param_dtype="bf16", reduce_dtype="bf16")),
    ("stage 2 bf16, reduce fp32", dict(stage=2, param_dtype="bf16", reduce_dtype="fp32")),
    ("stage 2 bf16, reduce bf16", dict(stage=2, param_dtype="bf16", reduce_dtype="bf16")),
]
# (label, param dtype, reduce dtype) of MixedPrecisionPolicy; None: no policy (fp32)
FSDP_CONFIGS = [
    ("fp32", None, None),
    ("bf16, reduce fp32", "bf16", "fp32"),
    ("bf16, reduce bf16", "bf16", "bf16"),
]
# (label, bf16 enabled, grad_accum_dtype or None for DeepSpeed's default)
DS_CONFIGS = [
    ("stage 3 fp32", False, None),
    ("stage 3 bf16 (grad accum bf16)", True, None),
    ("stage 3 bf16, grad accum fp32", True, "fp32"),
]
FAMILIES = ("zero_ext", "fsdp2", "deepspeed")


# ----------------------------------------------------------------------------- helpers (in the ranks)

def _gpt(args, device="cpu"):
    import torch
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                    n_head=max(1, args.width // 64), n_embd=args.width)
    with torch.device(device):
        return GPT(cfg)


def _batch(args, rank, device="cpu"):
    import torch
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return x.to(device), y.to(device)


def _adamw(params):
    import torch
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _unique_storage_bytes(tensors):
    """Bytes of the distinct storages behind `tensors` (views of one buffer counted once, whole)."""
    import torch
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if s.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


def _local_bytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _state_tensors(state):
    import torch
    return [t for s in state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]


def _with_total(d):
    d = {k: int(d[k]) for k in CATS}
    d["total"] = sum(d.values())
    return d


def _num_trainable(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------- one system per config

def run_zero_ext(label, options, args, rank, world):
    import torch
    import zero_ext

    model = _gpt(args)
    psi = _num_trainable(model)
    opt = _adamw(model.parameters())
    opts = dict(options)
    if opts["stage"] == 3:
        opts["unit_modules"] = ["Block"]
    est = zero_ext.estimate_memory(model, world, opts.pop("stage"), optimizer=opt, backend="gloo", **opts)
    zm, zo = zero_ext.zeroify(model, opt, stage=options["stage"], **opts)
    x, y = _batch(args, rank)
    _, loss = zm(x, y)
    loss.backward()
    zo.step()
    s = zo.stats()
    measured = _with_total(s["model_state_bytes"])
    estimated = _with_total(est["model_state_bytes"])
    diff = {k: measured[k] - estimated[k] for k in (*CATS, "total") if measured[k] != estimated[k]}
    zo.zero_grad()
    del zm, zo
    return {"family": "zero_ext", "config": label, "options": options, "num_params": psi,
            "stats_num_params": s["num_params"], "padded_numel": s["padded_numel"],
            "shard_numel": s["shard_numel"], "bytes": measured, "estimate": estimated,
            "stats_minus_estimate": diff, "agree": not diff,
            # buffers (not model state, not in the table): the gradient ring and the stage-3 peak of
            # gathered units; stats' "total" counts the units gathered now, the estimate's the peak
            "buffer_bytes": {k: {"stats": s["buffer_bytes"].get(k), "estimate": est["buffer_bytes"].get(k)}
                             for k in ("grad_ring", "peak_gathered_params")},
            "isa": s.get("isa"), "fused": s.get("fused"), "loss": loss.item()}


def run_fsdp2(label, pdt, rdt, args, rank, world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtypes = {None: None, "bf16": torch.bfloat16, "fp32": torch.float32}
    model = _gpt(args)
    psi = _num_trainable(model)
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=dtypes[pdt], reduce_dtype=dtypes[rdt])
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for m in model.modules():      # gloo has lacked AVG: SUM, divided by N (examples/train_gpt.py)
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(float(world))
    opt = _adamw(model.parameters())
    x, y = _batch(args, rank)
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    model.reshard()
    params = list(model.parameters())
    shard = sum(_local_bytes(p) for p in params)
    grads = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    states = sum(_local_bytes(t) for t in _state_tensors(opt.state))
    low = pdt is not None and pdt != "fp32"
    # With a low param_dtype the fp32 sharded parameter is the master (as zero_ext stage 3 counts it).
    b = _with_total({"parameters": 0 if low else shard, "gradients": grads,
                     "master_weights": shard if low else 0, "optimizer_states": states})
    grad_dtypes = sorted({str((p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).dtype)
                          for p in params if p.grad is not None})
    return {"family": "fsdp2", "config": label, "options": {"param_dtype": pdt, "reduce_dtype": rdt},
            "num_params": psi, "bytes": b, "grad_dtypes": grad_dtypes, "loss": loss.item()}


def run_deepspeed(label, bf16, grad_accum, args, rank, world):
    import torch
    import deepspeed

    model = _gpt(args)
    psi = _num_trainable(model)
    opt = _adamw(model.parameters())
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "reduce_bucket_size": 1_000_000, "stage3_prefetch_bucket_size": 1_000_000},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 9,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    if grad_accum:
        config["data_types"] = {"grad_accum_dtype": grad_accum}
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    x, y = _batch(args, rank)
    _, loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    lp = list(getattr(ds_opt, "fp16_partitioned_groups_flat", []) or [])
    fp32 = list(getattr(ds_opt, "fp32_partitioned_groups_flat", []) or [])
    lp_b = _unique_storage_bytes(lp)
    both_b = _unique_storage_bytes(lp + fp32)          # fp32 training: the fp32 partition is the lp one
    master_b = both_b - lp_b
    persisted = [p for p in engine.module.parameters() if getattr(p, "ds_persist", False)]
    persist_b = sum(p.data.numel() * p.data.element_size() for p in persisted)
    grad_tensors = [getattr(ds_opt, "grad_partitions_flat_buffer", None)]
    grad_tensors += [p.grad for p in engine.module.parameters()]
    grad_tensors += [t.grad for t in fp32]
    grads_b = _unique_storage_bytes(grad_tensors)
    states_b = _unique_storage_bytes(_state_tensors(ds_opt.optimizer.state))
    ipg = getattr(ds_opt, "ipg_buckets", {}) or {}
    ipg_b = _unique_storage_bytes([getattr(bk, "buffer", None) for bk in ipg.values()])
    b = _with_total({"parameters": lp_b + persist_b, "gradients": grads_b,
                     "master_weights": master_b, "optimizer_states": states_b})
    return {"family": "deepspeed", "config": label,
            "options": {"bf16": bf16, "grad_accum_dtype": grad_accum or "default"},
            "num_params": psi, "bytes": b, "persisted_param_bytes": persist_b, "ipg_bucket_bytes": ipg_b,
            "lp_dtype": str(lp[0].dtype) if lp else None,
            "grad_dtype": str(grad_tensors[0].dtype) if grad_tensors[0] is not None else None,
            "deepspeed_version": deepspeed.__version__, "loss": loss.item()}


def rank_main(rank, world, store, out_dir, family, args):
    """One rank of one family: every config of it in turn; results to out_dir/rank<r>.json."""
    import ctypes

    import torch
    import torch.distributed as dist

    try:   # freed memory leaves at once (as bench_memory.py)
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)
    except OSError:
        pass
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)   # DeepSpeed's deprecated collectives
    if family == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("LOCAL_RANK", str(rank))
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    if family == "zero_ext":
        jobs = [(label, lambda l=label, o=o: run_zero_ext(l, o, args, rank, world)) for label, o in ZERO_CONFIGS]
    elif family == "fsdp2":
        jobs = [(label, lambda l=label, p=p, r=r: run_fsdp2(l, p, r, args, rank, world)) for label, p, r in FSDP_CONFIGS]
    else:
        jobs = [(label, lambda l=label, b=b, g=g: run_deepspeed(l, b, g, args, rank, world))
                for label, b, g in DS_CONFIGS]
    results = []
    for label, job in jobs:
        t0 = time.perf_counter()
        try:
            r = job()
        except Exception as e:  # every rank raises alike here (same model, same options)
            r = {"family": family, "config": label, "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc()[-3000:]}
        r.update(rank=rank, world_size=world, seconds=time.perf_counter() - t0)
        results.append(r)
        dist.barrier()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:   # partial results survive a hang
            json.dump(results, f)
    dist.destroy_process_group()


def spawn_family(family, world, args):
    """Run `family` on `world` spawned gloo ranks with a timeout; [per-rank result lists], error."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(rank_main, args=(world, os.path.join(tmp, "store"), tmp, family, args),
                                 nprocs=world, start_method="spawn", join=False)
        deadline = time.monotonic() + args.timeout
        error = None
        try:
            while not ctx.join(timeout=2):
                if time.monotonic() > deadline:
                    error = f"timed out after {args.timeout:.0f} s"
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    break
        except Exception as e:  # a rank died
            error = f"{type(e).__name__}: {str(e)[-1500:]}"
        ranks = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.json")
            ranks.append(json.load(open(path)) if os.path.exists(path) else [])
    return ranks, error


# ----------------------------------------------------------------------------- GPU peak

def gpu_rank(rank, world, store, out_dir, args):
    """One rank of the GPU peak measurement (args.gpu_dry_run: the same code on the CPU over
    gloo, tiny sizes, memory read as 0: a check that the script runs, not a measurement)."""
    import torch
    import torch.distributed as dist

    dry = args.gpu_dry_run
    dev = "cpu" if dry else "cuda"
    cuda = torch.cuda
    if dry:
        cuda = argparse.Namespace(synchronize=lambda: None, empty_cache=lambda: None, memory_allocated=lambda: 0,
                                  reset_peak_memory_stats=lambda: None, max_memory_allocated=lambda: 0,
                                  get_device_name=lambda r: "cpu (dry run)")
    else:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if dry else "nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    import zero_ext
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    gargs = argparse.Namespace(vocab=50304, seq=args.gpu_seq, layers=args.gpu_layers, width=args.gpu_width,
                               batch=args.gpu_batch)
    x, y = _batch(gargs, rank, dev)

    def build(name):
        model = _gpt(gargs, dev)
        if name == "fsdp2 bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            opt = _adamw(model.parameters())

            def step():
                model(x, y)[1].backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return step, lambda: None
        opt = _adamw(model.parameters())
        zm, zo = zero_ext.zeroify(model, opt, stage=3, param_dtype="bf16", reduce_dtype="fp32",
                                  unit_modules=["Block"])

        def step():
            zm(x, y)[1].backward()
            zo.step()
            zo.zero_grad()
        return step, lambda: zo.stats()["model_state_bytes"]

    names = ["zero_ext stage 3 bf16", "fsdp2 bf16"]
    rows = {n: [] for n in names}
    for rep in range(args.gpu_reps):
        for k in range(len(names)):
            name = names[(rep + k) % len(names)]
            cuda.synchronize()
            cuda.empty_cache()
            base = cuda.memory_allocated()
            cuda.reset_peak_memory_stats()
            row = {"rep": rep}
            try:
                step, msb = build(name)
                for _ in range(args.gpu_steps):
                    step()
                cuda.synchronize()
                row.update(peak_bytes=cuda.max_memory_allocated() - base,
                           resident_bytes=cuda.memory_allocated() - base, model_state_bytes=msb())
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            step = msb = None
            rows[name].append(row)
            dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "rows": rows, "device": cuda.get_device_name(rank),
                   "num_params": _num_trainable(_gpt(gargs, "meta"))}, f)
    dist.destroy_process_group()


def gpu_peak(args):
    import torch
    if args.gpu_dry_run:
        world = args.gpu_world
    else:
        if not torch.cuda.is_available():
            return {"skipped": "no CUDA device (torch.cuda.is_available() is False)"}
        world = min(args.gpu_world, torch.cuda.device_count())
        probe = subprocess.run([sys.executable, "-c", "from zero_ext import _C; print(hasattr(_C, 'cuda_adam_step'))"],
                               capture_output=True, text=True)
        if probe.stdout.strip() != "True":
            return {"skipped": "zero_ext was built without CUDA (no _C.cuda_adam_step)"}
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(gpu_rank, args=(world, os.path.join(tmp, "store"), tmp, args), nprocs=world,
                               start_method="spawn")
        except Exception as e:
            return {"skipped": f"failed: {type(e).__name__}: {str(e)[-1500:]}"}
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]
    r0 = ranks[0]
    summary = {}
    for name, rows in r0["rows"].items():
        ok = [r for r in rows if "error" not in r]
        summary[name] = {"peak_bytes_max": max((r["peak_bytes"] for r in ok), default=None),
                         "resident_bytes_max": max((r["resident_bytes"] for r in ok), default=None),
                         "errors": [r["error"] for r in rows if "error" in r]}
    z, f = summary["zero_ext stage 3 bf16"]["peak_bytes_max"], summary["fsdp2 bf16"]["peak_bytes_max"]
    return {"device": r0["device"], "world_size": world, "num_params": r0["num_params"],
            "model": {"layers": args.gpu_layers, "width": args.gpu_width, "seq": args.gpu_seq,
                      "batch": args.gpu_batch, "vocab": 50304},
            "steps": args.gpu_steps, "reps": args.gpu_reps, "summary": summary,
            "peak_ratio_zero_ext_over_fsdp2": (z / f) if z and f else None, "ranks": ranks}


# ----------------------------------------------------------------------------- driver

def _fmt_row(name, n, r, psi):
    if "error" in r:
        return f"{name:<44} {n:>2}  FAILED: {r['error'].splitlines()[0][:90]}"
    b = r["bytes"]
    per = lambda v: v * n / psi  # noqa: E731
    est = ""
    if "agree" in r:
        est = "yes" if r["agree_all_ranks"] else "NO: " + ", ".join(f"{k} {v:+d} B" for k, v in r["stats_minus_estimate"].items())
    return (f"{name:<44} {n:>2} {per(b['parameters']):>7.3f} {per(b['gradients']):>7.3f} "
            f"{per(b['master_weights']):>7.3f} {per(b['optimizer_states']):>7.3f} {per(b['total']):>8.3f} "
            f"{b['total'] / MiB:>9.3f}  {est}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--systems", default=",".join(FAMILIES), help="zero_ext,fsdp2,deepspeed (default all)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256, help="n_embd (heads of 64)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=65)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per (family, N) launch")
    ap.add_argument("--gpu-only", action="store_true", help="only the GPU peak measurement")
    ap.add_argument("--no-gpu", action="store_true", help="skip the GPU peak measurement")
    ap.add_argument("--gpu-world", type=int, default=1, help="ranks (one GPU each; default 1)")
    ap.add_argument("--gpu-layers", type=int, default=12)
    ap.add_argument("--gpu-width", type=int, default=1024)
    ap.add_argument("--gpu-seq", type=int, default=1024)
    ap.add_argument("--gpu-batch", type=int, default=4)
    ap.add_argument("--gpu-steps", type=int, default=3)
    ap.add_argument("--gpu-reps", type=int, default=2)
    ap.add_argument("--gpu-dry-run", action="store_true", help=argparse.SUPPRESS)   # the GPU code on the CPU
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    families = [f for f in args.systems.split(",") if f.strip()]
    for f in families:
        if f not in FAMILIES:
            ap.error(f"unknown system {f!r}; choose from {', '.join(FAMILIES)}")

    import torch
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip())
    report = {"benchmark": "bench_memory_peers", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "git_head": head, "git_dirty": dirty, "torch_version": torch.__version__, "cpu": cpu_model(),
              "model": {"kind": "examples/gpt.py GPT (tied lm head)", "layers": args.layers, "width": args.width,
                        "seq": args.seq, "batch": args.batch, "vocab": args.vocab},
              "optimizer": "torch.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1), one step",
              "bytes_per_param": "per-rank bytes x N / num_params", "worlds": worlds, "points": []}
    ds_available = importlib.util.find_spec("deepspeed") is not None
    if not args.gpu_only:
        psi = _num_trainable(_gpt(args, "meta"))
        report["model"]["num_params"] = psi
        print(f"bench_memory_peers: torch {torch.__version__}, {cpu_model()}, gloo ranks on the CPU, "
              f"GPT {args.layers} x {args.width} (Ψ = {psi:,} trainable parameters), AdamW, one step; "
              f"git {head[:12]}{' (+ uncommitted changes)' if dirty else ''}", flush=True)
        t_all = time.perf_counter()
        for n in worlds:
            for fam in families:
                if fam == "deepspeed" and not ds_available:
                    print(f"  deepspeed, N = {n}: not installed (`make bench` installs it)", flush=True)
                    report["points"].append({"family": "deepspeed", "world_size": n, "error": "not installed"})
                    continue
                t0 = time.perf_counter()
                ranks, error = spawn_family(fam, n, args)
                print(f"  {fam}, N = {n}: {time.perf_counter() - t0:.1f} s{' (' + error + ')' if error else ''}",
                      flush=True)
                configs = list(dict.fromkeys(r["config"] for rk in ranks for r in rk))
                for label in configs:
                    per_rank = [next((r for r in rk if r["config"] == label), None) for rk in ranks]
                    got = [r for r in per_rank if r is not None]
                    errs = [r for r in got if "error" in r]
                    if errs or len(got) < n:
                        point = dict(errs[0] if errs else got[0])
                        point.setdefault("error", error or f"only {len(got)} of {n} ranks reported")
                    else:
                        point = dict(max(got, key=lambda r: r["bytes"]["total"]))
                        if "agree" in point:
                            point["agree_all_ranks"] = all(r["agree"] for r in got)
                    point.update(world_size=n, shown_rank=point.get("rank"),
                                 ranks=[{k: r.get(k) for k in ("rank", "bytes", "estimate", "stats_minus_estimate",
                                                               "agree", "error")} for r in got])
                    point.pop("rank", None)
                    report["points"].append(point)
                if error and not configs:
                    report["points"].append({"family": fam, "world_size": n, "error": error})
        report["seconds"] = time.perf_counter() - t_all

        hdr = (f"{'system / config':<44} {'N':>2} {'param':>7} {'grad':>7} {'master':>7} {'optim':>7} "
               f"{'total':>8} {'rank MiB':>9}  stats == estimate_memory")
        print(f"\nBytes per trainable parameter (per-rank bytes x N / Ψ), by category, after one step; "
              f"the rank with the largest total")
        print(hdr)
        print("-" * len(hdr))
        for fam in families:
            for n in worlds:
                for p in report["points"]:
                    if p["family"] != fam or p["world_size"] != n:
                        continue
                    if "config" not in p:
                        print(f"{fam:<44} {n:>2}  {p['error']}")
                        continue
                    print(_fmt_row(f"{fam} {p['config']}", n, p, psi))
        bad = [p for p in report["points"] if p["family"] == "zero_ext" and "bytes" in p
               and p.get("options", {}).get("stage") == 3 and p["options"].get("param_dtype") == "bf16"
               and p["bytes"]["total"] * p["world_size"] / psi > 16]
        for p in bad:
            print(f"NOTE: zero_ext {p['config']} at N = {p['world_size']}: "
                  f"{p['bytes']['total'] * p['world_size'] / psi:.3f} B/param > 16")
    if not args.no_gpu:
        g = gpu_peak(args)
        report["gpu"] = g
        if "skipped" in g:
            print(f"\nGPU peak: skipped: {g['skipped']}")
        else:
            print(f"\nGPU peak, {g['device']}, world size {g['world_size']}, GPT {args.gpu_layers} x {args.gpu_width} "
                  f"({g['num_params'] / 1e6:.1f}M params), batch {args.gpu_batch} x {args.gpu_seq}, "
                  f"{args.gpu_steps} steps x {args.gpu_reps} reps (max over reps)")
            for name, s in g["summary"].items():
                if s["peak_bytes_max"] is None:
                    print(f"  {name:<24} did not run: {s['errors'][:1]}")
                    continue
                print(f"  {name:<24} peak {s['peak_bytes_max'] / 2 ** 30:8.3f} GiB   between steps "
                      f"{s['resident_bytes_max'] / 2 ** 30:8.3f} GiB")
            if g["peak_ratio_zero_ext_over_fsdp2"] is not None:
                print(f"  zero_ext / fsdp2 peak: {g['peak_ratio_zero_ext_over_fsdp2']:.3f} (goal < 1)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
