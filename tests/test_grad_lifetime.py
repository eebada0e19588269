"""The gradient shard and the gradient ring live from the first reduce of a step to
zero_grad(set_to_none=True), as FSDP2's gradients do (Note [Gradient shard lifetime] in
csrc/engine/shard_view.cpp):

- opt.stats()["held_bytes"] after each phase of a step, stages 2-3 at 2 and 3 gloo ranks:
  nothing held before the first backward reduces, the whole shard and the ring after it,
  nothing after zero_grad(set_to_none=True); zero_grad(set_to_none=False) keeps both.
  model_state_bytes and buffer_bytes keep saying what a step needs.
- Training is bit-identical either way (set_to_none True or False: the released shard comes
  back zeroed), with the fused AdamW, a torch optimizer over shard views (Adagrad) and
  Muon + AdamW (whole tensors), gradient accumulation included; a step() with no backward
  after set_to_none moves nothing, as torch's.
"""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_world

pytestmark = pytest.mark.dist


def _held(opt) -> tuple:
    h = opt.stats()["held_bytes"]
    return h["gradients"], h["grad_ring"]


def _phases(rank, world, stage):
    import zero_ext
    from cases import batch, build_model, loss_of
    torch.manual_seed(0)
    model = build_model("gpt")
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage)
    seen = {}
    for it in range(2):
        x, y = batch("gpt", rank, it, 0)
        loss = loss_of("gpt", zm, x, y)
        seen[f"forward{it}"] = _held(zo)
        loss.backward()
        seen[f"backward{it}"] = _held(zo)
        zo.step()
        seen[f"step{it}"] = _held(zo)
        zo.zero_grad(set_to_none=it == 0)
        seen[f"zero_grad{it}"] = _held(zo)
    zo.zero_grad(set_to_none=True)
    s = zo.stats()   # what a step needs, whatever is held now
    return {"seen": seen, "need": (s["model_state_bytes"]["gradients"], s["buffer_bytes"]["grad_ring"]),
            "end": _held(zo)}


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_are_held_from_the_first_reduce_to_zero_grad(world):
    for stage in (2, 3):
        for rank, o in enumerate(run_world(_phases, world, stage, reuse=True)):
            seen, (grads, ring) = o["seen"], o["need"]
            where = f"world {world} stage {stage} rank {rank}: {seen}"
            assert grads > 0 and ring > 0, where
            assert o["end"] == (0, 0), where
            assert seen["backward0"] == (grads, ring) and seen["step0"] == (grads, ring), where
            assert seen["zero_grad0"] == (0, 0), where           # set_to_none=True: released
            assert seen["forward1"] == (0, 0), where             # ... until the next backward reduces
            assert seen["backward1"] == (grads, ring), where
            assert seen["zero_grad1"] == (grads, ring), where    # set_to_none=False keeps them


def _train(rank, world, stage, recipe, set_to_none):
    import zero_ext
    from cases import batch, build_model, loss_of
    from whole_cases import make_optimizers
    torch.manual_seed(0)
    model = build_model("gpt")
    if recipe == "muon":
        opts = make_optimizers("muon", model)
    elif recipe == "adagrad":
        opts = torch.optim.Adagrad(model.parameters(), lr=1e-2)
    else:
        opts = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    zm, zo = zero_ext.zeroify(model, opts, stage=stage)
    zos = zo if isinstance(zo, list) else [zo]
    losses = []
    for it in range(4):
        with zm.no_sync():                                   # accumulation: the first micro-step sends nothing
            loss_of("gpt", zm, *batch("gpt", rank, it, 0)).backward()
        loss = loss_of("gpt", zm, *batch("gpt", rank, it, 1))
        loss.backward()
        losses.append(loss.item())
        for o in zos:
            o.step()
        for o in zos:
            o.zero_grad(set_to_none=set_to_none)
    with zero_ext.gathered_parameters(zm):
        final = {n: p.detach().clone() for n, p in zm.module.named_parameters()}
    for o in zos:   # a step with no backward since set_to_none: as torch's, no parameter moves
        o.step()
    with zero_ext.gathered_parameters(zm):
        moved = [n for n, p in zm.module.named_parameters() if not torch.equal(p, final[n])]
    return {"losses": losses, "final": final, "moved": moved}


def _both(rank, world, stage, recipe):
    return [_train(rank, world, stage, recipe, s) for s in (True, False)]


@pytest.mark.parametrize("recipe", ["adamw", "adagrad", "muon"])
def test_training_is_the_same_bits_whether_gradients_are_released(recipe):
    for stage in (2, 3):
        for rank, (released, kept) in enumerate(run_world(_both, 2, stage, recipe, reuse=True)):
            where = f"{recipe} stage {stage} rank {rank}"
            assert released["losses"] == kept["losses"], (where, released["losses"], kept["losses"])
            assert released["final"].keys() == kept["final"].keys(), where
            assert all(torch.equal(released["final"][n], t) for n, t in kept["final"].items()), where
            assert released["moved"] == [], (where, released["moved"])
