"""Peak device memory as users see it: every system in a process of its own (a fresh CUDA
context, nothing else on the GPU), the same GPT, batch and seed, 3 training steps, no timing.

    python benchmarks/bench_peak_gpu.py                       # the 1.31B GPT of bench_step_gpu.py
    python benchmarks/bench_peak_gpu.py --device cpu --layers 2 --width 256 --seq 64 --batch 2
                                                              # the plumbing on CPU (peak RSS)

Systems (bf16 compute, fp32 masters and AdamW states everywhere):
  torch           autocast bf16 + AdamW(fused=True), no wrapper
  fsdp2           fully_shard per Block + the model, MixedPrecisionPolicy(bf16, fp32 reduce)
  fsdp2_offload   the same with CPUOffloadPolicy()
  zeroS           zero_ext stage S, param_dtype bf16          (S = 1, 2, 3)
  zeroS_offload   the same with offload="cpu"
  zeroS_2ranks    stage S at 2 ranks sharing the GPU over cuda:gloo, per-rank batch halved

Per system, measured after the model is wrapped (the build's own peak is left out, as a user
building on the meta device would have it):
  allocated   torch.cuda.max_memory_allocated over the 3 steps
  reserved    torch.cuda.max_memory_reserved over the 3 steps
  device      total - free of torch.cuda.mem_get_info after each step (its maximum): what
              nvidia-smi shows, the CUDA context and anything outside torch's allocator included.
              At 2 ranks both processes share the GPU: the figure is the sum over ranks.
zero_ext systems also report what opt.stats() says they hold (model states, ring, gathered
units), which names what makes a difference to FSDP2. On CPU the one figure is the peak
resident memory of the process (ru_maxrss), build included.

--snapshot DIR (rank 0 of each system): the last step runs under torch.cuda.memory's history;
DIR/<system>.pickle.gz keeps both snapshots (memory_viz reads the "end" one), DIR/<system>.json
the live blocks at the step's peak by owner and the largest of them (benchmarks/peak_snapshot.py,
Note [The live set at the peak]); DIR/summary.txt all systems' reports. On CPU a stand-in
records instead (the code runs, nothing is measured).

Goals (issue 47): zero3 <= fsdp2; zero3_offload <= fsdp2_offload, and zero3_offload below
zero3 by at least the master and state bytes moved to the host.
JSON: benchmarks/results/bench_peak_gpu.json (--json).
"""
import argparse
import contextlib
import datetime
import json
import os
import pathlib
import resource
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the goals' systems first: --budget may end the list early
SYSTEMS = ("zero3,fsdp2,zero3_offload,fsdp2_offload,torch,zero1,zero2,zero1_offload,zero2_offload,"
           "zero3_2ranks,zero2_2ranks,zero1_2ranks")
GiB = 2 ** 30


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- one rank
def build(args, device):
    import torch
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50304, block_size=args.seq, n_layer=args.layers, n_head=max(1, args.width // 128),
                    n_embd=args.width, bias=False)
    with torch.device(device):
        return GPT(cfg)


def no_mark(phase):
    pass


def wrap(system, model, device):
    """(step function, zero_ext optimizer or None, the torch optimizer) for `system`; the step
    calls mark(phase) as it enters forward, backward, the step and zero_grad (--snapshot)."""
    import torch
    if system == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

        return _step_fn(model, opt, lambda: torch.autocast(device.type, dtype=torch.bfloat16)), None, opt
    if system.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
        mesh = init_device_mesh(device.type, (int(os.environ["WORLD_SIZE"]),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        off = CPUOffloadPolicy() if system.endswith("_offload") else OffloadPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=off)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=off)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4,
                                fused=device.type == "cuda" and not system.endswith("_offload"))
        return _step_fn(model, opt), None, opt
    import zero_ext
    stage = int(system[4])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    zm, zo = zero_ext.zeroify(model, opt, stage=stage, param_dtype="bf16",
                              offload="cpu" if "_offload" in system else None)
    return _step_fn(zm, zo), zo, opt


def _step_fn(model, opt, autocast=contextlib.nullcontext):
    """One training step of `model` and `opt`, each phase marked (Note [The live set at the peak])."""
    def step(x, y, mark=no_mark):
        mark("forward")
        with autocast():
            loss = model(x, y)[1]
        mark("backward")
        loss.backward()
        mark("step")
        opt.step()
        mark("zero_grad")
        opt.zero_grad(set_to_none=True)
    return step


def held_tensors(model, zo, opt):
    """What a system holds across steps, by owner: the snapshot's blocks recorded before the
    history began are named by the tensors inside them (Note [The live set at the peak])."""
    import torch
    states = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    if zo is None:
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        name = "masters (fp32 parameters)" if hasattr(next(model.parameters()), "to_local") else "parameters (fp32)"
        return {name: [t.detach() for t in local], "optimizer states": [t.to_local() if hasattr(t, "to_local") else t
                                                                          for t in states]}
    eng = zo._engine
    out = {"masters (zero_ext shard)": list(eng.param_shards()), "optimizer states": list(eng.states().values()),
           "gradient shard (zero_ext)": list(eng.grad_shards())}
    if zo.stats()["stage"] < 3:
        out["parameters (zero_ext buckets)"] = [p.detach() for p in model.parameters()]
    return out


def buffer_sizes(zo):
    """zero_ext buffers recognised by their size when nothing else names them: a ring slot."""
    if zo is None:
        return {}
    buf = zo.stats()["buffer_bytes"]
    return {"ring slot (zero_ext)": buf["grad_ring"] // buf["ring_slots"] if buf.get("ring_slots") else 0}


def snapshot_step(args, step, x, y, device, model, zo, opt):
    """The last step under the allocator's history; DIR/<system>.json and .pickle.gz (rank 0)."""
    import peak_snapshot as ps
    rec = ps.recorder(device)
    rec.begin()
    step(x, y, mark=rec.phase)
    snap = rec.end()
    out = pathlib.Path(args.snapshot)
    out.mkdir(parents=True, exist_ok=True)
    s = ps.summarize(snap, ps.held(held_tensors(model, zo, opt)), buffer_sizes(zo))
    name = args.system + ("_2ranks" if int(os.environ["WORLD_SIZE"]) == 2 else "")
    s["text"] = ps.lines(name, s)
    (out / f"{name}.json").write_text(json.dumps(s, indent=1) + "\n")
    ps.save(snap, out / f"{name}.pickle.gz")
    return s


def rank_main(args):
    """One rank of one system (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)."""
    import gc

    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        backend = "nccl" if world == 1 else "cuda:gloo"
    else:
        backend = "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model = build(args, device)
    numel = sum(p.numel() for p in model.parameters())
    step, zo, opt = wrap(args.system, model, device)
    gc.collect()
    out = {"rank": rank, "world": world, "numel": numel}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()                 # the build's fp32 copy, freed by the wrapper
        out["after_wrap_allocated"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    batch = args.batch // world
    g = torch.Generator(device=device).manual_seed(1 + rank)
    used = []
    for i in range(args.steps):
        x = torch.randint(0, 50304, (batch, args.seq), device=device, generator=g)
        y = torch.randint(0, 50304, (batch, args.seq), device=device, generator=g)
        if args.snapshot and rank == 0 and i == args.steps - 1:
            out["snapshot"] = snapshot_step(args, step, x, y, device, model, zo, opt)["by_owner"]
        else:
            step(x, y)
        if cuda:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            used.append(total - free)
    if cuda:
        out.update(allocated=torch.cuda.max_memory_allocated(), reserved=torch.cuda.max_memory_reserved(),
                   device=max(used), device_total=total,
                   allocator={k: v for k, v in torch.cuda.memory_stats().items()
                              if k in ("num_alloc_retries", "num_ooms", "active_bytes.all.peak",
                                       "inactive_split_bytes.all.peak", "segment.all.peak")})
    else:
        out["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if zo is not None:
        s = zo.stats()
        out["zero_ext"] = {"model_state_bytes": s["model_state_bytes"], "buffer_bytes": s["buffer_bytes"],
                           "offload": s["offload"], "frozen_parameter_bytes": s["frozen_parameter_bytes"]}
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------- the driver
def run_system(system, args):
    world = 2 if system.endswith("_2ranks") else 1
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(ROOT))
        cmd = [sys.executable, __file__, "--rank-of", system.replace("_2ranks", ""), "--device", args.device,
               "--layers", str(args.layers), "--width", str(args.width), "--seq", str(args.seq),
               "--batch", str(args.batch), "--steps", str(args.steps)]
        if args.snapshot:
            cmd += ["--snapshot", args.snapshot]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results, logs = [], []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return {"did_not_run": f"timed out after {args.timeout} s"}
        logs.append(text)
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            for q in procs:
                q.kill()
            tail = "\n".join(text.splitlines()[-6:])
            return {"did_not_run": f"exit {p.returncode}: {tail}"[-1500:]}
        results.append(json.loads(lines[-1][len("RESULT "):]))
    r = {"world": world, "numel": results[0]["numel"], "ranks": results}
    for k in ("allocated", "reserved", "rss_peak"):
        if k in results[0]:
            r[k] = max(x[k] for x in results)          # the worst rank
    if "device" in results[0]:
        r["device"] = max(x["device"] for x in results)   # both ranks' processes together
        r["device_per_rank"] = r["device"] / world
    if "zero_ext" in results[0]:
        r["zero_ext"] = results[0]["zero_ext"]
    if "snapshot" in results[0]:
        r["snapshot_by_owner"] = results[0]["snapshot"]   # rank 0's (Note [The live set at the peak])
    return r


def host_states(r):
    """Master + optimizer-state bytes zero_ext keeps on the host (offload), from stats()."""
    off = (r.get("zero_ext") or {}).get("offload") or {}
    return sum(v for k, v in off.items() if k in ("master_weights", "optimizer_states") and isinstance(v, (int, float)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="global batch (the 2-rank runs take half each)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--systems", default=SYSTEMS)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per system")
    ap.add_argument("--budget", type=int, default=0, help="seconds for all systems (0: no limit); "
                    "a system that would start later than that is left out, saying so")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "bench_peak_gpu.json"))
    ap.add_argument("--snapshot", default=None, help="a folder: the last step's allocator history of each "
                    "system (rank 0) and its live blocks at the peak by owner (benchmarks/peak_snapshot.py)")
    ap.add_argument("--rank-of", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_of:
        args.system = args.rank_of
        return rank_main(args)
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_peak_gpu: no CUDA device (torch.cuda.is_available() is False); nothing to measure "
              "(--device cpu runs the plumbing).")
        return 0
    # the driver never touches the GPU: each system's process is alone on it
    rows = {}
    key = "allocated" if args.device == "cuda" else "rss_peak"
    print(f"GPT {args.layers} layers x {args.width}, batch {args.batch} x {args.seq}, {args.steps} steps, "
          f"one process per system ({args.device})")
    if args.device == "cuda":
        print(f"{'system':>16} {'allocated':>10} {'reserved':>10} {'device':>10} {'states':>10} {'ring':>8} "
              f"{'gathered':>9}   GiB")
    else:
        print(f"{'system':>16} {'peak RSS GiB':>13}")
    t0 = time.monotonic()
    for system in args.systems.split(","):
        left = args.budget - (time.monotonic() - t0) if args.budget else args.timeout
        if left < 20:
            rows[system] = {"did_not_run": f"left out: the {args.budget} s budget was spent"}
            print(f"{system:>16} left out: the {args.budget} s budget was spent")
            continue
        args.timeout = int(min(args.timeout, left))
        r = rows[system] = run_system(system, args)
        write(args, rows, None)      # after every system: a run cut short keeps what it measured
        if "did_not_run" in r:
            print(f"{system:>16} did not run: {r['did_not_run'].splitlines()[-1] if r['did_not_run'] else ''}")
            continue
        if args.device == "cuda":
            z = r.get("zero_ext") or {}
            msb, buf = z.get("model_state_bytes", {}), z.get("buffer_bytes", {})
            cell = (lambda v: f"{v / GiB:.2f}" if isinstance(v, (int, float)) else "-")
            print(f"{system:>16} {r['allocated'] / GiB:10.2f} {r['reserved'] / GiB:10.2f} {r['device'] / GiB:10.2f} "
                  f"{cell(msb.get('total')):>10} {cell(buf.get('grad_ring')):>8} "
                  f"{cell(buf.get('peak_gathered_params')):>9}")
        else:
            print(f"{system:>16} {r['rss_peak'] / GiB:13.3f}")
    goals = {}
    ok = lambda n: n in rows and "did_not_run" not in rows[n]   # noqa: E731
    if ok("zero3") and ok("fsdp2"):
        goals["zero3_le_fsdp2"] = {k: rows["zero3"][k] <= rows["fsdp2"][k] for k in (key, "device") if k in rows["zero3"]}
    if ok("zero3_offload") and ok("fsdp2_offload"):
        goals["zero3_offload_le_fsdp2_offload"] = {k: rows["zero3_offload"][k] <= rows["fsdp2_offload"][k]
                                                   for k in (key, "device") if k in rows["zero3_offload"]}
    if ok("zero3_offload") and ok("zero3"):
        moved = host_states(rows["zero3_offload"])
        goals["zero3_offload_saves_the_host_bytes"] = {
            "moved_bytes": moved, "saved_bytes": rows["zero3"][key] - rows["zero3_offload"][key],
            "met": rows["zero3"][key] - rows["zero3_offload"][key] >= moved}
    print("goals:", json.dumps(goals))
    print(f"wrote {write(args, rows, goals)}")
    if args.snapshot:
        report_snapshots(args, rows)
    return 0


def report_snapshots(args, rows):
    """DIR/summary.txt: each system's live blocks at its peak by owner, one after another."""
    folder = pathlib.Path(args.snapshot)
    text = []
    for system in rows:
        f = folder / f"{system}.json"
        if f.exists():
            text += json.loads(f.read_text())["text"] + [""]
        else:
            text += [f"{system}: no snapshot ({rows[system].get('did_not_run', 'not written')})", ""]
    (folder / "summary.txt").write_text("\n".join(text))
    print("\n".join(text))


def write(args, rows, goals):
    import torch
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"args": {k: v for k, v in vars(args).items() if k not in ("rank_of", "timeout")}, "torch": torch.__version__,
            "device": ((torch.cuda.get_device_name(0) if goals is not None else "one CUDA GPU")
                       if args.device == "cuda" else "cpu"),
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    out.write_text(json.dumps({"meta": meta, "systems": rows, "goals": goals or {}}, indent=1) + "\n")
    return out


if __name__ == "__main__":
    sys.exit(main())
