"""The optimizer made apart from the wrapper line (Note [Adopted optimizers] in zero_ext/adopt.py),
in the two orders users write, each against DDP on the same script at 2 and 3 gloo ranks:

- built after: `model = zeroify(model, stage=S)`, then `opt = torch.optim.X(model.parameters())`
  and a scheduler over it (FSDP2's and the DDP tutorial's order; tests/ddp_scripts.py
  built_after): AdamW over decay / no-decay groups, SGD with Nesterov, Adagrad and RMSprop
  (torch optimizers over the shard) and the Muon recipe (two optimizers, whole tensors).
  Every logged loss and the final weights within 1e-5 relative of DDP's, and bit for bit
  those of the same optimizer given to zeroify.
- built before and never given: the three DDP scripts of tests/ddp_scripts.py with the
  wrapper line `model = zeroify(model, stage=S)` (GradScaler, gradient accumulation,
  nanoGPT's resume into the bare optimizer before the wrapper, ImageNet's resume, StepLR).
- What cannot work is named on every rank, before any training collective: a second torch
  optimizer stepping the zeroified parameters, a training forward with no optimizer at all,
  and two optimizers over the same parameter.
"""
from __future__ import annotations

import pytest
import torch

from ddp_scripts import OPTIMIZERS, worst_loss_rel, worst_weight_rel
from dist_harness import run_world

pytestmark = pytest.mark.dist

FP32_REL, AMP_REL = 1e-5, 1e-2
STAGES = (0, 1, 2, 3)
SCRIPTS = [   # (key, script, kwargs): the scripts of tests/test_ddp_scripts.py whose optimizer is built first
    ("tutorial-poison", "tutorial", dict(steps=6, amp=True, scaler_kw=dict(growth_interval=2), poison=(1, 3))),
    ("gpt", "gpt", dict(max_iters=6, amp=False, ckpt="gpt.pt", save_at=3)),
    ("gpt-resumed", "gpt", dict(max_iters=6, amp=False, ckpt="gpt.pt", resume=True)),
    ("imagenet-amp", "imagenet", dict(epochs=3, amp=True, ckpt="imagenet.pt", save_after=1, batches=2)),
    ("imagenet-amp-resumed", "imagenet", dict(epochs=3, amp=True, ckpt="imagenet.pt", resume=True, batches=2)),
]


def _runs(rank, world, tmp, optimizers: list, scripts: list) -> dict:
    import ddp_scripts
    out = {}
    for name in optimizers:
        out[("ddp", name)] = ddp_scripts.built_after(rank, None, name)
        for s in STAGES:
            out[(s, name)] = ddp_scripts.built_after(rank, dict(stage=s), name)
            out[(s, name, "passed")] = ddp_scripts.built_after(rank, dict(stage=s, optimizer="passed"), name)
    hows = {"ddp": None, **{s: dict(stage=s, optimizer="unpassed") for s in STAGES}}
    out.update(ddp_scripts.run_scripts(rank, tmp, hows, scripts))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_optimizer_made_apart_trains_as_ddp(tmp_path, world):
    optimizers = list(OPTIMIZERS) if world == 2 else ["adamw-groups", "adagrad", "muon+adamw"]
    scripts = SCRIPTS if world == 2 else [s for s in SCRIPTS if s[0] in ("tutorial-poison", "gpt", "gpt-resumed")]
    results = run_world(_runs, world, str(tmp_path), optimizers, scripts, reuse=True, timeout_s=600)
    for rank, res in enumerate(results):
        for name in optimizers:
            ref = res[("ddp", name)]
            for s in STAGES:
                got, passed = res[(s, name)], res[(s, name, "passed")]
                assert got["types"][-1] == "ZeroModel" and all(t.startswith("ZeroOptimizer")
                                                               for t in got["types"][:-1]), got["types"]
                worst = worst_loss_rel(got["log"], ref["log"])
                weights = worst_weight_rel(got["weights"], ref["weights"])
                if rank == 0:
                    print(f"world {world} stage {s} {name} built after the wrapper: losses within {worst:.2g}, "
                          f"weights within {weights:.2g} of DDP's")
                assert worst <= FP32_REL and weights <= FP32_REL, (world, rank, s, name, got["log"], ref["log"])
                # the same engine either way: the bits of the optimizer given to zeroify
                assert [l for l, _ in got["log"]] == [l for l, _ in passed["log"]], (s, name)
                assert all(torch.equal(got["weights"][k], w) for k, w in passed["weights"].items()), (s, name)
        for key, _, kw in scripts:
            ref = res[("ddp", key)]["log"]
            for s in STAGES:
                got = res[(s, key)]["log"]
                worst = worst_loss_rel(got, ref)
                weights = worst_weight_rel(res[(s, key)]["weights"], res[("ddp", key)]["weights"])
                if rank == 0:
                    print(f"world {world} stage {s} {key}, optimizer never given: losses within {worst:.2g}, "
                          f"weights within {weights:.2g} of DDP's")
                bound = AMP_REL if kw["amp"] else FP32_REL
                assert len(got) == len(ref) and worst <= bound and weights <= bound, (world, rank, s, key, got, ref)
                assert [sc for _, sc in got] == [sc for _, sc in ref], (world, rank, s, key, "GradScaler's scale")
        # the resumed runs resumed (DDP's own resume is the reference)
        first, resumed = res[("ddp", "gpt")]["log"], res[("ddp", "gpt-resumed")]["log"]
        assert worst_loss_rel(resumed, first[3:]) <= 1e-6


def _refused(rank, world, what: str):
    """What zero_ext must name: a second torch optimizer stepping a zeroified model's
    parameters; a training forward with no optimizer; two optimizers over one parameter."""
    import ddp_scripts
    import zero_ext
    torch.manual_seed(0)
    model = ddp_scripts.ToyModel()
    if what == "second":
        plain = torch.optim.SGD(model.parameters(), lr=0.1)          # built first, never given
        model, opt = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), stage=2)
    else:
        model = zero_ext.zeroify(model, stage=2)
        if what == "twice":
            torch.optim.SGD(model.parameters(), lr=0.1)
            keep = torch.optim.AdamW(model.parameters())   # noqa: F841 - both alive at the first forward
            first = torch.optim.SGD(model.parameters(), lr=0.1)   # noqa: F841
    before = [p.detach().clone() for p in model.module.parameters()]
    loss = model(torch.randn(4, 10)).square().mean()
    loss.backward()
    if what == "second":
        opt.step()
        try:
            plain.step()
        except zero_ext.ZeroUsageError as e:
            after = [p.detach().clone() for p in model.module.parameters()]
            model(torch.randn(4, 10)).square().mean().backward()   # the ranks still train together
            opt.step()
            return {"error": str(e), "stepped": any(not torch.equal(a, b) for a, b in zip(after, before))}
    return {"error": None}


@pytest.mark.parametrize("what", ["second", "none", "twice"])
def test_what_cannot_be_adopted_is_named(what):
    outs = run_world(_refused, 2, what, timeout_s=120, expect_errors=True)
    for rank, o in enumerate(outs):
        if what == "second":
            assert o["ok"], o
            msg = o["result"]["error"]
            assert msg and "SGD" in msg and "zeroify() was not given it" in msg and o["result"]["stepped"], msg
        else:
            assert not o["ok"], f"rank {rank} trained: {o}"
            msg = o["error"]
            want = "no torch optimizer over model.parameters()" if what == "none" else "hold the same parameter"
            assert want in msg and "zero_ext" in msg, msg
        print(f"{what}, rank {rank}: {msg}")
