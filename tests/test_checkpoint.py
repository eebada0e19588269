"""Checkpoints (README "Checkpoints and resuming"): saved at N ranks in one stage,
resumed at M ranks in another; consolidated offline into a plain torch file; streamed
consolidation with measured memory; dead ranks; damaged checkpoints.

Every run uses the same global batch of 12 sequences per step, split evenly over the
ranks, so runs at different world sizes compute the same mean gradient and can be
compared number for number (within the AdamW parity tolerance of test_parity.py)."""
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from dist_harness import ROOT, run_world

ADAMW_REL = 1e-5           # as test_parity.py
ROWS = 12                  # global batch: divisible by 1, 2, 3, 4
SAVE_CFG = dict(bucket_bytes=16384, first_bucket_bytes=4096)     # several buckets, straddling parameters
LOAD_CFG = dict(bucket_bytes=24576, first_bucket_bytes=8192)     # another layout on purpose
# (optimizer, fused, stage) also saved at N=4 for test_other_optimizers_and_paths
OTHERS = [("sgd", "auto", 0), ("RMSprop", "never", 2), ("adamw", "never", 3)]    # stage 0: rank 0 writes


def _batch(step, rank, world):
    from cases import TINY_GPT
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, TINY_GPT["vocab_size"], (ROWS, TINY_GPT["block_size"] + 1), generator=g)
    rows = ROWS // world
    part = idx[rank * rows:(rank + 1) * rows]
    return part[:, :-1].contiguous(), part[:, 1:].contiguous()


def _plain(optimizer="adamw"):
    """The plain GPT (its position embedding frozen: a replicated, unsharded tensor in
    every stage) and an optimizer with two param groups, as every run builds them."""
    from cases import Case, build_model, make_optimizer
    model = build_model("gpt")
    model.wpe.weight.requires_grad_(False)
    # RMSprop's first step is about 10 * lr * sign(g): torch's default lr=1e-2 moves every
    # weight by 0.1 and makes any two runs (even N=1 vs N=2, no checkpoint) differ by 26%.
    kw = dict(lr=3e-4) if optimizer == "RMSprop" else {}
    opt = make_optimizer(Case("ckpt", model="gpt", optimizer=optimizer, two_groups=True, opt_kwargs=kw), model)
    return model, opt


def _fresh(stage, cfg, optimizer="adamw", fused="auto"):
    import zero_ext
    model, opt = _plain(optimizer)
    zm, zo = zero_ext.zeroify(model, opt, stage=stage, fused=fused, **cfg)
    return zm, zo, torch.optim.lr_scheduler.StepLR(zo, step_size=4, gamma=0.7)


def _train(model, opt, sched, rank, world, steps, clip):
    for step in steps:
        x, y = _batch(step, rank, world)
        _, loss = model(x, y)
        loss.backward()
        clip(model)
        opt.step()
        opt.zero_grad()
        sched.step()


def _zclip(zo):
    return lambda model: zo.clip_grad_norm_(1.0)


def _snapshot(zm) -> dict:
    """A copy of the full state_dict (stages 0-2 return live views of the parameters)."""
    return {k: v.clone() for k, v in zm.state_dict().items()}


def _rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-30)).item() for k in a)


# ----------------------------------------------------------------------------- N=4 run, shared
def _save_world(rank, world, tmp):
    import zero_ext
    out = {}
    for stage in (1, 2, 3):
        zm, zo, sched = _fresh(stage, SAVE_CFG)
        _train(zm, zo, sched, rank, world, range(10), _zclip(zo))
        zero_ext.save(os.path.join(tmp, f"s{stage}"), zm, zo, extra={"step": 10}, scheduler=sched)
        at_save = _snapshot(zm)
        to = world - 1 if stage == 3 else 0              # any rank can receive
        full = zero_ext.consolidated_state_dict(zm, zo, to=to)
        _train(zm, zo, sched, rank, world, range(10, 20), _zclip(zo))
        final = _snapshot(zm)                      # the uninterrupted N=4 run
        assert (full is None) == (rank != to)
        if rank == to:
            out[f"full{stage}"] = full
        if rank == 0:
            out[stage] = {"at_save": at_save, "final": final, "lr": [g["lr"] for g in zo.param_groups]}
    for name, fused, stage in OTHERS:                  # for test_other_optimizers_and_paths
        zm, zo, sched = _fresh(stage, SAVE_CFG, name, fused)
        _train(zm, zo, sched, rank, world, range(5), _zclip(zo))
        zero_ext.save(os.path.join(tmp, name), zm, zo, extra={"step": 5}, scheduler=sched)
        _train(zm, zo, sched, rank, world, range(5, 10), _zclip(zo))
        out[name] = _snapshot(zm)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ckpt"))
    t0 = time.monotonic()
    res = run_world(_save_world, 4, tmp, timeout_s=240, reuse=True)
    out = res[0]
    for stage in (1, 2, 3):
        out[stage]["full"] = next(r[f"full{stage}"] for r in res if f"full{stage}" in r)
    return tmp, out, time.monotonic() - t0


# -------------------------------------------------- resume at another world size and stage
def _resume_world(rank, world, tmp, pairs):
    import zero_ext
    out = {}
    for saved_stage, stage in pairs:
        zm, zo, sched = _fresh(stage, LOAD_CFG)
        extra = zero_ext.load(os.path.join(tmp, f"s{saved_stage}"), zm, zo, scheduler=sched)
        assert extra == {"step": 10}, extra
        loaded = _snapshot(zm)
        _train(zm, zo, sched, rank, world, range(10, 20), _zclip(zo))
        out[(saved_stage, stage)] = {"loaded": loaded, "final": _snapshot(zm),
                                     "lr": [g["lr"] for g in zo.param_groups]}
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_at_other_world_size_and_stage(saved, world):
    """Saved at N=4 in stages 1, 2, 3 after 10 steps; resumed at N=world, each in
    another stage and another bucket layout; 10 more steps equal the uninterrupted
    N=4 run within the AdamW parity tolerance."""
    tmp, ref, _ = saved
    pairs = [(s, (s + world) % 4) for s in (1, 2, 3)]        # always a different stage, 0 included
    results = run_world(_resume_world, world, tmp, pairs, timeout_s=180, reuse=True)
    for rank, res in enumerate(results):
        for (s, stage), r in res.items():
            name = f"saved N=4 stage {s} -> N={world} stage {stage}, rank {rank}"
            for k, v in ref[s]["at_save"].items():
                assert torch.equal(v, r["loaded"][k]), f"{name}: {k} not restored exactly"
            moved = _rel(ref[s]["final"], ref[s]["at_save"])
            assert moved > 1e-3, f"{name}: the continuation did not train"
            rel = _rel(ref[s]["final"], r["final"])
            assert rel <= ADAMW_REL, f"{name}: relative difference {rel:.3g} > {ADAMW_REL}"
            assert r["lr"] == pytest.approx(ref[s]["lr"]), f"{name}: scheduler state not restored"


# ------------------------------------------------------------------- offline consolidation
@pytest.mark.dist
def test_offline_consolidation_to_plain_torch(saved, tmp_path):
    """python -m zero_ext.consolidate, no process group: the file loads into the plain
    model and a plain torch AdamW, equals the in-memory streamed consolidation, and 10
    plain steps match zero_ext's continuation."""
    from zero_ext.checkpoint import consolidate
    tmp, ref, _ = saved
    for s in (2, 3):
        if s == 2:                                       # the command line
            out = str(tmp_path / f"full{s}.pt")
            proc = subprocess.run([sys.executable, "-m", "zero_ext.consolidate", os.path.join(tmp, f"s{s}"), out],
                                  capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
            assert proc.returncode == 0, proc.stderr
            full = torch.load(out, weights_only=True)
        else:                                            # the function behind it
            full = consolidate(os.path.join(tmp, f"s{s}"))
        streamed = ref[s]["full"]
        assert full["extra"] == {"step": 10}
        assert set(full["model"]) == set(streamed["model"])
        for k in full["model"]:
            assert torch.equal(full["model"][k], streamed["model"][k]), k
        assert full["optimizer"]["param_groups"] == streamed["optimizer"]["param_groups"]
        for i, st in full["optimizer"]["state"].items():
            for k, v in st.items():
                assert torch.equal(v, streamed["optimizer"]["state"][i][k]), (i, k)

        model, opt = _plain()
        model.load_state_dict(full["model"])
        opt.load_state_dict(full["optimizer"])
        assert len(opt.state) == sum(p.requires_grad for p in model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        sched.load_state_dict(full["scheduler"])
        _train(model, opt, sched, 0, 1, range(10, 20),
               lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
        rel = _rel(ref[s]["final"], model.state_dict())
        assert rel <= ADAMW_REL, f"stage {s}: plain continuation differs by {rel:.3g}"


# ------------------------------------------------- streamed consolidation, measured memory
def _vm(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _memory_world(rank, world, bucket_bytes):
    import ctypes

    import torch.distributed as dist

    import zero_ext
    from cases import MLP
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)       # M_MMAP_THRESHOLD: freed big blocks leave at once
    torch.manual_seed(0)
    model = MLP(d_in=64, hidden=256, d_out=8, depth=18)      # 17 layers of ~256 KiB
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2,
                              bucket_bytes=bucket_bytes, first_bucket_bytes=bucket_bytes)
    x, y = torch.randn(4, 64), torch.randn(4, 8)
    zm(x, y).backward()
    zo.step()
    zo.zero_grad()
    psi = sum(p.numel() for p in model.parameters())
    dist.barrier()

    def measure(fn):
        ctypes.CDLL("libc.so.6").malloc_trim(0)        # free heap pages leave: the result cannot hide in them
        open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from now
        before = _vm("VmRSS")
        result = fn()
        dist.barrier()
        return result, _vm("VmHWM") - before

    full, peak = measure(lambda: zero_ext.consolidated_state_dict(zm, zo, to=0))
    result_bytes = 0
    if full is not None:
        result_bytes = sum(t.numel() * t.element_size() for t in full["model"].values())
        result_bytes += sum(t.numel() * t.element_size() for s in full["optimizer"]["state"].values()
                            for t in s.values() if t.dim() > 0)
    del full
    # The measurement is sensitive: gathering every rank's flat state at once (the
    # non-streamed way) shows up as a model-sized extra.
    flats = [torch.cat(zo._engine.param_shards())] + list(zo._engine.states().values())

    def gather_all():
        out = [[torch.empty_like(f) for _ in range(world)] if rank == 0 else None for f in flats]
        for f, o in zip(flats, out):
            dist.gather(f, o, dst=0)
        return out

    _, naive_peak = measure(gather_all)
    return {"peak": peak, "result_bytes": result_bytes, "naive_peak": naive_peak, "psi": psi,
            "buckets": zo.stats()["num_buckets"],
            "max_bucket_bytes": 4 * world * max(t.numel() for t in zo._engine.param_shards())}


@pytest.mark.dist
def test_streamed_consolidation_memory():
    """Consolidating a 4.5 MB (fp32) model with AdamW on rank 0 of 2: the peak RSS
    growth beyond the result itself stays within one bucket (~256 KiB) + 1 MiB of
    bookkeeping, while gathering the shards at once grows it by the whole state."""
    bucket = 256 << 10
    r0 = run_world(_memory_world, 2, bucket, timeout_s=180)[0]
    model_bytes = 4 * r0["psi"]
    assert model_bytes >= 16 * r0["max_bucket_bytes"] and r0["buckets"] >= 16
    assert r0["result_bytes"] == 3 * model_bytes
    extra = r0["peak"] - r0["result_bytes"]
    print(f"\nconsolidation: model {model_bytes / 2**20:.2f} MiB in {r0['buckets']} buckets of at most "
          f"{r0['max_bucket_bytes'] >> 10} KiB; rank 0 peak RSS growth {r0['peak'] / 2**20:.2f} MiB = result "
          f"{r0['result_bytes'] / 2**20:.2f} MiB + extra {extra / 2**20:.3f} MiB; gathering at once: "
          f"{r0['naive_peak'] / 2**20:.2f} MiB")
    assert extra <= r0["max_bucket_bytes"] + (1 << 20), f"extra {extra} bytes beyond the result"
    assert r0["naive_peak"] >= 1.5 * model_bytes, "the measurement does not see a model-sized gather"


# ------------------------------------------------------------------------------ dead ranks
def _dying_world(rank, world, tmp, how):
    import signal

    import zero_ext
    from cases import batch, build_model, loss_of
    model = build_model("mlp")
    stage = 3 if how == "step" else 2
    # sequence_timeout: a rank that sees a peer fail waits twice this for the others' reports
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage,
                              sequence_timeout=1.0, **(dict(unit_modules=["Linear"]) if stage == 3 else {}))
    path = os.path.join(tmp, how)

    def die():
        with open(path + "-killed", "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    try:
        for step in range(8):
            x, y = batch("mlp", rank, step, 0)
            loss = loss_of("mlp", zm, x, y)
            if how == "step" and step == 5 and rank == world - 1:
                die()                                           # mid-step: after forward, before backward
            loss.backward()
            zo.step()
            zo.zero_grad()
            if step == 2:
                zero_ext.save(path, zm, zo, extra={"step": step})
                sd = _snapshot(zm)
                if rank == 0:
                    torch.save(sd, path + "-ref.pt")
            if how == "save" and step == 4:
                if rank == world - 1:                           # dies while writing its shard
                    from torch.distributed.checkpoint import FileSystemWriter
                    FileSystemWriter.write_data = lambda *a, **k: die()
                zero_ext.save(path, zm, zo, extra={"step": step})
    except Exception:
        with open(f"{path}-failed{rank}", "w") as f:
            f.write(repr(time.time()))
        raise
    return "finished"


@pytest.mark.dist
def test_dead_rank_fails_the_others_and_checkpoint_survives(tmp_path):
    """A rank SIGKILLed mid-step (stage 3), or mid-save while writing its shard (stage
    2): the others exit with an error naming it within seconds, and the last complete
    checkpoint loads at another world size and stage with exactly the saved values."""
    import zero_ext
    from cases import build_model
    tmp = str(tmp_path)
    for how in ("step", "save"):
        t0 = time.monotonic()
        outs = run_world(_dying_world, 3, tmp, how, timeout_s=90, expect_errors=True)
        elapsed = time.monotonic() - t0
        assert outs[2]["error"] == "exited without a result", how
        for rank in (0, 1):
            msg = outs[rank]["error"]
            assert not outs[rank]["ok"], f"{how}: rank {rank} finished although a peer died"
            if how == "step":
                assert "zero_ext:" in msg and "Another rank probably died" in msg, msg
            else:
                assert "CheckpointError" in msg and "failed on rank" in msg and "untouched" in msg, msg
        path = os.path.join(tmp, how)
        killed = float(open(path + "-killed").read())
        latency = [float(open(f"{path}-failed{r}").read()) - killed for r in (0, 1)]
        print(f"\nkilled mid-{how}: the other ranks failed {max(latency):.2f}s later (whole run {elapsed:.0f}s)")
        assert max(latency) < 20, f"{how}: the surviving ranks took {latency}s to fail"
        assert elapsed < 60, f"{how}: the run took {elapsed:.0f}s"
    assert os.path.isdir(os.path.join(tmp, "save.tmp")), "the interrupted save left its temporary directory"
    for how in ("step", "save"):                     # loads in this process: one rank, stage 1
        path = os.path.join(tmp, how)
        model = build_model("mlp")
        zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=1)
        assert zero_ext.load(path, zm, zo) == {"step": 2}
        ref = torch.load(path + "-ref.pt")
        for k, v in ref.items():
            assert torch.equal(v, zm.state_dict()[k]), (how, k)


# --------------------------------------------------------------------- damaged checkpoints
def _bad_world(rank, world, cases):
    import zero_ext
    from cases import MLP
    out = {}
    for name, path, kind in cases:
        if kind == "mlp":
            model = MLP()
            zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), stage=2)
        elif kind == "sgd":
            model, _ = _plain()
            zm, zo = zero_ext.zeroify(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=2)
        else:
            zm, zo, _ = _fresh(2, {})
        try:
            zero_ext.load(path, zm, zo)
            out[name] = "loaded"
        except zero_ext.CheckpointError as e:
            out[name] = str(e)
    return out


@pytest.mark.dist
def test_damaged_and_mismatched_checkpoints(saved, tmp_path):
    """Each problem gets its own message, the same on every rank, before anything is
    read (and the ranks go on to the next case: nobody hangs); the offline tool
    refuses the same way."""
    tmp, _, _ = saved
    src = os.path.join(tmp, "s2")

    def copy(name):
        dst = str(tmp_path / name)
        shutil.copytree(src, dst)
        return dst

    truncated = copy("truncated")
    with open(os.path.join(truncated, "__1_0.distcp"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(truncated, "__1_0.distcp")) // 2)
    corrupt = copy("corrupt")
    with open(os.path.join(corrupt, "__2_0.distcp"), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(corrupt, "__2_0.distcp")) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    missing = copy("missing")
    os.remove(os.path.join(missing, "__3_0.distcp"))
    interrupted = copy("interrupted")
    os.remove(os.path.join(interrupted, "zero_ext.json"))
    cases = [
        ("truncated", truncated, "gpt", ["__1_0.distcp", "rank 1", "truncated"]),
        ("corrupt", corrupt, "gpt", ["__2_0.distcp", "rank 2", "corrupt", "CRC32"]),
        ("missing", missing, "gpt", ["__3_0.distcp", "rank 3", "missing"]),
        ("interrupted", interrupted, "gpt", ["not a complete zero_ext checkpoint", "manifest"]),
        ("nowhere", str(tmp_path / "nowhere"), "gpt", ["no checkpoint at"]),
        ("other model", src, "mlp", ["another model", "layers.0.weight", "wte.weight"]),
        ("other optimizer", src, "sgd", ["AdamW", "SGD"]),
        ("good", src, "gpt", []),
    ]
    res = run_world(_bad_world, 2, [c[:3] for c in cases], timeout_s=120)
    assert res[0] == res[1], "ranks disagree"
    for name, _, _, words in cases:
        msg = res[0][name]
        if not words:
            assert msg == "loaded", msg
            continue
        for w in words:
            assert w in msg, f"{name}: {w!r} not in {msg!r}"
    messages = [res[0][c[0]] for c in cases]
    assert len(set(messages)) == len(messages), "two problems share one message"
    from zero_ext.checkpoint import CheckpointError, consolidate
    with pytest.raises(CheckpointError, match="truncated"):
        consolidate(truncated)
    # a save that died between its two renames left only <path>.old: that one is read
    shutil.copytree(src, str(tmp_path / "renamed.old"))
    assert consolidate(str(tmp_path / "renamed"))["extra"] == {"step": 10}
    # the command line's main() (test_offline_consolidation_to_plain_torch runs the command itself)
    import contextlib
    import io

    from zero_ext.consolidate import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([corrupt, str(tmp_path / "x.pt")])
    assert code == 1 and "corrupt" in err.getvalue() and not os.path.exists(tmp_path / "x.pt")


# ----------------------------------------------------------------------------- other optimizers


def _others_resume_world(rank, world, tmp):
    import zero_ext
    out = {}
    cases = [(name, fused, (stage + 1) % 4, os.path.join(tmp, name), 5) for name, fused, stage in OTHERS]
    cases.append(("adamw from fused", "never", 0, os.path.join(tmp, "s2"), 10))   # fused -> torch's own
    for key, fused, stage, path, start in cases:
        zm, zo, sched = _fresh(stage, LOAD_CFG, key.split()[0], fused)
        assert zero_ext.load(path, zm, zo, scheduler=sched) == {"step": start}
        _train(zm, zo, sched, rank, world, range(start, start + 5 if start == 5 else 20), _zclip(zo))
        out[key] = _snapshot(zm)
    return out


@pytest.mark.dist
def test_other_optimizers_and_paths(saved):
    """Fused SGD (momentum; saved in stage 0, where only rank 0 writes), RMSprop and
    AdamW on the generic path (torch's optimizer over the shard, fused='never'): saved
    at N=4, resumed at N=3 in another stage,
    and consolidated offline into the plain torch optimizer, all continue as the
    uninterrupted run; a fused AdamW checkpoint also loads into the generic path."""
    from zero_ext.checkpoint import consolidate
    tmp, ref, _ = saved
    res = run_world(_others_resume_world, 3, tmp, timeout_s=120, reuse=True)
    for rank, r in enumerate(res):
        for name, _, _ in OTHERS:
            rel = _rel(ref[name], r[name])
            assert rel <= ADAMW_REL, f"{name} N=4 -> N=3 rank {rank}: {rel:.3g}"
        rel = _rel(ref[2]["final"], r["adamw from fused"])
        assert rel <= ADAMW_REL, f"fused AdamW -> generic AdamW: {rel:.3g}"
    for name, _, _ in OTHERS:
        full = consolidate(os.path.join(tmp, name))
        model, opt = _plain(name)
        model.load_state_dict(full["model"])
        opt.load_state_dict(full["optimizer"])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        sched.load_state_dict(full["scheduler"])
        _train(model, opt, sched, 0, 1, range(5, 10), lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
        rel = _rel(ref[name], model.state_dict())
        assert rel <= ADAMW_REL, f"{name}: plain continuation differs by {rel:.3g}"


def test_single_process_loss_scaler_and_extra(tmp_path):
    """Without a process group (world size 1): `extra` with tensors, and a save over an
    existing checkpoint (replaced, no leftovers)."""
    import zero_ext
    path = str(tmp_path / "ck")
    zm, zo, sched = _fresh(2, {})
    _train(zm, zo, sched, 0, 1, range(3), _zclip(zo))
    zero_ext.save(path, zm, zo, extra={"step": 3})
    extra = {"step": 4, "rng": torch.get_rng_state(), "note": "plain data"}
    zero_ext.save(path, zm, zo, extra=extra, scheduler=sched)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    zm2, zo2, sched2 = _fresh(3, {})
    got = zero_ext.load(path, zm2, zo2, scheduler=sched2)
    assert got["step"] == 4 and torch.equal(got["rng"], extra["rng"]) and got["note"] == "plain data"


# ----------------------------------------------------------------------------- mixed precision
MP_CFG = dict(param_dtype="fp16", initial_loss_scale=2.0 ** 8, loss_scale_growth_interval=2)


def _mp_save_world(rank, world, path):
    import zero_ext
    zm, zo, sched = _fresh(2, {**SAVE_CFG, **MP_CFG})
    for step in range(5):
        x, y = _batch(step, rank, world)
        zo.backward(zm(x, y)[1])
        zo.clip_grad_norm_(1.0)
        zo.step()
        zo.zero_grad()
    zero_ext.save(path, zm, zo, extra={"step": 5})
    full = zero_ext.consolidated_state_dict(zm, zo, to=0)
    return {"full": full, "scaler": zo.loss_scaler.state_dict()} if rank == 0 else None


@pytest.mark.dist
def test_mixed_precision_checkpoint(tmp_path):
    """fp16 with dynamic loss scaling, saved at N=2 in stage 2, loaded by one process in
    stage 3: the fp32 masters and Adam states come back bit for bit (not the fp16 copy),
    the fp16 parameters are the masters rounded, and the loss scaler's state (scale
    grown twice, its counters) is restored."""
    import zero_ext
    path = str(tmp_path / "mp")
    saved = run_world(_mp_save_world, 2, path, timeout_s=240, reuse=True)[0]
    assert saved["scaler"]["scale"] == 2.0 ** 10, saved["scaler"]          # grew at steps 2 and 4
    zm, zo, sched = _fresh(3, {**LOAD_CFG, **MP_CFG})
    assert zero_ext.load(path, zm, zo) == {"step": 5}
    assert zo.loss_scaler.state_dict() == saved["scaler"]
    full = zero_ext.consolidated_state_dict(zm, zo)
    for k, v in saved["full"]["model"].items():   # the frozen wpe computes (and is kept) in fp16
        assert v.dtype == (torch.float16 if k == "wpe.weight" else torch.float32), (k, v.dtype)
        assert torch.equal(full["model"][k], v), k
    for i, st in saved["full"]["optimizer"]["state"].items():
        for name, t in st.items():
            assert torch.equal(torch.as_tensor(full["optimizer"]["state"][i][name]), torch.as_tensor(t)), (i, name)
    low = zm.state_dict()                                                   # gathered fp16 parameters
    for k, v in saved["full"]["model"].items():
        if k in low and low[k].dtype == torch.float16 and k != "wpe.weight":
            assert torch.equal(low[k], v.half()), k
