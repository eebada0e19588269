"""A DDP script's own checkpoint, kept as it is: `model.state_dict()` and
`optimizer.state_dict()` on every rank, saved by rank 0, loaded on every rank with
`load_state_dict` (Note [Complete optimizer state] in zero_ext/optim_state.py).

- The file holds the complete state in torch's format, the same bytes DDP's file holds
  (stages 0-3): a plain torch optimizer loads it.
- Resumed by every rank, at the same or another world size and stage, training goes on
  exactly as DDP's resume from DDP's own file does; a DDP file resumes zero_ext runs and a
  zero_ext file resumes a DDP run.
- Called on rank 0 alone, `optimizer.state_dict()` (stages 1-3) and stage 3's
  `model.state_dict()` are served by the other ranks (tests/test_rank_alone.py).
"""
import pytest
import torch

from dist_harness import run_world

pytestmark = pytest.mark.dist

STEPS = 5
LR = 3e-3


def _build():
    from cases import build_model
    model = build_model("gpt")
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _train(model, opt, rank, start, steps):
    from cases import batch, loss_of
    for step in range(start, start + steps):
        x, y = batch("gpt", rank, step, 0)
        loss_of("gpt", model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def _wrap(model, opt, stage):
    """DDP for stage None, else zeroify at that stage."""
    import zero_ext
    from torch.nn.parallel import DistributedDataParallel as DDP
    if stage is None:
        return DDP(model), opt
    kw = dict(unit_modules=["Block"]) if stage == 3 else {}
    return zero_ext.zeroify(model, opt, stage=stage, **kw)


def _first_half(rank, world, tmp, stages):
    """Train STEPS steps with DDP and with zeroify at each stage; each writes its checkpoint
    the DDP way (state_dict on every rank, rank 0 saves)."""
    import torch.distributed as dist
    for stage in stages:
        model, opt = _build()
        m, o = _wrap(model, opt, stage)
        _train(m, o, rank, 0, STEPS)
        plain = m.module.state_dict() if stage is None else m.state_dict()
        state = {"model": plain, "optimizer": o.state_dict()}
        if rank == 0:
            torch.save(state, f"{tmp}/{stage}.pt")
        dist.barrier()
    return None


def _second_half(rank, world, tmp, pairs):
    """(file stage, resume stage): load the file on every rank and train STEPS more."""
    out = {}
    for saved, stage in pairs:
        model, opt = _build()
        ckpt = torch.load(f"{tmp}/{saved}.pt", weights_only=False)
        m, o = _wrap(model, opt, stage)
        (m.module if stage is None else m).load_state_dict(ckpt["model"])
        o.load_state_dict(ckpt["optimizer"])
        _train(m, o, rank, STEPS, STEPS)
        sd = m.module.state_dict() if stage is None else m.state_dict()
        out[(saved, stage)] = {k: v.detach().clone() for k, v in sd.items()}
    return out


# zero_ext folds the clipping factor into its fused step where torch scales the gradients
# first: the same maths, rounded differently (tests/test_parity.py bounds it alike). A lost
# or misplaced state is off by O(1) relative.
REL = 1e-5


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _file_diff(a: dict, b: dict) -> float:
    """Largest relative difference between two torch optimizer state dicts (inf: unlike)."""
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return float("inf")
    return max(_rel(t, b["state"][i][k]) for i in a["state"] for k, t in a["state"][i].items())


@pytest.mark.parametrize("save_world,load_world", [(2, 2), (2, 3)])
def test_ddp_style_checkpoint_resumes_as_ddp(tmp_path, save_world, load_world):
    stages = [None, 0, 1, 2, 3]
    run_world(_first_half, save_world, str(tmp_path), stages, reuse=True)
    ddp = torch.load(tmp_path / "None.pt", weights_only=False)
    for stage in stages[1:]:
        mine = torch.load(tmp_path / f"{stage}.pt", weights_only=False)
        assert "zero_ext" not in mine["optimizer"], "a complete state dict, not one rank's shard"
        diff = _file_diff(mine["optimizer"], ddp["optimizer"])
        worst = max(_rel(mine["model"][k], v) for k, v in ddp["model"].items())
        print(f"stage {stage}: optimizer state vs DDP's {diff:.3g}, model {worst:.3g} (relative)")
        assert diff <= REL and worst <= REL, (stage, diff, worst)
        plain = _build()[1]                                   # a plain torch optimizer loads it
        plain.load_state_dict(mine["optimizer"])
    # DDP resumes from its file; zero_ext at each stage from DDP's file and from its own
    # (at another stage), and DDP from a zero_ext file
    pairs = [(None, None), (None, 1), (None, 3), (1, 2), (2, 3), (3, 0), (2, None)]
    res = run_world(_second_half, load_world, str(tmp_path), pairs, reuse=True)
    for rank, out in enumerate(res):
        ref = out[(None, None)]
        moved = max((ref[k] - ddp["model"][k]).abs().max().item() for k in ref)
        assert moved > 1e-4, "the resumed steps changed nothing"
        for pair, sd in out.items():
            worst = max(_rel(sd[k], ref[k]) for k in ref)
            print(f"rank {rank}: file of stage {pair[0]} resumed at stage {pair[1]}: {worst:.3g} (relative)")
            assert worst <= REL, f"rank {rank}: file of stage {pair[0]} resumed at stage {pair[1]}: {worst:.3g}"
        # the same file resumed at two stages: the same arithmetic, so the same bits
        same = max((out[(None, 1)][k] - out[(None, 3)][k]).abs().max().item() for k in ref)
        assert same <= REL * max(ref[k].abs().max().item() for k in ref), same


def _allowed_worker(rank, world, what):
    """What rank 0 may do alone, as under DDP: it communicates nothing."""
    import zero_ext
    from cases import batch, loss_of
    model, opt = _build()
    stage = 3 if what == "gathered_evaluate" else 2
    zm, zo = _wrap(model, opt, stage)
    evals = []
    for step in range(6):
        x, y = batch("gpt", rank, step, 0)
        loss_of("gpt", zm, x, y).backward()
        zo.step()
        zo.zero_grad()
        if step in (1, 3):                     # once while the check learns, once after
            if what == "gathered_evaluate":    # every rank gathers; rank 0 alone evaluates
                with zero_ext.gathered_parameters(zm), torch.no_grad():
                    if rank == 0:
                        evals.append(loss_of("gpt", zm, *batch("gpt", 0, 100, 0)).item())
            elif rank == 0:
                if what == "evaluate":
                    with torch.no_grad():
                        evals.append(loss_of("gpt", zm, *batch("gpt", 0, 100, 0)).item())
                elif what == "evaluate_with_grad":   # no torch.no_grad(), no backward
                    evals.append(loss_of("gpt", zm, *batch("gpt", 0, 100, 0)).item())
                elif what == "model_state":
                    evals.append(len(zm.state_dict()))
    with zero_ext.gathered_parameters(zm):
        final = torch.cat([p.detach().reshape(-1).clone() for p in zm.module.parameters()])
    return {"evals": evals, "final": final, "exchanges": zo._engine.sequence_exchanges}


@pytest.mark.parametrize("what", ["evaluate", "evaluate_with_grad", "model_state", "gathered_evaluate"])
def test_rank0_alone_what_ddp_allows(what):
    """Stages 0-2 hold whole parameters: rank 0 alone may evaluate (with or without
    autograd) or take model.state_dict(), as under DDP; in stage 3 after every rank
    gathered the parameters (the fix the error names), rank 0 alone evaluates. Training
    goes on alike on every rank, and the evaluation is the one every rank would compute."""
    outs = run_world(_alone_ok_entry, 2, what, timeout_s=120)
    assert len(outs[0]["evals"]) == 2 and not outs[1]["evals"], outs
    assert torch.equal(outs[0]["final"], outs[1]["final"])
    if what != "model_state":
        ref = run_world(_alone_ok_entry, 2, "reference", timeout_s=120)
        assert outs[0]["evals"] == ref[0]["evals"], (outs[0]["evals"], ref[0]["evals"])


def _alone_ok_entry(rank, world, what):
    if what != "reference":
        return _allowed_worker(rank, world, what)
    # every rank evaluates (stage 2, the check's usual path): rank 0's numbers are the reference
    import zero_ext
    from cases import batch, loss_of
    model, opt = _build()
    zm, zo = _wrap(model, opt, 2)
    evals = []
    for step in range(6):
        x, y = batch("gpt", rank, step, 0)
        loss_of("gpt", zm, x, y).backward()
        zo.step()
        zo.zero_grad()
        if step in (1, 3):
            with torch.no_grad():
                evals.append(loss_of("gpt", zm, *batch("gpt", 0, 100, 0)).item())
    _ = zero_ext
    return {"evals": evals if rank == 0 else [], "final": None}


def _stage0_alone_worker(rank, world, path):
    import torch.distributed as dist
    model, opt = _build()
    zm, zo = _wrap(model, opt, 0)
    _train(zm, zo, rank, 0, 2)
    if rank == 0:                              # stage 0 holds everything: no collective
        torch.save(zo.state_dict(), path)
    dist.barrier()
    fresh = _build()[1]
    fresh.load_state_dict(torch.load(path, weights_only=False))
    return len(fresh.state_dict()["state"])


def test_stage0_rank0_alone_is_complete(tmp_path):
    counts = run_world(_stage0_alone_worker, 2, str(tmp_path / "opt.pt"))
    assert counts[0] == counts[1] == len(list(_build()[0].parameters()))
