"""Unused parameters (Note [Unused parameters] in csrc/engine/unused.cpp): a parameter
that no rank gave a gradient in a step is left exactly as torch's optimizer leaves one
whose .grad is None under DDP(find_unused_parameters=True): no weight decay, no moment
update, and its step count does not advance (Adam's bias correction). A parameter used
on one rank only is stepped on all of them.

The model has a trunk, a head `a`, a head `b` that some steps use (on every rank, on
rank 0 only, or on none: so b's step count falls behind the optimizer's), and a head
`never` that no step uses (BERT's pooler under an MLM-only loss is the real case,
tests/test_hf_models.py). Against DDP + the same torch optimizer, every tensor must be
equal bit for bit at 1 and 2 ranks and within the AdamW parity bound of test_parity.py
at 3 ranks; `never` must be bit-unchanged everywhere. Fused AdamW and SGD(momentum),
and the generic path (RMSprop: its update does not depend on the step count, the
one thing the generic path keeps per bucket rather than per parameter).

Checkpoints carry per-parameter step counts: saved at 2 ranks in stage 3, loaded at 3
ranks in stage 1, training continues as one plain torch process on the whole batch
does, and the consolidated optimizer state has torch's step count per parameter (none
at all for `never`)."""
import copy

import pytest
import torch
from torch import nn

from dist_harness import run_world

pytestmark = pytest.mark.dist

REL = 1e-5                 # as test_parity.py (ADAMW_REL)
STEPS = 7
ROWS = 12                  # global batch: divisible by 1, 2, 3
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.9, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, weight_decay=0.1),
}


class Heads(nn.Module):
    """Every tensor a multiple of 16 elements: torch's fused CPU AdamW computes the
    elements of a tensor past its last full vector (8 or 16 floats) in scalar code that, in about 1 element of
    3000, rounds differently from its (and our) vector code; without such tails the
    comparison is bit for bit. 2128 elements in all: no world size 3 divides them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.trunk = nn.Linear(16, 32)
        self.a = nn.Linear(32, 16)
        self.b = nn.Linear(32, 16)
        self.never = nn.Linear(32, 16)     # like BERT's pooler: never in the loss

    def forward(self, x, y, use_b: bool):
        h = torch.tanh(self.trunk(x))
        out = self.b(h) if use_b else self.a(h)
        return nn.functional.mse_loss(out, y)


def uses_b(step: int, rank: int) -> bool:
    """Step 0, 3, 6: nobody; 1, 4: rank 0 only; 2, 5: every rank."""
    return (step % 3 == 1 and rank == 0) or step % 3 == 2


def data(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(ROWS, 16, generator=g), torch.randn(ROWS, 16, generator=g)
    rows = ROWS // world
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def _parity_worker(rank, world):
    import zero_ext
    base = Heads()
    out = {}
    for opt_name, make in OPTIMIZERS.items():
        ref = copy.deepcopy(base)
        ddp = nn.parallel.DistributedDataParallel(ref, find_unused_parameters=True)
        ropt = make(list(ref.parameters()))
        for step in range(STEPS):
            ddp(*data(step, rank, world), uses_b(step, rank)).backward()
            ropt.step()
            ropt.zero_grad()
        for stage in (0, 1, 2, 3):
            model = copy.deepcopy(base)
            zm, zo = zero_ext.zeroify(model, make(list(model.parameters())), stage=stage)
            for step in range(STEPS):
                zm(*data(step, rank, world), uses_b(step, rank)).backward()
                zo.step()
                zo.zero_grad()
            sd = zm.state_dict()
            out[(opt_name, stage)] = {
                "equal": {n: torch.equal(sd[n], p.detach()) for n, p in ref.named_parameters()},
                "rel": {n: ((sd[n] - p.detach()).norm() / p.detach().norm()).item() for n, p in ref.named_parameters()},
                "never_unchanged": all(torch.equal(sd[n], base.state_dict()[n]) for n in ("never.weight", "never.bias")),
                "b_moved": not torch.equal(sd["b.weight"], base.b.weight),
                "flags": zo.stats()["comm"]["used_flags"]}
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_unused_parameters_match_ddp(world):
    outs = run_world(_parity_worker, world, timeout_s=300, reuse=True)
    for rank, out in enumerate(outs):
        for (opt_name, stage), r in out.items():
            where = f"rank {rank}/{world}, {opt_name}, stage {stage}"
            assert r["never_unchanged"], f"{where}: a parameter no rank used was changed"
            assert r["b_moved"], f"{where}: the sometimes-used head did not train"
            if world <= 2:
                differ = {n: r["rel"][n] for n, eq in r["equal"].items() if not eq}
                assert not differ, f"{where}: not bit-equal to DDP(find_unused_parameters=True): {differ}"
            else:
                over = {n: d for n, d in r["rel"].items() if d > REL}
                assert not over, f"{where}: differs from DDP(find_unused_parameters=True) by more than {REL}: {over}"
            # One small all-reduce per step (one byte per parameter and one "this rank missed
            # one"), none at one rank: `never` is missed at the first step, so "auto" keeps it.
            expect = (STEPS, STEPS * (8 + 1)) if world > 1 else (0, 0)
            assert (r["flags"]["calls"], r["flags"]["bytes"]) == expect, (where, r["flags"])


def _reference(steps):
    """One plain process on the whole batch: what any world size must reproduce."""
    model = Heads()
    opt = OPTIMIZERS["adamw"](list(model.parameters()))
    for step in steps:
        model(*data(step, 0, 1), uses_b(step, 0) and step % 3 == 2).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _train(zm, zo, rank, world, steps):
    for step in steps:
        zm(*data(step, rank, world), uses_b(step, 0) and step % 3 == 2).backward()
        zo.step()
        zo.zero_grad()


def _save_worker(rank, world, path):
    import zero_ext
    model = Heads()
    zm, zo = zero_ext.zeroify(model, OPTIMIZERS["adamw"](list(model.parameters())), stage=3)
    _train(zm, zo, rank, world, range(4))
    zero_ext.save(path, zm, zo)


def _load_worker(rank, world, path):
    import zero_ext
    model = Heads()
    zm, zo = zero_ext.zeroify(model, OPTIMIZERS["adamw"](list(model.parameters())), stage=1)
    zero_ext.load(path, zm, zo)
    _train(zm, zo, rank, world, range(4, STEPS))
    full = zero_ext.consolidated_state_dict(zm, zo)
    return full if rank == 0 else None


def test_checkpoint_keeps_per_parameter_steps(tmp_path):
    path = str(tmp_path / "ckpt")
    run_world(_save_worker, 2, path, timeout_s=300, reuse=True)
    full = run_world(_load_worker, 3, path, timeout_s=300, reuse=True)[0]
    ref, ropt = _reference(range(STEPS))
    for n, p in ref.named_parameters():
        d = ((full["model"][n] - p.detach()).norm() / p.detach().norm()).item()
        assert d <= REL, f"{n}: after save at 2 ranks / load at 3, differs from plain torch by {d}"
    assert torch.equal(full["model"]["never.weight"], Heads().never.weight)
    theirs, mine = ropt.state_dict()["state"], full["optimizer"]["state"]
    assert sorted(mine) == sorted(theirs), "parameters with optimizer state differ from torch's (never: none)"
    for i in theirs:
        assert float(mine[i]["step"]) == float(theirs[i]["step"]), (i, mine[i]["step"], theirs[i]["step"])
    steps = sorted({float(s["step"]) for s in theirs.values()})
    assert steps == [2.0, 5.0, float(STEPS)], steps    # b: steps 2 and 5; a: the other 5; trunk: all


class TwoHeads(nn.Module):
    """Every parameter used in every step, unless skip_b."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.trunk = nn.Linear(16, 32)
        self.a = nn.Linear(32, 16)
        self.b = nn.Linear(32, 16)

    def forward(self, x, y, skip_b: bool = False):
        h = torch.tanh(self.trunk(x))
        out = self.a(h) if skip_b else self.a(h) + self.b(h)
        return nn.functional.mse_loss(out, y)


def _agreement_worker(rank, world):
    """find_unused_parameters: how often the used-flags all-reduce runs, and that the
    result is DDP's whichever way; a parameter that stops getting gradients raises."""
    import zero_ext
    base = TwoHeads()
    ref = copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(ref)
    ropt = OPTIMIZERS["adamw"](list(ref.parameters()))
    for step in range(STEPS):
        ddp(*data(step, rank, world)).backward()
        ropt.step()
        ropt.zero_grad()
    out = {}
    for mode in (True, False, "auto"):
        for stage in (0, 2, 3):
            model = copy.deepcopy(base)
            zm, zo = zero_ext.zeroify(model, OPTIMIZERS["adamw"](list(model.parameters())), stage=stage,
                                      find_unused_parameters=mode)
            for step in range(STEPS):
                zm(*data(step, rank, world)).backward()
                zo.step()
                zo.zero_grad()
            sd = zm.state_dict()
            out[(mode, stage)] = {
                "rel": max(((sd[n] - p.detach()).norm() / p.detach().norm()).item() for n, p in ref.named_parameters()),
                "flags": zo.stats()["comm"]["used_flags"]["calls"]}
    # every parameter used at the first step, then b skipped on every rank
    for mode in ("auto", False, True):
        model = copy.deepcopy(base)
        zm, zo = zero_ext.zeroify(model, OPTIMIZERS["adamw"](list(model.parameters())), stage=2,
                                  find_unused_parameters=mode)
        error = None
        try:
            for step in range(3):
                zm(*data(step, rank, world), skip_b=step == 2).backward()
                zo.step()
                zo.zero_grad()
        except zero_ext.ZeroUsageError as e:
            error = str(e)
        out[("skip", mode)] = {"error": error, "b": zm.state_dict()["b.weight"]}
    # an optimizer.step() with no backward since zero_grad() (applying an edit, a scheduler
    # warm-up): no parameter has a gradient on any rank, so nothing moves, as torch; no
    # agreement is needed for it, so "auto" and False pay no collective and raise nothing
    ref = copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(ref)
    ropt = OPTIMIZERS["adamw"](list(ref.parameters()))

    def idle_step(m, o, step):
        if step == 2:
            o.zero_grad()
            o.step()
        m(*data(step, rank, world)).backward()
        o.step()
        o.zero_grad()
    for step in range(4):
        idle_step(ddp, ropt, step)
    for mode in ("auto", False):
        for stage in (1, 2, 3):
            model = copy.deepcopy(base)
            zm, zo = zero_ext.zeroify(model, OPTIMIZERS["adamw"](list(model.parameters())), stage=stage,
                                      find_unused_parameters=mode)
            error = None
            try:
                for step in range(4):
                    idle_step(zm, zo, step)
            except zero_ext.ZeroUsageError as e:
                error = str(e)
            sd = zm.state_dict()
            out[("idle", mode, stage)] = {
                "error": error, "flags": zo.stats()["comm"]["used_flags"]["calls"],
                "rel": max(((sd[n] - p.detach()).norm() / p.detach().norm()).item() for n, p in ref.named_parameters())}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_used_flags_agreement_only_when_needed(world):
    outs = run_world(_agreement_worker, world, timeout_s=300, reuse=True)
    for rank, out in enumerate(outs):
        for mode, stage in ((m, s) for m in (True, False, "auto") for s in (0, 2, 3)):
            r = out[(mode, stage)]
            where = f"rank {rank}/{world}, find_unused_parameters={mode!r}, stage {stage}"
            assert r["rel"] <= (0.0 if world <= 2 else REL), f"{where}: differs from DDP by {r['rel']}"
            # True: every step (DDP(find_unused_parameters=True)); "auto": the first step only,
            # since every rank had every gradient there; False: never (DDP's default)
            assert r["flags"] == {True: STEPS, False: 0, "auto": 1}[mode], (where, r["flags"])
        for mode in ("auto", False):
            msg = out[("skip", mode)]["error"]
            assert msg is not None, f"rank {rank}: find_unused_parameters={mode!r}: a parameter without a " \
                                    f"gradient was stepped silently"
            assert "b.weight" in msg and "find_unused_parameters=True" in msg, msg
        assert out[("skip", True)]["error"] is None
        for mode, stage in ((m, s) for m in ("auto", False) for s in (1, 2, 3)):
            r, where = out[("idle", mode, stage)], f"rank {rank}/{world}, find_unused_parameters={mode!r}, stage {stage}"
            assert r["error"] is None, f"{where}: a step with no backward raised: {r['error']}"
            assert r["rel"] <= (0.0 if world <= 2 else REL), f"{where}: differs from DDP by {r['rel']}"
            assert r["flags"] == {"auto": 1, False: 0}[mode], (where, r["flags"])
    # with the agreement, the skipped head is left alone at that step on every rank, as torch does
    assert all(torch.equal(o[("skip", True)]["b"], outs[0][("skip", True)]["b"]) for o in outs)
