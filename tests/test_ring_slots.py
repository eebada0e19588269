"""The gradient ring of stages 2-3 on gloo's all-to-all reduce-scatter (csrc/engine/grad_ring.h):

- Note [Ring slot lifetime]: a slot's receive buffer lives only while a bucket holds the slot.
  Sampled at every module's backward, the ring's held bytes reach what a step needs
  (buffer_bytes) and no more; once backward is over they are less (the send buffers alone),
  at 2 and 3 ranks.
- Note [Narrow gradient wire] (csrc/engine/reducer.cpp): with bf16 parameters and fp32 reduction
  the ring needs half the bytes of fp32 parameters' ring, and the reduce-scatter carries fewer
  bytes than it counts; the training is bit-identical to gloo's native reduce_scatter at 2
  ranks (a sum of two is the same either way), with no_sync's widened buckets too.
"""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_world

pytestmark = pytest.mark.dist


def _sampled(rank, world, stage, pdt, coalesce_numel=16384):
    import zero_ext
    from cases import batch, build_model, loss_of
    model = build_model("gpt")
    kw = dict(unit_modules=["Block"]) if stage == 3 else {}
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage,
                              param_dtype=pdt, coalesce_numel=coalesce_numel, **kw)
    seen = []
    for m in zm.modules():
        m.register_full_backward_pre_hook(lambda *_: seen.append(zo.stats()["held_bytes"]["grad_ring"]))
    for it in range(2):
        x, y = batch("gpt", rank, it, 0)
        loss_of("gpt", zm, x, y).backward()
        after = zo.stats()["held_bytes"]["grad_ring"]
        zo.step()
        zo.zero_grad()
    s = zo.stats()
    return {"seen": seen, "after": after, "need": s["buffer_bytes"]["grad_ring"],
            "rs": s["comm"]["reduce_scatter"]}


@pytest.mark.parametrize("world", [2, 3])
def test_receive_buffers_live_while_a_bucket_holds_the_slot(world):
    for stage in (2, 3):
        for rank, o in enumerate(run_world(_sampled, world, stage, "fp32", reuse=True)):
            where = f"world {world} stage {stage} rank {rank}: {o}"
            assert max(o["seen"]) == o["need"] and 0 < o["after"] < o["need"], where


def test_narrow_wire_halves_the_ring():
    wide = run_world(_sampled, 2, 3, "fp32", 0, reuse=True)[0]
    narrow = run_world(_sampled, 2, 3, "bf16", 0, reuse=True)[0]
    assert narrow["need"] * 2 == wide["need"], (narrow["need"], wide["need"])
    assert 0 < max(narrow["seen"]) <= narrow["need"]
    rs = narrow["rs"]   # each unit its own all-to-all (coalesced groups send reduce_dtype)
    assert rs["calls"] > 2 and rs["wire_bytes"] * 2 == rs["bytes"], rs


def _train(rank, world, stage, pdt, reduce_scatter, nosync):
    import zero_ext
    from cases import batch, build_model, loss_of
    model = build_model("gpt")
    kw = dict(unit_modules=["Block"], coalesce_numel=0) if stage == 3 else {}   # every unit its own reduction
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage,
                              param_dtype=pdt, reduce_scatter=reduce_scatter, **kw)
    losses = []
    for it in range(3):
        for micro in range(2 if nosync else 1):
            x, y = batch("gpt", rank, it, micro)
            if nosync and micro == 0:
                with zm.no_sync():
                    loss_of("gpt", zm, x, y).backward()
            else:
                loss = loss_of("gpt", zm, x, y)
                loss.backward()
                losses.append(loss.item())
        zo.step()
        zo.zero_grad()
    with zero_ext.gathered_parameters(zm):
        params = [p.detach().float().clone() for p in zm.parameters()]
    return losses, params


@pytest.mark.parametrize("pdt", ["bf16", "fp16"])
def test_narrow_wire_trains_as_native_reduce_scatter(pdt):
    for stage in (2, 3):
        for nosync in (False, True):
            a = run_world(_train, 2, stage, pdt, "alltoall", nosync, reuse=True)[0]
            b = run_world(_train, 2, stage, pdt, "native", nosync, reuse=True)[0]
            where = f"stage {stage} {pdt} nosync={nosync}"
            assert a[0] == b[0], where
            assert all(torch.equal(x, y) for x, y in zip(a[1], b[1])), where
