"""torch's clipping utilities on a zeroified model, as DDP scripts call them (Note
[torch's clipping utilities] in zero_ext/torch_utils.py).

`torch.nn.utils.clip_grad_norm_(model.parameters(), c)` and `clip_grad_value_` in every
stage, norm types 2 and inf, torch's foreach and per-tensor paths, with gradient
accumulation: the total norm torch returns on the zeroified model equals the one it
returns on DDP's (rel 1e-6), and training matches DDP + torch's optimizer within
test_parity's bounds. Before the wrapper, stages 2-3 saw p.grad None (a norm of 0,
nothing clipped) and stage 1 unreduced gradients, so these comparisons failed. A call
over part of a model's parameters, or over two models at once, raises ZeroUsageError
naming optimizer.clip_grad_norm_; parameters of no zeroified model go to torch unchanged.
"""
import math

import pytest
import torch

from cases import Case, run_cases
from dist_harness import run_world
from test_parity import check

pytestmark = pytest.mark.dist


def clip_cases():
    cases = []
    for stage in (0, 1, 2, 3):
        for norm_type, foreach in ((2.0, True), (2.0, False), (math.inf, None)):
            tag = "inf" if norm_type == math.inf else f"l2-{'foreach' if foreach else 'loop'}"
            cases.append(Case(f"torch-clip-{tag}-s{stage}", model="gpt", stage=stage, clip=0.05, steps=8,
                              torch_clip=dict(norm_type=norm_type, foreach=foreach)))
        cases.append(Case(f"torch-clip-accum2-s{stage}", model="mlp", stage=stage, clip=0.05, accum=2, steps=8,
                          torch_clip=dict(norm_type=2.0)))
        cases.append(Case(f"torch-clip-value-s{stage}", model="gpt", stage=stage, clip_value=2e-3, steps=8,
                          optimizer="sgd"))
    return cases


@pytest.mark.parametrize("world", [2, 3])
def test_torch_clipping_matches_ddp(world):
    cases = clip_cases()
    results = run_world(run_cases, world, cases, timeout_s=900, reuse=True)
    for rank, res in enumerate(results):
        for case in cases:
            r = res[case.name]
            check(f"world {world} rank {rank} {case.name}", r, case.optimizer)
            if case.clip is not None:
                assert len(r["norms"]) == case.steps and all(n > 0 for n, _ in r["norms"]), (case.name, r["norms"])
                clipped = sum(n > case.clip for n, _ in r["norms"])
                assert clipped > 0, f"{case.name}: no step had a norm over {case.clip}: the case clips nothing"


def _misuse_worker(rank, world):
    import zero_ext
    from zero_ext import ZeroUsageError

    out = {}
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    za, oa = zero_ext.zeroify(a, torch.optim.SGD(a.parameters(), lr=0.1), stage=2)
    zb, ob = zero_ext.zeroify(b, torch.optim.SGD(b.parameters(), lr=0.1), stage=2)
    x = torch.randn(4, 8)
    (za(x).sum() + zb(x).sum()).backward()
    for name, call in (
            ("subset", lambda: torch.nn.utils.clip_grad_norm_([a.weight], 1.0)),
            ("two models", lambda: torch.nn.utils.clip_grad_norm_(list(za.parameters()) + list(zb.parameters()), 1.0)),
            ("value subset", lambda: torch.nn.utils.clip_grad_value_(a.bias, 1.0))):
        try:
            call()
            out[name] = None
        except ZeroUsageError as e:
            out[name] = str(e)
    plain = torch.nn.Linear(8, 8)
    plain(x).sum().backward()
    out["plain"] = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9))
    out["plain_ref"] = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in plain.parameters()])))
    return out


def test_partial_or_mixed_calls_are_refused():
    for rank, out in enumerate(run_world(_misuse_worker, 2)):
        for name in ("subset", "two models", "value subset"):
            assert out[name] is not None, f"rank {rank}: {name}: torch's clipping ran silently on sharded gradients"
            assert "optimizer.clip_grad_norm_" in out[name], out[name]
        assert math.isclose(out["plain"], out["plain_ref"], rel_tol=1e-6), out
