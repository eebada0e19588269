"""Gradients live from a step's first gradient to zero_grad(set_to_none=True), as torch's and
FSDP2's do: stages 0-1 hold their buckets' full gradient (flat_grad; Note [Bucket gradient
lifetime]), stages 2-3 the gradient shard (Note [Gradient shard lifetime]; both in
csrc/engine/shard_view.cpp), so the loss-time peak holds none of them. A ring slot's receive
buffer lives only while a bucket holds the slot (Note [Ring slot lifetime] in
csrc/engine/grad_ring.h): between backwards the ring holds its send buffers alone.

- opt.stats()["held_bytes"] after each phase of a step, stages 0-3 at 2 and 3 gloo ranks (the
  tiny GPT: 3-rank slices do not divide its buckets): nothing before the first backward, all
  of it after, nothing after zero_grad(set_to_none=True) and at the next loss;
  zero_grad(set_to_none=False) keeps it. Stages 0-1 with small buckets: in the middle of a
  backward some buckets have their bytes back and some not yet (bucket by bucket).
- Training is bit-identical (torch.equal) with set_to_none True or False (the released bytes
  come back zeroed), with gradient accumulation under no_sync; stages 0-1 with clipping (the
  engine's, and torch's over stage 0's .grad), stages 2-3 with the fused AdamW, a torch
  optimizer over shard views (Adagrad) and Muon + AdamW (whole tensors). A step() with no
  backward since set_to_none moves nothing, as torch's.
- Stages 0-1 with released buckets match DDP + AdamW within 1e-5 at 2 and 3 ranks.
"""
from __future__ import annotations

import pytest
import torch

from cases import Case, run_cases
from dist_harness import run_world

pytestmark = pytest.mark.dist

SMALL = dict(bucket_bytes=2048, first_bucket_bytes=1024)   # stages 0-1: many buckets


def _held(opt) -> tuple:
    h = opt.stats()["held_bytes"]
    return h["gradients"], h["grad_ring"]


def _phases(rank, world, stage):
    import zero_ext
    from cases import batch, build_model, loss_of
    torch.manual_seed(0)
    model = build_model("gpt")
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage,
                              **(SMALL if stage < 2 else {}))
    seen, middle = {}, []
    # the gradient of block 0's output: the later blocks' buckets have their gradients, block 0's
    # and the embeddings' not yet
    def post(m, args, out):
        out.register_hook(lambda g: middle.append(_held(zo)))
    zm.module.blocks[0].register_forward_hook(post)
    for it in range(2):
        x, y = batch("gpt", rank, it, 0)
        loss = loss_of("gpt", zm, x, y)
        seen[f"loss{it}"] = _held(zo)
        loss.backward()
        seen[f"backward{it}"] = _held(zo)
        zo.step()
        seen[f"step{it}"] = _held(zo)
        zo.zero_grad(set_to_none=it == 0)
        seen[f"zero_grad{it}"] = _held(zo)
    zo.zero_grad(set_to_none=True)
    s = zo.stats()   # what a step needs, whatever is held now
    return {"seen": seen, "middle": middle, "end": _held(zo),
            "need": (s["model_state_bytes"]["gradients"], s["buffer_bytes"]["grad_ring"])}


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_are_held_from_the_first_gradient_to_zero_grad(world):
    for stage in (0, 1, 2, 3):
        for rank, o in enumerate(run_world(_phases, world, stage, reuse=True)):
            seen, need = o["seen"], o["need"]
            where = f"world {world} stage {stage} rank {rank}: {seen} of {need}, middle {o['middle']}"
            if stage < 2:   # the buckets' gradients (their ring is counted from the first landing too)
                seen = {k: v[0] for k, v in seen.items()}
                need, end, none = need[0], o["end"][0], 0
                assert all(0 < m[0] < need for m in o["middle"]), where   # bucket by bucket
                assert len(o["middle"]) == 2, where
            else:   # the shard; between backwards the ring holds its send buffers, not its receive ones
                end, none = o["end"], (0, 0)
                sends = {seen[k][1] for k in ("backward0", "step0", "backward1", "zero_grad1")}
                assert len(sends) == 1 and 0 < min(sends) < need[1], where
                need = (need[0], min(sends))
            assert o["need"][0] > 0 and (stage < 2 or o["need"][1] > 0) and end == none, where   # a step's needs
            assert seen["loss0"] == none, where                  # none before the first backward
            assert seen["backward0"] == need and seen["step0"] == need, where
            assert seen["zero_grad0"] == none, where             # set_to_none=True: released
            assert seen["loss1"] == none, where                  # ... until the next backward
            assert seen["backward1"] == need, where
            assert seen["zero_grad1"] == need, where             # set_to_none=False keeps them


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
        opts = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    zm, zo = zero_ext.zeroify(model, opts, stage=stage, **(SMALL if stage < 2 else {}))
    zos = zo if isinstance(zo, list) else [zo]
    losses, norms = [], []
    for it in range(4):
        with zm.no_sync():   # accumulation: the first micro-step sends nothing
            loss_of("gpt", zm, *batch("gpt", rank, it, 0)).backward()
        loss = loss_of("gpt", zm, *batch("gpt", rank, it, 1))
        loss.backward()
        losses.append(loss.item())
        if stage == 0 and it % 2:   # stage 0 keeps DDP's .grad: torch's clip reads and scales the views
            norms.append(float(torch.nn.utils.clip_grad_norm_(zm.parameters(), 0.5)))
        elif stage < 2:
            norms.append(float(zo.clip_grad_norm_(0.5)))
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
    return {"losses": losses, "norms": norms, "final": final, "moved": moved}


def _both(rank, world, stage, recipe):
    return [_train(rank, world, stage, recipe, s) for s in (True, False)]


@pytest.mark.parametrize("world,stages,recipe", [(2, (0, 1), "adamw"), (3, (0, 1), "adamw"), (2, (2, 3), "adamw"),
                                                 (2, (2, 3), "adagrad"), (2, (2, 3), "muon")])
def test_training_is_the_same_bits_whether_gradients_are_released(world, stages, recipe):
    for stage in stages:
        for rank, (released, kept) in enumerate(run_world(_both, world, stage, recipe, reuse=True)):
            where = f"world {world} {recipe} stage {stage} rank {rank}"
            assert released["losses"] == kept["losses"], (where, released["losses"], kept["losses"])
            assert released["norms"] == kept["norms"], (where, released["norms"], kept["norms"])
            assert released["final"].keys() == kept["final"].keys(), where
            assert all(torch.equal(released["final"][n], t) for n, t in kept["final"].items()), where
            assert released["moved"] == [], (where, released["moved"])


CASES = [Case(f"accum2-clip-s{s}", model="gpt", stage=s, steps=5, accum=2, clip=0.05, config=SMALL) for s in (0, 1)]


@pytest.mark.parametrize("world", [2, 3])
def test_released_bucket_gradients_train_as_ddp(world):
    for rank, out in enumerate(run_world(run_cases, world, CASES, reuse=True)):
        for case in CASES:
            r = out[case.name]
            assert r["moved"] > 1e-3, (case.name, rank)
            assert r["rel"] <= 1e-5, f"{case.name} rank {rank}: relative diff {r['rel']:.3g} against DDP"
            for n_ref, n_mine in r["norms"]:
                assert abs(n_ref - n_mine) <= 1e-6 * max(n_ref, 1e-12) + 1e-7, (case.name, n_ref, n_mine)
