"""Divergent ranks are named, not hung (Note [Collective sequence check] in
csrc/engine/sequence.h): five programs in which rank 2 of 3 leaves the others'
collective sequence each end, on every rank, with one message naming rank 2, the
step and where the ranks part (phase, bucket or unit), within seconds; at step 6,
where the check exchanges nothing unless a rank leaves its learned pattern (Note
[Exchanges on deviation]), and at step 2, while it still exchanges at every phase.
The check is on by default (the workers do not ask for it). Without the check each
of them hangs (until run_world's timeout), or trains silently wrong."""
import re

import pytest

from dist_harness import run_world

pytestmark = pytest.mark.dist

WORLD, ODD = 3, 2                   # rank 2 diverges in loop iteration `at`, i.e. step at + 1
TIMEOUT_S = 2.0                     # sequence_timeout: waits longer than this compare positions


def _model():
    import torch
    from torch import nn

    class EarlyExitMLP(nn.Module):
        """Layers 1 and 2 have the same shape; an outlier batch skips layer 2 (a
        data-dependent branch, as an early exit or a router would take)."""

        def __init__(self):
            super().__init__()
            dims = [101, 331, 331, 331, 7]
            self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

        def forward(self, x, y):
            outlier = bool(x.abs().max() > 100)
            for i, layer in enumerate(self.layers):
                if i == 2 and outlier:
                    continue
                x = layer(x)
                if i < len(self.layers) - 1:
                    x = torch.tanh(x)
            return nn.functional.mse_loss(x, y)

    torch.manual_seed(0)
    return EarlyExitMLP()


def _worker(rank, world, program, stage, at, check=None):
    import time

    import torch

    import zero_ext

    model = _model()
    kw = dict(unit_modules=["Linear"]) if stage == 3 else {}
    if check is not None:
        kw["check_sequence"] = check
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage,
                              bucket_bytes=64 << 10, first_bucket_bytes=16 << 10, sequence_timeout=TIMEOUT_S, **kw)
    odd = rank == ODD
    t_div = None
    try:
        for it in range(at + 3):
            if it == at:
                t_div = time.monotonic()
            micro = 2 if program == "extra_micro" else 1
            if program == "extra_micro" and odd and it == at:
                micro = 3                                   # one more micro-step on rank 2
            for m in range(micro):
                g = torch.Generator().manual_seed(1000 * it + 10 * m + rank)
                x, y = torch.randn(8, 101, generator=g), torch.randn(8, 7, generator=g)
                if program == "unit_skip" and odd and it == at:
                    x = x * 1000                            # an outlier batch: layer 2 is skipped
                if program == "requires_grad" and odd and it == at:
                    zm.module.layers[1].weight.requires_grad_(False)
                loss = zm(x, y)
                if program == "skip_backward" and odd and it == at:
                    continue                                # rank 2 skips this backward
                loss.backward()
            if program == "skip_step" and odd and it == at:
                continue                                    # rank 2 does not call step()
            zo.step()
            zo.zero_grad()
    except RuntimeError as e:
        return {"error": str(e), "latency": time.monotonic() - t_div if t_div is not None else None}
    with torch.no_grad():
        return {"error": None, "params": torch.cat([p.detach().flatten() for p in zm.module.parameters()])}


# what the message must name besides the ranks and the step: where the ranks part
PROGRAMS = [
    ("skip_backward", 2, "backward pass"),
    ("extra_micro", 1, "backward pass 3"),
    ("unit_skip", 3, "unit 3 runs"),
    ("requires_grad", 2, "requires_grad"),
    ("skip_step", 0, "step()"),
    ("skip_step", 2, "step()"),
]


CASES = [(p, s, w, 5) for p, s, w in PROGRAMS] + [("skip_backward", 2, "backward pass", 1),
                                                   ("unit_skip", 3, "unit 3 runs", 1)]


@pytest.mark.parametrize("program,stage,where,at", CASES, ids=[f"{p}-stage{s}-step{a + 1}" for p, s, _, a in CASES])
def test_divergent_rank_is_named_on_every_rank(program, stage, where, at):
    outs = run_world(_worker, WORLD, program, stage, at, timeout_s=90)
    # the diagnosis (what follows it is the same advice on every rank)
    msgs = [(o["error"] or "").split("\nA data-dependent")[0] for o in outs]
    for rank, o in enumerate(outs):
        msg = o["error"]
        assert msg is not None, f"{program}: rank {rank} finished without an error"
        print(f"rank {rank} ({o['latency']:.1f} s after the divergent step began):\n{msg}\n")
        assert msg.startswith("zero_ext:"), msg
        assert re.search(rf"\brank {ODD}\b", msg) and "ranks 0, 1" in msg, msg
        assert f"step {at + 1}" in msg and where in msg, msg
        # The bound: every rank stops within 10 s (a hang would last 30 minutes).
        assert o["latency"] < 10.0, f"rank {rank} took {o['latency']:.1f} s"
    assert len(set(msgs)) == 1, "the ranks disagree on the diagnosis:\n" + "\n---\n".join(msgs)


def test_without_the_check_the_same_program_is_not_named():
    """The control: stage 0 with check_sequence=False runs the skip_step program. Since
    step() exchanges the unused-parameter flags (one small all-reduce), the rank that skips
    step() meets the others' flags all-reduce with its next gradient all-reduce: the job
    hangs (here until the harness's timeout) or fails without naming anyone, or, where no
    collective is left unmatched, trains silently wrong. Never the diagnosis above."""
    try:
        outs = run_world(_worker, WORLD, "skip_step", 0, 2, False, timeout_s=45)
    except Exception as e:   # a hang (TimeoutError), or a rank gloo aborted (ProcessExitedException)
        assert "sequence diverged" not in str(e), str(e)
        return
    errors = [o["error"] for o in outs]
    assert not any(e and "sequence diverged" in e for e in errors), errors
    if all(e is None for e in errors):
        assert (outs[0]["params"] == outs[1]["params"]).all()
        assert not (outs[0]["params"] == outs[ODD]["params"]).all()
