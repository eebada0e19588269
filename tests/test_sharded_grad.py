"""p.grad on a zeroified model answers what DDP's p.grad answers (Note [Sharded gradients]
in zero_ext/sharded_grad.py): per-parameter norms (2, 1, inf), max, min, sum / max / mean of abs
and square, torch.nn.utils.get_total_norm, Lightning's grad_norm-style logging, before and
after clipping (torch's clip_grad_norm_ and clip_grads_with_norm_), with accumulation under
no_sync, in stages 1-3, fp32 and bf16, at 2 and 3 ranks (sizes no world size divides).
What cannot be answered without the full values raises ZeroUsageError naming what works,
and a rank reading a gradient norm alone is named on every rank."""
import math

import pytest
import torch

from dist_harness import run_world

pytestmark = pytest.mark.dist

REL = {"fp32": 1e-5, "bf16": 2e-2}


def _stats(params, names):
    """What a training script logs about its gradients, from p.grad alone."""
    out = {}
    grads = {n: p.grad for n, p in zip(names, params)}
    for n, g in grads.items():
        out[f"{n}/norm2"] = float(g.norm())
        out[f"{n}/norm1"] = float(g.norm(1))
        out[f"{n}/norminf"] = float(torch.linalg.vector_norm(g, math.inf))
        out[f"{n}/absmax"] = float(g.abs().max())
        out[f"{n}/max"] = float(g.max())
        out[f"{n}/min"] = float(g.amin())
        out[f"{n}/sqsum"] = float(g.pow(2).sum())
        out[f"{n}/mean"] = float(g.data.mean())
        out[f"{n}/meanabs"] = float(g.abs().mean())
    out["total2"] = float(torch.nn.utils.get_total_norm([grads[n] for n in names]))
    out["totalinf"] = float(torch.nn.utils.get_total_norm([grads[n] for n in names], math.inf))
    # Lightning's grad_norm: p.grad.data.norm(p) per parameter, then the norm of those
    norms = {n: g.data.norm(2) for n, g in grads.items()}
    out["lightning_total"] = float(torch.tensor(list(norms.values())).norm(2))
    return out


def _worker(rank, world, stage, dtype):
    import copy

    import zero_ext
    from cases import batch, build_model, loss_of

    base = build_model("gpt")
    ref = copy.deepcopy(base)
    ddp = torch.nn.parallel.DistributedDataParallel(ref)
    mine = copy.deepcopy(base)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    zm, zo = zero_ext.zeroify(mine, torch.optim.AdamW(mine.parameters(), lr=1e-3), stage=stage, param_dtype=dtype,
                              **(dict(unit_modules=["Block"]) if stage == 3 else {}))
    names = [n for n, _ in ref.named_parameters()]
    rows = []
    for step in range(3):
        for micro in range(2):           # accumulation: the first micro-step under no_sync
            x, y = batch("gpt", rank, step, micro)
            with (ddp.no_sync() if micro == 0 else torch.enable_grad()):
                (loss_of("gpt", ddp, x, y) / 2).backward()
            with (zm.no_sync() if micro == 0 else torch.enable_grad()):
                (loss_of("gpt", zm, x, y) / 2).backward()
        pair = {"before": (_stats(list(ref.parameters()), names), _stats(list(mine.parameters()), names))}
        if step == 1:                    # torch's two-part clipping
            total = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
            torch.nn.utils.clip_grads_with_norm_(ref.parameters(), 0.05, total)
            total_m = torch.nn.utils.get_total_norm([p.grad for p in mine.parameters()])
            torch.nn.utils.clip_grads_with_norm_(mine.parameters(), 0.05, total_m)
        else:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            torch.nn.utils.clip_grad_norm_(mine.parameters(), 0.05)
        pair["clipped"] = (_stats(list(ref.parameters()), names), _stats(list(mine.parameters()), names))
        rows.append(pair)
        opt_ref.step()
        opt_ref.zero_grad()
        zo.step()
        zo.zero_grad()
    # what cannot be answered: the values themselves
    loss_of("gpt", zm, *batch("gpt", rank, 9, 0)).backward()
    g = next(mine.parameters()).grad
    refused = {}
    for what, fn in (("index", lambda: g[0]), ("add", lambda: g + 1), ("clone", lambda: g.clone()),
                     ("copy out", lambda: torch.zeros(g.shape).copy_(g))):
        try:
            fn()
            refused[what] = None
        except zero_ext.ZeroUsageError as e:
            refused[what] = str(e)
    after = {"repr": repr(g), "shape": tuple(g.shape), "dtype": str(g.dtype)}
    zo.zero_grad()
    return {"rows": rows, "refused": refused, "after": after,
            "shape": tuple(next(ref.parameters()).shape), "none_after_zero_grad":
                all(p.grad is None for p in mine.parameters())}


def _close(a, b, rel):
    return abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-12


def _signed_close(k: str, a: float, b: float, ddp: dict, dtype: str) -> bool:
    """A signed mean cancels: its bound is relative to the mean of |g|. A signed max or min is one
    element, in bf16 off by its own rounding (a few %; the norms average it out): checked in fp32."""
    name, _, stat = k.rpartition("/")
    if stat in ("max", "min"):
        return dtype == "bf16" or abs(a - b) <= REL[dtype] * ddp[f"{name}/absmax"]
    return stat == "mean" and abs(a - b) <= REL[dtype] * ddp[f"{name}/meanabs"]


@pytest.mark.parametrize("world", [2, 3])
def test_grads_answer_as_ddp(world):
    cases = [(1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16")] if world == 2 else \
        [(1, "fp32"), (3, "fp32")]
    for stage, dtype in cases:
        outs = run_world(_worker, world, stage, dtype, timeout_s=300, reuse=True)
        for rank, out in enumerate(outs):
            where = f"stage {stage} {dtype} rank {rank}/{world}"
            for step, pair in enumerate(out["rows"]):
                for when, (ddp, mine) in pair.items():
                    bad = {k: (v, mine[k]) for k, v in ddp.items()
                           if not (_close(v, mine[k], REL[dtype]) or _signed_close(k, v, mine[k], ddp, dtype))}
                    assert not bad, f"{where} step {step} {when}: differs from DDP's p.grad: {bad}"
                    assert ddp["total2"] > 0
                assert pair["clipped"][1]["total2"] < pair["before"][1]["total2"], f"{where}: clipping not seen"
            for what, msg in out["refused"].items():
                assert msg and "sharded" in msg and "norm" in msg and "clip_grad_norm_" in msg, (where, what, msg)
            assert out["after"]["shape"] == out["shape"] and "ShardedGrad" in out["after"]["repr"], out["after"]
            assert out["none_after_zero_grad"], where


def _alone(rank, world):
    import time

    import zero_ext
    from cases import batch, build_model, loss_of
    model = build_model("gpt")
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2)
    t0 = None
    try:
        for step in range(6):
            loss_of("gpt", zm, *batch("gpt", rank, step, 0)).backward()
            if step == 4:
                t0 = time.monotonic()
                if rank == 0:            # rank-0-only logging of a sharded gradient's norm
                    print(float(next(model.parameters()).grad.norm()))
            zo.step()
            zo.zero_grad()
    except RuntimeError as e:
        return {"error": str(e), "latency": time.monotonic() - t0}
    _ = zero_ext
    return {"error": None}


def test_rank0_alone_reading_a_norm_is_named():
    for rank, r in enumerate(run_world(_alone, 2, timeout_s=120)):
        assert r["error"] and "rank 0" in r["error"] and "norm of sharded gradients" in r["error"], (rank, r)
        assert "every rank" in r["error"] and r["latency"] < 10, (rank, r)
