"""A DDP script's rank-0 habits, kept as they are: rank 0 alone evaluates and writes the
checkpoint (`if master_process: ...`), and the other ranks' shard servers serve what it
reads (Note [Reading alone] in csrc/engine/away.h, Note [Shard server] in
zero_ext/shard_server.py).

- The script is nanoGPT's train.py in miniature; the DDP line is the only one that differs
  (`wrap`). Stages 0-3 at 3 ranks (which divide nothing): every logged loss, rank 0's
  evaluation and the checkpoint it writes (`model.module.state_dict()` and
  `optimizer.state_dict()`) follow DDP's, and a resume from that file goes on as DDP's resume.
- What rank 0 reads alone equals, bit for bit, what the same calls return when every rank
  makes them (the files compared tensor by tensor; a tied weight is still one storage), and
  training after the excursion is the same bits: the state did not move while it was away.
  Also with the every-phase exchange schedule (what NCCL uses).
- Two ranks away at once, one of them for longer than the divergence watch's patience;
  `if rank == 0: save(...)` followed by `dist.barrier()`; a full state that would not fit
  rank 0's host memory is refused before anything is fetched, naming zero_ext.save.
- What cannot be served is named on every rank: rank 0 training alone after reading alone,
  rank 0 leaving the job for good.
"""
import os

import pytest
import torch

from dist_harness import run_world

pytestmark = pytest.mark.dist

STEPS, EVAL_EVERY, EVAL_BATCHES = 6, 2, 3
LR = 3e-3
REL = 1e-5                 # fp32, as tests/test_parity.py


def _wrapper(stage, **options):
    """The one line of the script that changes: DDP (stage None) or zeroify."""
    def wrap(model, opt):
        if stage is None:
            from torch.nn.parallel import DistributedDataParallel as DDP
            return DDP(model), opt
        import zero_ext
        return zero_ext.zeroify(model, opt, stage=stage, **options)
    return wrap


@torch.no_grad()
def _estimate_loss(model):
    from cases import batch, loss_of
    model.eval()
    out = [loss_of("gpt", model, *batch("gpt", 0, 1000 + k, 0)).item() for k in range(EVAL_BATCHES)]
    model.train()
    return out


def _script(rank, world, wrap, path, alone=True, resume=None):
    """train.py: every EVAL_EVERY iterations the master process (alone, as nanoGPT's) or
    every rank (alone=False) estimates the loss and takes the checkpoint; the master saves
    it. resume: a checkpoint file, loaded after wrapping as `model.module.load_state_dict`,
    `optimizer.load_state_dict`, its iteration next."""
    from cases import batch, build_model, loss_of
    torch.manual_seed(0)
    model = build_model("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model, opt = wrap(model, opt)
    raw = model.module
    master = rank == 0
    start = 0
    if resume is not None:
        ckpt = torch.load(resume, weights_only=False)
        raw.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start = ckpt["iter"]
    log = {"train": [], "eval": [], "files": []}
    for it in range(start, STEPS):
        if it % EVAL_EVERY == 0 and it > 0 and (master or not alone):
            losses = _estimate_loss(model)
            ckpt = {"model": raw.state_dict(), "optimizer": opt.state_dict(), "iter": it}
            if master:
                log["eval"].append(losses)
                torch.save(ckpt, os.path.join(path, f"ckpt{it}.pt"))
                log["files"].append(os.path.join(path, f"ckpt{it}.pt"))
        x, y = batch("gpt", rank, it, 0)
        loss = loss_of("gpt", model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        log["train"].append(loss.item())
    log["final"] = {k: v.detach().clone() for k, v in raw.state_dict().items()}   # every rank calls it
    return log


RUNS = [(s, {}) for s in (0, 1, 2, 3)] + [(s, {"check_sequence": "every_phase"}) for s in (2, 3)]


def _all_runs(rank, world, tmp):
    out = {"ddp": _script(rank, world, _wrapper(None), _dir(tmp, "ddp", rank))}
    for stage, options in RUNS:
        name = f"s{stage}" + ("-every" if options else "")
        wrap = _wrapper(stage, **options)
        out[name] = {"alone": _script(rank, world, wrap, _dir(tmp, name + "-alone", rank)),
                     "all": _script(rank, world, wrap, _dir(tmp, name + "-all", rank), alone=False)}
        # resume from the file rank 0 wrote alone, after zeroify, as DDP resumes from its own
        first = os.path.join(tmp, name + "-alone", f"ckpt{EVAL_EVERY}.pt")
        out[name]["resumed"] = _script(rank, world, wrap, _dir(tmp, name + "-resumed", rank), resume=first)
    out["ddp_resumed"] = _script(rank, world, _wrapper(None), _dir(tmp, "ddp-resumed", rank),
                                 resume=os.path.join(tmp, "ddp", f"ckpt{EVAL_EVERY}.pt"))
    return out


def _dir(tmp, name, rank):
    d = os.path.join(tmp, name)
    if rank == 0:
        os.makedirs(d, exist_ok=True)
    return d


def _rel(a, b) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def _close(name, a: list, b: list, rel: float = REL) -> None:
    for k, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rel * abs(y), f"{name}: entry {k}: {x} vs DDP's {y}"
    assert len(a) == len(b), (name, len(a), len(b))


def _flat_states(sd: dict) -> dict:
    return {(i, k): torch.as_tensor(v) for i, st in sd["state"].items() for k, v in st.items()}


def test_rank0_evaluates_and_checkpoints_alone_as_under_ddp(tmp_path):
    outs = run_world(_all_runs, 3, str(tmp_path), timeout_s=600, reuse=True)
    ddp, ddp_resumed = outs[0]["ddp"], outs[0]["ddp_resumed"]
    ddp_file = torch.load(ddp["files"][0], weights_only=False)
    for stage, options in RUNS:
        name = f"s{stage}" + ("-every" if options else "")
        for rank, out in enumerate(outs):
            r = out[name]
            _close(f"{name} rank {rank} train", r["alone"]["train"], out["ddp"]["train"])
            assert r["alone"]["train"] == r["all"]["train"], f"{name} rank {rank}: the excursion changed training"
            for k, v in r["all"]["final"].items():
                assert torch.equal(r["alone"]["final"][k], v), f"{name} rank {rank}: {k} after training"
            _close(f"{name} rank {rank} resumed", r["resumed"]["train"], out["ddp_resumed"]["train"])
        alone, every = outs[0][name]["alone"], outs[0][name]["all"]
        assert alone["eval"] == every["eval"], f"{name}: rank 0's evaluation alone {alone['eval']} vs {every['eval']}"
        for got, want in zip(alone["eval"], ddp["eval"]):
            _close(f"{name} evaluation", got, want)
        for fa, fe in zip(alone["files"], every["files"]):
            a, e = torch.load(fa, weights_only=False), torch.load(fe, weights_only=False)
            assert a["model"].keys() == e["model"].keys() == ddp_file["model"].keys()
            for k, t in e["model"].items():
                assert torch.equal(a["model"][k], t), f"{name} {os.path.basename(fa)}: model {k}"
            # the tied weight is one storage in both files, as in DDP's
            for f in (a, e):
                assert f["model"]["lm_head.weight"].data_ptr() == f["model"]["wte.weight"].data_ptr(), name
            sa, se = _flat_states(a["optimizer"]), _flat_states(e["optimizer"])
            assert sa.keys() == se.keys() and sa, (name, sorted(sa), sorted(se))
            for key, t in se.items():
                assert torch.equal(sa[key], t), f"{name} {os.path.basename(fa)}: optimizer state {key}"
            assert a["optimizer"]["param_groups"] == e["optimizer"]["param_groups"]
        first = torch.load(alone["files"][0], weights_only=False)
        for k, t in ddp_file["model"].items():
            assert _rel(first["model"][k], t) <= REL, f"{name}: model {k} vs DDP's file"
        sd, sp = _flat_states(ddp_file["optimizer"]), _flat_states(first["optimizer"])
        assert sd.keys() == sp.keys()
        for key, t in sd.items():
            assert _rel(sp[key].float(), t.float()) <= 1e-4, f"{name}: optimizer {key} vs DDP's file"
    _ = ddp_resumed


def _away_worker(rank, world, path, readers, sleep_s):
    """Stage 3, patience 1 s: `readers` evaluate and take the optimizer's state while the
    others train on; rank 1 sleeps `sleep_s` in the middle (longer than the patience). Then
    rank 0 saves alone and every rank meets in dist.barrier()."""
    import time

    import torch.distributed as dist

    import zero_ext
    from cases import batch, build_model, loss_of
    torch.manual_seed(0)
    model = build_model("gpt")
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=LR), stage=3, sequence_timeout=1.0)
    evals, states = [], []
    for it in range(5):
        x, y = batch("gpt", rank, it, 0)
        loss_of("gpt", zm, x, y).backward()
        zo.step()
        zo.zero_grad()
        if it == 2 and rank in readers:
            evals = _estimate_loss(zm)
            if rank == 1:
                time.sleep(sleep_s)
            evals += _estimate_loss(zm)
            states = sorted(_flat_states(zo.state_dict()).items())
        if it == 3:
            if rank == 0:
                torch.save({"model": zm.state_dict(), "optimizer": zo.state_dict()}, path)
            dist.barrier()
    return {"evals": evals, "states": states, "final": {k: v.clone() for k, v in zm.state_dict().items()}}


def test_two_ranks_away_one_longer_than_the_patience_then_save_and_barrier(tmp_path):
    away = run_world(_away_worker, 3, str(tmp_path / "a.pt"), (0, 1), 2.5, timeout_s=240)
    every = run_world(_away_worker, 3, str(tmp_path / "b.pt"), (0, 1, 2), 0.0, timeout_s=240)
    for r in (0, 1):
        assert away[r]["evals"] and away[r]["evals"] == every[r]["evals"], (r, away[r]["evals"], every[r]["evals"])
        assert [k for k, _ in away[r]["states"]] == [k for k, _ in every[r]["states"]]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(away[r]["states"], every[r]["states"])), r
    for r in range(3):
        assert all(torch.equal(away[r]["final"][k], v) for k, v in every[r]["final"].items()), r
    a, b = torch.load(tmp_path / "a.pt", weights_only=False), torch.load(tmp_path / "b.pt", weights_only=False)
    assert all(torch.equal(a["model"][k], v) for k, v in b["model"].items())


def _too_big_worker(rank, world):
    """Rank 0's host memory is made too small for the full state: refused before any fetch,
    and the script (which catches it) trains on with the others."""
    import zero_ext
    import zero_ext.offload
    from cases import batch, build_model, loss_of
    torch.manual_seed(0)
    model = build_model("gpt")
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=LR), stage=2)
    error = None
    for it in range(4):
        x, y = batch("gpt", rank, it, 0)
        loss_of("gpt", zm, x, y).backward()
        zo.step()
        zo.zero_grad()
        if it == 1 and rank == 0:
            zero_ext.offload.available_host_bytes = lambda: 1000
            try:
                zo.state_dict()
            except zero_ext.ZeroUsageError as e:
                error = str(e)
    return {"error": error, "final": [p.detach().clone() for p in zm.module.parameters()]}


def test_a_full_state_too_big_for_the_host_is_refused_before_fetching():
    outs = run_world(_too_big_worker, 2, timeout_s=120)
    assert outs[0]["error"] and "zero_ext.save" in outs[0]["error"] and "host memory" in outs[0]["error"], outs[0]
    assert all(torch.equal(a, b) for a, b in zip(outs[0]["final"], outs[1]["final"]))


def _alone_then_train(rank, world, what):
    """Rank 0 reads alone, then does what only every rank can: backward (of an evaluation
    loss, stage 3) or step() (stage 2) alone; or leaves the job for good (stage 2)."""
    import time

    from cases import batch, build_model, loss_of
    import zero_ext
    torch.manual_seed(0)
    model = build_model("gpt")
    stage = 3 if what == "backward" else 2
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=LR), stage=stage,
                              sequence_timeout=1.0)
    t0 = None
    for it in range(6):
        x, y = batch("gpt", rank, it, 0)
        loss_of("gpt", zm, x, y).backward()
        zo.step()
        zo.zero_grad()
        if it == 3:
            t0 = time.monotonic()
            if rank == 0 and what == "leave":
                return {"left": True}
            if rank == 0:
                zo.state_dict()
                if what == "backward":
                    loss_of("gpt", zm, x, y).backward()
                else:
                    zo.step()
    return {"t0": t0}


@pytest.mark.parametrize("what", ["backward", "step", "leave"])
def test_what_cannot_be_served_is_named_on_every_rank(what):
    import time
    start = time.monotonic()
    outs = run_world(_alone_then_train, 3, what, timeout_s=120, expect_errors=True)
    took = time.monotonic() - start
    others = outs[1:] if what == "leave" else outs
    for rank, o in enumerate(others, start=1 if what == "leave" else 0):
        assert not o["ok"], f"rank {rank} finished: {o}"
        msg = o["error"]
        print(f"rank {rank}: {msg}\n")
        assert "zero_ext:" in msg and "rank 0" in msg, msg
    assert took < 60, f"{what}: the ranks were named only after {took:.0f} s"
