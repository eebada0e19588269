"""Quantized parameter gathers (param_quant="int8") on real gloo ranks.

1. Every rank computes with bit-identical parameters after every step (all ranks'
   full parameters compared bitwise; stage 3 through gathered_parameters, i.e. a
   quantized unit gather).
2. Each parameter element is within half a quantization step of the exact fp32
   master: the bound is computed here with plain torch from the master shards
   (amax of each block of each rank's slice / 127 / 2, blocks of quant_block_numel
   elements from the start of the slice), and the difference is not 0 (the
   parameters really were quantized).
3. The master stays exact: with SGD the master after a step equals
   master_before - lr * g, g the exact average gradient computed by plain torch on
   a replica holding the dequantized parameters (what the forward computed with),
   up to fp32 rounding; a dequantized value written into the master would be off by
   up to half a step.
4. An edit through gathered_parameters(modifier_rank=0) reaches the master only
   where it changed a value; every other master element keeps its exact bits.
5. stats(): the all-gather's wire bytes are the int8 codes + scales (about 1/4 of
   the fp32 bytes plus 4 bytes per block), the logical bytes those of exact runs;
   stages 1/2 report the separate master shard.
6. A small GPT trains next to the exact run (short run; the 300-step figures come
   from benchmarks/bench_comm.py).
7. Invalid options raise before any collective.

Stages 1, 2 and 3 on 2, 3 and 4 ranks (the MLP's 2114 parameters divide by none).

Run: .venv/bin/python -m pytest -q tests/test_quant_gather.py
"""
import pytest

from cases import gpt_loss_curves
from dist_harness import run_world

BLOCK = 32


def _full_params(model, stage):
    import torch

    import zero_ext
    if stage == 3:
        with zero_ext.gathered_parameters(model):
            return torch.cat([p.detach().float().reshape(-1).clone() for p in model.parameters()])
    return torch.cat([p.detach().float().reshape(-1).clone() for p in model.parameters()])


def _spread(zo, numels, per_shard):
    """A full-length vector (engine parameter order) holding, at every element,
    per_shard's value at that element's place in its owner's shard (each element
    has one owner: every rank fills its own, then a sum all-reduce)."""
    import torch
    import torch.distributed as dist

    eng = zo._engine
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + n)
    full = torch.zeros(starts[-1])
    for i, poff, soff, n in eng.fragments(eng.rank):
        full[starts[i] + poff:starts[i] + poff + n] = per_shard[soff:soff + n]
    dist.all_reduce(full)
    return full


def _master_and_bound(zo, numels):
    """The exact fp32 master and the half-step bound of every element, full length."""
    import torch

    shards = zo._engine.param_shards()
    bound = []
    for s in shards:   # one slice of one bucket each; blocks start at the slice start
        pad = (-s.numel()) % BLOCK
        blocks = torch.cat([s.reshape(-1), s.new_zeros(pad)]).view(-1, BLOCK)
        half = blocks.abs().amax(dim=1, keepdim=True) / 127.0 / 2.0
        bound.append(half.expand(-1, BLOCK).reshape(-1)[:s.numel()])
    master = torch.cat([s.reshape(-1) for s in shards]).clone()
    return _spread(zo, numels, master), _spread(zo, numels, torch.cat(bound))


def _sgd_worker(rank, world, stage, steps):
    import copy

    import torch
    import torch.distributed as dist

    import zero_ext
    from cases import batch, build_model, loss_of

    torch.manual_seed(0)
    model = build_model("mlp")
    ref = copy.deepcopy(model)
    numels = [p.numel() for p in model.parameters()]
    lr = 0.5
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    zm, zo = zero_ext.zeroify(model, opt, stage=stage, param_quant="int8", quant_block_numel=BLOCK,
                              min_unit_numel=0)
    out = {"same_across_ranks": True, "worst_bound_ratio": 0.0, "max_quant_diff": 0.0,
           "worst_master_err": 0.0}

    def check_params():
        params = _full_params(model, stage)
        parts = [torch.empty_like(params) for _ in range(world)]
        dist.all_gather(parts, params)
        if not all(torch.equal(parts[0].view(torch.int32), p.view(torch.int32)) for p in parts):
            out["same_across_ranks"] = False
        master, bound = _master_and_bound(zo, numels)
        diff = (params - master).abs()
        ulp = torch.nextafter(master.abs(), torch.tensor(float("inf"))) - master.abs()
        out["worst_bound_ratio"] = max(out["worst_bound_ratio"],
                                       float(((diff - ulp) / bound.clamp_min(1e-30)).max()))
        out["max_quant_diff"] = max(out["max_quant_diff"], float(diff.max()))
        return params, master

    for step in range(steps):
        params, master = check_params() if step == 0 else (after_params, after_master)
        # the exact average gradient at the dequantized parameters the forward uses
        torch.nn.utils.vector_to_parameters(params, ref.parameters())
        ref.zero_grad()
        x, y = batch("mlp", rank, step, 0)
        loss_of("mlp", ref, x, y).backward()
        g = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        gabs = g.abs()                             # the sum's rounding scale (summation order differs)
        dist.all_reduce(g)
        dist.all_reduce(gabs)
        g /= world
        gabs /= world

        loss_of("mlp", zm, x, y).backward()
        zo.step()
        zo.zero_grad()
        after_params, after_master = check_params()
        want = master - lr * g
        ulp = torch.nextafter(want.abs(), torch.tensor(float("inf"))) - want.abs()
        tol = 4 * ulp + 1e-6 * lr * gabs
        out["worst_master_err"] = max(out["worst_master_err"], float(((after_master - want).abs() / tol).max()))

    # an edit through gathered_parameters reaches the master where it changed a value only
    master_before, _ = _master_and_bound(zo, numels)
    first = next(iter(model.parameters()))
    with zero_ext.gathered_parameters(model, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                first.view(-1)[5] = 0.125
    master_after, _ = _master_and_bound(zo, numels)
    changed = (master_after.view(torch.int32) != master_before.view(torch.int32)).nonzero().view(-1).tolist()
    out["edit_changed"] = changed
    out["edit_value"] = float(master_after[5])
    out["stats"] = zo.stats()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("stage,world", [(1, 2), (2, 3), (3, 4)])
def test_quantized_gather_same_on_every_rank_master_exact(stage, world):
    results = run_world(_sgd_worker, world, stage, 4, timeout_s=300, reuse=True)
    for rank, r in enumerate(results):
        assert r["same_across_ranks"], f"rank {rank}: ranks compute with different parameters"
        assert r["worst_bound_ratio"] <= 1.0, (f"rank {rank}: a parameter is {r['worst_bound_ratio']:.3f} x half a "
                                               f"quantization step away from its master")
        assert r["max_quant_diff"] > 0, "the parameters were not quantized at all"
        assert r["worst_master_err"] <= 1.0, (f"rank {rank}: the master is not the exact SGD step "
                                              f"({r['worst_master_err']:.2f} x the fp32 tolerance)")
        assert r["edit_changed"] == [5] and r["edit_value"] == 0.125, (rank, r["edit_changed"], r["edit_value"])
        s = r["stats"]
        ag = s["comm"]["all_gather"]
        assert ag["calls"] > 0 and ag["bytes"] > 0
        # int8 codes (1/4 of fp32) + one fp32 scale per BLOCK elements, rounded up per slice
        want = 1 / 4 + 1 / BLOCK
        assert want * 0.95 <= ag["wire_bytes"] / ag["bytes"] <= want * 1.3, (ag["wire_bytes"], ag["bytes"])
        assert s["param_gather_impl"] == "allgather-int8"
        if stage < 3:   # the separate fp32 master shard of fp32 parameters
            assert s["model_state_bytes"]["master_weights"] == 4 * s["shard_numel"], s["model_state_bytes"]
        assert s["buffer_bytes"]["peak_quant_gather_buffers"] > 0
        assert s["buffer_bytes"]["quant_gather_buffers"] == 0, "records held after the gathers finished"


@pytest.mark.dist
def test_quantized_gathers_follow_exact_loss():
    modes = {"exact": {}, "int8_gather": {"param_quant": "int8"},
             "int8_gather_grads": {"param_quant": "int8", "grad_quant": "int8"}}
    steps = 50
    losses = run_world(gpt_loss_curves, 2, modes, steps, 3, timeout_s=300, reuse=True)[0]
    tail = {k: sum(v[-10:]) / 10 for k, v in losses.items()}
    assert tail["exact"] < losses["exact"][0] - 0.5, f"the exact run did not learn: {tail}"
    assert losses["int8_gather"] != losses["exact"], "param_quant changed nothing"
    assert abs(tail["int8_gather"] - tail["exact"]) <= 0.03 * tail["exact"], tail
    assert abs(tail["int8_gather_grads"] - tail["exact"]) <= 0.03 * tail["exact"], tail


@pytest.mark.parametrize("kw,match", [
    ({"stage": 0, "param_quant": "int8"}, "needs stage 1, 2 or 3"),
    ({"stage": 2, "param_quant": "int4"}, "supported bit width"),
    ({"stage": 3, "param_quant": 8}, "supported bit width"),
    ({"stage": 2, "param_quant": "int8", "quant_block_numel": 9}, "must be even"),
])
def test_invalid_options_raise_before_any_collective(kw, match):
    import torch

    import zero_ext
    from cases import build_model

    model = build_model("mlp")
    with pytest.raises(ValueError, match=match):
        zero_ext.zeroify(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
