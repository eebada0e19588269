"""A DDP script's rank-0 habits, kept as they are: rank 0 alone evaluates and writes the
checkpoint (`if master_process: ...`), and the other ranks' shard servers serve what it
reads (Note [Reading alone] in csrc/engine/away.h, Note [Shard server] in
zero_ext/alone/serving.py).

- The script is nanoGPT's train.py in miniature; the DDP line is the only one that differs
  (`wrap`). Stages 0-3 at 3 ranks (which divide nothing): every logged loss, rank 0's
  evaluation and the checkpoint it writes (`model.module.state_dict()` and
  `optimizer.state_dict()`) follow DDP's, and a resume from that file goes on as DDP's resume.
- What rank 0 reads alone equals, bit for bit, what the same calls return when every rank
  makes them (the files compared tensor by tensor; a tied weight is still one storage), and
  training after the excursion is the same bits: the state did not move while it was away.
  Also with the every-phase exchange schedule (what NCCL uses).
- Two ranks away at once, one of them for longer than the divergence watch's patience (an
  evaluation with autograd and no backward among what they read);
  `if rank == 0: save(...)` followed by `dist.barrier()`; a full state that would not fit
  rank 0's host memory is refused before anything is fetched, naming zero_ext.save.
- What cannot be served is named on every rank: rank 0 training alone after reading alone,
  rank 0 leaving the job for good, a serving rank whose process ends at once (os._exit).
- The end of a script, stages 1-3: rank 0 reads while the others have dropped the model
  (keeping the optimizer), dropped both, or passed a barrier with it and left.
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
            evals.append(loss_of("gpt", zm, *batch("gpt", 0, 2000, 0)).item())   # with autograd, no backward
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


def _optimizers_worker(rank, world, alone):
    """optimizer.state_dict() on rank 0 alone with the optimizers that are not zero_ext's fused
    ones: Muon + AdamW (whole tensors, the Muon recipe) and Adagrad (a torch optimizer over
    the shard), stage 2; and stage 3's Hugging Face save_pretrained on rank 0 alone."""
    import transformers as tf

    import zero_ext
    from cases import batch, build_model, loss_of
    from whole_cases import make_optimizers
    out = {}
    for name in ("muon", "adagrad"):
        torch.manual_seed(0)
        model = build_model("gpt")
        opts = make_optimizers("muon", model) if name == "muon" else torch.optim.Adagrad(model.parameters(), lr=1e-2)
        zm, zos = zero_ext.zeroify(model, opts, stage=2)
        zos = zos if isinstance(zos, list) else [zos]
        for it in range(3):
            loss_of("gpt", zm, *batch("gpt", rank, it, 0)).backward()
            for o in zos:
                o.step()
                o.zero_grad()
            if it == 1 and (rank == 0 or not alone):
                out[name] = [sorted(_flat_states(o.state_dict()).items()) for o in zos]
    torch.manual_seed(0)
    hf = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=32))
    zm, zo = zero_ext.zeroify(hf, torch.optim.AdamW(hf.parameters(), lr=1e-3), stage=3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(rank))
    zm(input_ids=ids, labels=ids).loss.backward()
    zo.step()
    if rank == 0 or not alone:
        zm.module.save_pretrained(os.path.join(_TMP[0], "alone" if alone else "all"), is_main_process=rank == 0)
    torch.distributed.barrier()   # the DDP idiom: the others wait outside zero_ext while rank 0 saves
    return out if rank == 0 else None


_TMP = [None]


def _optimizers_entry(rank, world, tmp, alone):
    _TMP[0] = tmp
    return _optimizers_worker(rank, world, alone)


def test_other_optimizers_and_save_pretrained_alone(tmp_path):
    from safetensors.torch import load_file
    alone = run_world(_optimizers_entry, 2, str(tmp_path), True, timeout_s=180)[0]
    every = run_world(_optimizers_entry, 2, str(tmp_path), False, timeout_s=180)[0]
    for name in ("muon", "adagrad"):
        for a, e in zip(alone[name], every[name]):
            assert [k for k, _ in a] == [k for k, _ in e] and a, name
            assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a, e)), name
    fa, fe = load_file(tmp_path / "alone" / "model.safetensors"), load_file(tmp_path / "all" / "model.safetensors")
    assert fa.keys() == fe.keys() and fa
    assert all(torch.equal(fa[k], fe[k]) for k in fe)


END_OF_SCRIPT = '''
"""A DDP script's end, with the DDP line replaced: rank 0 writes the final checkpoint while
the others return from main() and destroy the process group (torchrun)."""
import os, sys, time
import torch, torch.distributed as dist
import zero_ext
from cases import batch, build_model, loss_of


def main(out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build_model("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = zero_ext.zeroify(model, opt, stage=int(os.environ["STAGE"]))
    for it in range(4):
        loss_of("gpt", model, *batch("gpt", rank, it, 0)).backward()
        opt.step()
        opt.zero_grad()
    every = {"model": model.module.state_dict(), "optimizer": opt.state_dict()}   # every rank: the reference
    if rank == 0:
        torch.save(every, os.path.join(out, "every.pt"))
        time.sleep(1.0)                      # the others are gone from main() by now
        torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict()},
                   os.path.join(out, "alone.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
'''


def test_rank0_saves_at_the_end_of_a_torchrun_script(tmp_path, stage=3):
    """The other ranks return from main() (their model and optimizer are gone from it) and
    destroy the process group; they serve until every rank is at its exit."""
    proc = _torchrun(tmp_path, END_OF_SCRIPT, 3, STAGE=str(stage))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a = torch.load(tmp_path / "alone.pt", weights_only=False)
    e = torch.load(tmp_path / "every.pt", weights_only=False)
    assert a["model"].keys() == e["model"].keys()
    assert all(torch.equal(a["model"][k], t) for k, t in e["model"].items())
    sa, se = _flat_states(a["optimizer"]), _flat_states(e["optimizer"])
    assert sa.keys() == se.keys() and sa
    assert all(torch.equal(sa[k], t) for k, t in se.items())


AFTER_THE_OTHERS_LEFT = '''
"""Rank 0 reads alone after the other ranks let go of the model (issue 51's image-model
script: rank 0 writes its last checkpoint while rank 1 returns from main()). For each
stage 1-3: the serving rank drops the model but keeps the optimizer; drops both (a
function returns); or passes a dist.barrier() with rank 0 and then drops both. The last
model lives to the end of the script: the others exit while rank 0 saves."""
import gc, os, sys
import torch, torch.distributed as dist
import zero_ext
from cases import batch, build_model, loss_of


def train(stage, rank):
    torch.manual_seed(0)
    model = build_model("gpt")
    model, opt = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=3e-3), stage=stage)
    for it in range(3):
        loss_of("gpt", model, *batch("gpt", rank, it, 0)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, {"model": model.module.state_dict(), "optimizer": opt.state_dict()}   # every rank


def read_alone(model, opt, store, key):
    store.wait([key])     # the serving rank has let go
    return {"model": model.module.state_dict(), "optimizer": opt.state_dict()}


def main(out):
    dist.init_process_group("gloo")
    rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
    kept = []
    for stage in (1, 2, 3):
        for how in ("model", "both", "barrier"):
            key = f"{stage}/{how}"
            model, opt, every = train(stage, rank)
            if how == "barrier":
                dist.barrier()
            if rank == 0:
                alone = read_alone(model, opt, store, key)
                torch.save({"every": every, "alone": alone}, os.path.join(out, key.replace("/", "-") + ".pt"))
            else:
                del model, every
                if how != "model":
                    del opt
                else:
                    kept.append(opt)      # the optimizer outlives its model here
                gc.collect()
                store.set(key, "1")
            model = opt = None
            kept.clear() if how != "model" else None
    model, opt, every = train(2, rank)
    if rank == 0:
        torch.save({"every": every, "alone": read_alone(model, opt, store, "end")}, os.path.join(out, "end.pt"))
    else:
        store.set("end", "1")          # and leaves main(): its process exits


if __name__ == "__main__":
    main(sys.argv[1])
'''


def _torchrun(tmp_path, script: str, nproc: int, timeout: float = 240, **env_extra):
    import subprocess
    import sys
    from dist_harness import ROOT
    path = tmp_path / "train.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", **env_extra,
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(path),
           str(tmp_path)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_rank0_reads_after_the_others_let_go_in_every_stage(tmp_path):
    proc = _torchrun(tmp_path, AFTER_THE_OTHERS_LEFT, 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = [f"{s}-{h}" for s in (1, 2, 3) for h in ("model", "both", "barrier")] + ["end"]
    for name in names:
        got = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        a, e = got["alone"], got["every"]
        assert a["model"].keys() == e["model"].keys() and a["model"], name
        assert all(torch.equal(a["model"][k], t) for k, t in e["model"].items()), name
        sa, se = _flat_states(a["optimizer"]), _flat_states(e["optimizer"])
        assert sa.keys() == se.keys() and sa, name
        assert all(torch.equal(sa[k], t) for k, t in se.items()), name


def _exits_at_once(rank, world):
    """The serving rank ends its process with os._exit() (no clean exit): rank 0's read names it."""
    import time
    import zero_ext
    from cases import batch, build_model, loss_of
    store = torch.distributed.distributed_c10d._get_default_store()
    torch.manual_seed(0)
    model = build_model("gpt")
    model, opt = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=3e-3), stage=2)
    for it in range(2):
        loss_of("gpt", model, *batch("gpt", rank, it, 0)).backward()
        opt.step()
        opt.zero_grad()
    if rank == 1:
        store.set("exiting", "1")
        os._exit(0)
    store.wait(["exiting"])
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        opt.state_dict()
    except RuntimeError as e:
        return {"error": str(e), "took": time.monotonic() - t0}
    return {"error": None}


def test_a_serving_rank_that_exits_at_once_is_named():
    outs = run_world(_exits_at_once, 2, timeout_s=120, expect_errors=True)
    got = outs[0]["result"]
    print(got)
    assert got["error"] and "rank 1 is gone" in got["error"] and "os._exit" in got["error"], got
    assert got["took"] < 30, got
