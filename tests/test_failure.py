"""A rank that dies mid-training makes the others fail fast with a message that
says what happened, instead of hanging (the process group's own error, wrapped)."""
import time

import pytest

from dist_harness import run_world

pytestmark = pytest.mark.dist


def _dying_worker(rank, world, stage, die_at):
    import os

    import torch

    import zero_ext
    from cases import batch, build_model, loss_of

    model = build_model("mlp")
    kw = dict(unit_modules=["Linear"]) if stage == 3 else {}
    # a rank that sees a peer fail waits 2 x sequence_timeout for the others' reports before
    # it raises (Note [Collective sequence check]): 2 s here instead of the default 6
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), stage=stage, sequence_timeout=1.0,
                              **kw)
    for step in range(10):
        if rank == world - 1 and step == die_at:
            os._exit(0)                      # gone without a word, sockets closed
        x, y = batch("mlp", rank, step, 0)
        loss_of("mlp", zm, x, y).backward()
        zo.step()
        zo.zero_grad()
    return "finished"


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_dead_rank_fails_the_others_fast(stage):
    t0 = time.monotonic()
    outs = run_world(_dying_worker, 3, stage, 3, timeout_s=120, expect_errors=True)
    elapsed = time.monotonic() - t0
    assert outs[2]["error"] == "exited without a result"
    for rank in (0, 1):
        assert not outs[rank]["ok"], f"rank {rank} finished although a peer died"
        msg = outs[rank]["error"]
        assert "zero_ext:" in msg and "Another rank probably died" in msg, msg
    assert elapsed < 100, f"took {elapsed:.0f}s"
