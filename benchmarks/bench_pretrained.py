"""Loading a pretrained model into stage 3 and saving it back, per rank: peak resident memory
and time, zero_ext beside every rank's from_pretrained and FSDP2 with torch's Hugging Face
checkpoint reader and writer.

    python benchmarks/bench_pretrained.py                  # a ~0.5B Llama-shaped model, 4 gloo ranks
    python benchmarks/bench_pretrained.py --hidden 256 --layers 2 --vocab 4096 --world 2   # a quick look

The benchmark first writes the checkpoint itself (a process of its own): a Llama-shaped
model with random weights (seed 0), saved by transformers' save_pretrained in bf16 (one
file, as a published model of this size ships). It then reads the file once (so every
system reads it from the page cache), and runs each system in a world of --world spawned
gloo ranks of one thread each, --reps times:

  from_pretrained  load: every rank from_pretrained(dir, dtype=float32), then zeroify stage 3;
                   save: rank 0 gathers the whole model (zero_ext.consolidated_state_dict(to=0),
                   rank by rank) and writes it with safetensors' save_file.
  zero_ext         load: the model built on the meta device (from_config) and
                   zeroify(stage=3, weights=dir), each rank reading its own fragments;
                   save: zero_ext.save_pretrained (streamed to rank 0, bucket by bucket).
  fsdp2            load: the model built on the meta device, fully_shard on each decoder
                   layer and the root (a CPU mesh), to_empty, then
                   torch.distributed.checkpoint.load(model.state_dict(), HuggingFaceStorageReader);
                   save: torch.distributed.checkpoint.save(model.state_dict(),
                   HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True))
                   (every rank writes its shards, then one consolidated HF file).

Per rank and phase: the peak resident set (VmHWM of /proc/self/status, reset through
/proc/self/clear_refs before the phase), the resident set before and after, and the
phase's time (a barrier before, each rank's own end; the phase's time is the slowest
rank's). The sync that makes a save durable is in it: save_pretrained fsyncs its files
before its rename, the gather-on-rank-0 save fsyncs its file (its fsync time is also
recorded alone, save.fsync_seconds), torch's writer syncs as DCP does; between systems the
benchmark runs os.sync() untimed, so that none pays for another's dirty pages.
zero_ext's goals: its load peak at most its resident memory after the load + the largest
tensor in fp32 + 64 MiB, its load time no worse than from_pretrained's; its save peak
likewise and its save time at most 1.5x the gather-on-rank-0 save.

Writes benchmarks/results/bench_pretrained.json (machine, torch, git HEAD, every rank's figures).
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from machine import cpu_model  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "bench_pretrained.json"
MiB = 2 ** 20
SYSTEMS = ("from_pretrained", "zero_ext", "fsdp2")


def _config(args):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.heads, max_position_embeddings=2048, tie_word_embeddings=False)


def _status(key: str) -> int:
    """A /proc/self/status field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                 # VmHWM := VmRSS


def _write_checkpoint(rank, args, path):
    """A process of its own: random weights, saved by transformers in bf16."""
    import torch
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(args)).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="50GB")
    largest = max(p.numel() for p in model.parameters())
    numel = sum(p.numel() for p in model.parameters())
    with open(os.path.join(path, "bench.json"), "w") as f:
        json.dump({"numel": numel, "largest_numel": largest}, f)


def _phase(fn):
    """(what fn returns, seconds, peak, resident before, resident after) of one phase on this rank."""
    import torch.distributed as dist
    dist.barrier()
    _reset_peak()
    before = _status("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return out, {"seconds": seconds, "peak_bytes": _status("VmHWM"), "rss_before_bytes": before,
                 "rss_after_bytes": _status("VmRSS")}


def _rank(rank, world, store, out_dir, args, system, src, dst):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import transformers  # noqa: F401 - imported before the phases: its import is not the load's memory
    import zero_ext
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
    config = AutoConfig.from_pretrained(src)
    result = {}
    if system == "from_pretrained":
        def load():
            model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
            return zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), stage=3)
        (zm, zo), result["load"] = _phase(load)

        def save():
            full = zero_ext.consolidated_state_dict(zm, zo, to=0)
            if rank == 0:
                from safetensors.torch import save_file
                os.makedirs(dst, exist_ok=True)
                file = os.path.join(dst, "model.safetensors")
                save_file({k: v.contiguous() for k, v in full["model"].items()}, file, metadata={"format": "pt"})
                t0 = time.perf_counter()     # on disk, as save_pretrained's files are before its rename
                fd = os.open(file, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
                return time.perf_counter() - t0
            del full
            return 0.0
        fsync, result["save"] = _phase(save)
        result["save"]["fsync_seconds"] = fsync
        result["shard_bytes"] = zo.stats()["model_state_bytes"]["total"]
    elif system == "zero_ext":
        def load():
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            return zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), stage=3, weights=src)
        (zm, zo), result["load"] = _phase(load)
        _, result["save"] = _phase(lambda: zero_ext.save_pretrained(zm, dst))
        result["shard_bytes"] = zo.stats()["model_state_bytes"]["total"]
        result["bytes_read"] = zm.weights_report.bytes_read
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        def load():
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            model.to_empty(device="cpu")
            dcp.load(model.state_dict(), storage_reader=dcp.HuggingFaceStorageReader(src))
            model._init_weights(model.model.rotary_emb)      # the RoPE buffers to_empty left empty
            return model
        model, result["load"] = _phase(load)
        _, result["save"] = _phase(lambda: dcp.save(model.state_dict(), storage_writer=dcp.HuggingFaceStorageWriter(
            dst, save_distributed=True, enable_consolidation=True)))
        result["shard_bytes"] = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _world(args, system, src, dst) -> list:
    import torch
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(args.world, os.path.join(tmp, "store"), tmp, args, system, src, dst),
                           nprocs=args.world, start_method="spawn")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(args.world)]


def _check_saved(dst: str, src: str) -> bool:
    """The saved files hold the checkpoint's values (fp32 of the bf16 ones), tensor by tensor."""
    import torch
    from safetensors import safe_open
    files = [os.path.join(dst, f) for f in os.listdir(dst) if f.endswith(".safetensors")]
    saved = {}
    for f in files:
        with safe_open(f, "pt") as h:
            saved.update({k: f for k in h.keys()})
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as h:
        for k in h.keys():
            if k not in saved:
                return False
            with safe_open(saved[k], "pt") as g:
                if not torch.equal(g.get_tensor(k).float(), h.get_tensor(k).float()):
                    return False
    return True


def _git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> dict:
    import torch
    import torch.multiprocessing as mp
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1280)
    p.add_argument("--intermediate", type=int, default=3456)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--workdir", default=None, help="where the checkpoint and the saves go (default: a temp dir)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_pretrained-"))
    src = str(work / "src")
    if not os.path.exists(os.path.join(src, "bench.json")):
        mp.start_processes(_write_checkpoint, args=(args, src), nprocs=1, start_method="spawn")
    meta = json.load(open(os.path.join(src, "bench.json")))
    with open(os.path.join(src, "model.safetensors"), "rb") as f:      # into the page cache, for every system
        while f.read(64 * MiB):
            pass
    print(f"Llama-shaped model: {meta['numel'] / 1e9:.3f}B parameters, checkpoint "
          f"{os.path.getsize(os.path.join(src, 'model.safetensors')) / 2**30:.2f} GiB bf16, {args.world} gloo ranks",
          flush=True)
    systems = args.systems.split(",")
    runs = {s: [] for s in systems}
    for rep in range(args.reps):
        for k in range(len(systems)):
            system = systems[(rep + k) % len(systems)]
            dst = str(work / f"saved-{system}")
            shutil.rmtree(dst, ignore_errors=True)
            os.sync()                 # no system pays for the dirty pages of the one before
            per_rank = _world(args, system, src, dst)
            per_rank[0]["saved_equal"] = _check_saved(dst, src)
            runs[system].append(per_rank)
            shutil.rmtree(dst, ignore_errors=True)
            print(f"  rep {rep} {system}: load {max(r['load']['seconds'] for r in per_rank):.1f} s, save "
                  f"{max(r['save']['seconds'] for r in per_rank):.1f} s", flush=True)
    largest_fp32 = meta["largest_numel"] * 4
    summary = {}
    for system, reps in runs.items():
        s = {}
        for phase in ("load", "save"):
            s[phase] = {
                "seconds": statistics.median(max(r[phase]["seconds"] for r in per_rank) for per_rank in reps),
                "peak_bytes": statistics.median(max(r[phase]["peak_bytes"] for r in per_rank) for per_rank in reps),
                "peak_above_before_bytes": statistics.median(
                    max(r[phase]["peak_bytes"] - r[phase]["rss_before_bytes"] for r in per_rank) for per_rank in reps),
                "rss_after_bytes": statistics.median(max(r[phase]["rss_after_bytes"] for r in per_rank)
                                                     for per_rank in reps)}
            # the goal's bound, per rank: what it holds after the phase + the largest tensor in fp32 + 64 MiB
            s[phase]["peak_over_bound_bytes"] = statistics.median(
                max(r[phase]["peak_bytes"] - (r["load"]["rss_after_bytes"] + largest_fp32 + 64 * MiB) for r in per_rank)
                for per_rank in reps)
        s["save"]["fsync_seconds"] = statistics.median(max(r["save"].get("fsync_seconds", 0.0) for r in per_rank)
                                                       for per_rank in reps)
        s["shard_bytes"] = max(r["shard_bytes"] for r in reps[0])
        s["saved_equal"] = all(per_rank[0]["saved_equal"] for per_rank in reps)
        summary[system] = s
    if "zero_ext" in summary and "from_pretrained" in summary:
        z, a = summary["zero_ext"], summary["from_pretrained"]
        summary["zero_ext"]["goals"] = {
            "load_peak_within_bound": z["load"]["peak_over_bound_bytes"] <= 0,
            "load_time_vs_from_pretrained": z["load"]["seconds"] / a["load"]["seconds"],
            "save_peak_within_bound": z["save"]["peak_over_bound_bytes"] <= 0,
            "save_time_vs_gather_on_rank_0": z["save"]["seconds"] / a["save"]["seconds"]}
    print(f"\n{'system':16} {'load s':>7} {'load peak MiB':>14} {'above bound':>12} {'save s':>7} "
          f"{'save peak MiB':>14} {'shard MiB':>10} {'saved = src':>11}")
    for system, s in summary.items():
        print(f"{system:16} {s['load']['seconds']:7.1f} {s['load']['peak_bytes'] / MiB:14.0f} "
              f"{s['load']['peak_over_bound_bytes'] / MiB:12.0f} {s['save']['seconds']:7.1f} "
              f"{s['save']['peak_bytes'] / MiB:14.0f} {s['shard_bytes'] / MiB:10.0f} {str(s['saved_equal']):>11}")
    if "goals" in summary.get("zero_ext", {}):
        print("zero_ext goals:", json.dumps(summary["zero_ext"]["goals"]))
    out = {"meta": {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "commit": _git_head(), "cpu": cpu_model(), "torch": torch.__version__,
                    "transformers": __import__("transformers").__version__, "args": vars(args),
                    "numel": meta["numel"], "largest_numel": meta["largest_numel"],
                    "checkpoint_bytes": os.path.getsize(os.path.join(src, "model.safetensors"))},
           "systems": summary, "runs": runs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
