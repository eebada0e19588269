"""stage="auto": for budgets between the stages' needs, zeroify picks the stage that
fits with the fewest bytes communicated per step, both measured here on torch's fake
backend (one process allocating what a rank of N would); with no fit, it raises before
building anything, naming the smallest world size at which a stage fits."""
import re

import pytest

from dist_harness import run_world

N = 8


def _measure_and_choose(rank, world, n, pdt, rdt, accum):
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zero_ext
    from cases import batch, build_model, loss_of

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)

    def run(**options):
        model = build_model("gpt")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        zm, zo = zero_ext.zeroify(model, opt, param_dtype=pdt, reduce_dtype=rdt, **options)
        for micro in range(accum):
            x, y = batch("gpt", 0, 0, micro)
            if micro < accum - 1:
                with zm.no_sync():
                    zo.backward(loss_of("gpt", zm, x, y))
            else:
                zo.backward(loss_of("gpt", zm, x, y))
        zo.step()
        s = zo.stats()
        need = s["model_state_bytes"]["total"] + s["buffer_bytes"]["grad_ring"] + \
            s["buffer_bytes"].get("peak_gathered_params", 0) + s["buffer_bytes"]["split_master_scratch"] + \
            s["frozen_parameter_bytes"]
        return s["stage"], need, s["comm_bytes"]

    measured = {stage: run(stage=stage)[1:] for stage in range(4)}
    needs = sorted(m[0] for m in measured.values())
    budgets = [(a + b) / 2 for a, b in zip(needs, needs[1:])] + [needs[-1] * 1.5]
    chosen = {b: run(stage="auto", memory_budget=b, accumulation_steps=accum)[0] for b in budgets}
    try:
        run(stage="auto", memory_budget=needs[0] - 1)
        error = None
    except ValueError as e:
        error = str(e)
    dist.destroy_process_group()
    return measured, chosen, error


@pytest.mark.dist
@pytest.mark.parametrize("pdt,rdt,accum", [("fp32", "fp32", 1), ("bf16", "fp32", 1), ("bf16", "fp32", 2),
                                          ("bf16", "bf16", 3)])
def test_auto_picks_cheapest_fitting_stage(pdt, rdt, accum):
    measured, chosen, error = run_world(_measure_and_choose, 1, N, pdt, rdt, accum, init_pg=False,
                                        timeout_s=300)[0]
    for budget, stage in chosen.items():
        fits = [s for s, (need, _) in measured.items() if need <= budget]
        assert fits, (budget, measured)
        # fewest measured bytes per step; stages within 1% of each other tie, the lower one wins
        least = min(measured[s][1] for s in fits)
        want = min(s for s in fits if measured[s][1] <= 1.01 * least)
        assert stage == want, f"budget {budget:.0f}: chose {stage}, want {want}; measured {measured}"
    assert len(set(chosen.values())) >= 2 or pdt == "fp32", chosen   # the budget changes the choice
    assert error is not None and "no stage fits" in error, error
    smallest = int(re.search(r"smallest world size at which one fits is (\d+)", error).group(1))
    assert smallest > N


ONE_BY_ONE = dict(coalesce_numel=0)


def _fits_at(rank, world, n, budget):
    import torch

    import zero_ext
    from cases import build_model

    model = build_model("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {m: min(zero_ext.estimate_memory(model, m, s, optimizer=opt, backend="none", **ONE_BY_ONE)["total"]
                   for s in range(4)) <= budget for m in (n - 1, n)}


def test_no_fit_names_the_smallest_world_size():
    """The named N fits and N - 1 does not, on a world-size-1 process with a tiny budget.
    (Units gathered one by one: with coalescing, this 16K-parameter model's whole set of
    units fits one prefetch window, which no N shrinks.)"""
    import torch

    import zero_ext
    from cases import build_model

    model = build_model("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    budget = zero_ext.estimate_memory(model, 1, 3, optimizer=opt, **ONE_BY_ONE)["total"] / 5
    with pytest.raises(ValueError, match="no stage fits") as info:
        zero_ext.zeroify(model, opt, stage="auto", memory_budget=budget, **ONE_BY_ONE)
    n = int(re.search(r"smallest world size at which one fits is (\d+)", str(info.value)).group(1))
    fits = _fits_at(0, 1, n, budget)
    assert fits == {n - 1: False, n: True}, (n, fits)
    assert all(p.grad is None for p in model.parameters())


def test_search_and_model_state_bindings():
    """smallest_world asks a Python callable (its errors pass through); model_state_bytes's
    bad input is a ValueError (csrc/engine/model_state.h, checked row by row in
    csrc/core/tests/test_model_state.cpp)."""
    from zero_ext._C import model_state_bytes, smallest_world

    asked = []
    assert smallest_world(1, 1 << 24, lambda n: asked.append(n) or n >= 5) == 5 and asked == [2, 4, 8, 6, 5]
    assert smallest_world(1, 2, lambda n: False) == 0
    with pytest.raises(KeyError):
        smallest_world(1, 8, lambda n: {}[n])
    with pytest.raises(ValueError, match="one group, padded and shard count per bucket"):
        model_state_bytes([0], [1, 2], [1], stage=2, world=2, param_bytes=4, reduce_bytes=4, state_bytes=4,
                          states_per_group=[2], fused=True, adam=True, param_quant=False, grad_quant=False,
                          offload=False, alltoall=False, master_remainder=False, on_gpu=False,
                          step_in_backward=False)
