"""Stage 3 learns each pass's unit sequence (forward, backward and recomputation),
so that steady-state steps gather nothing they did not prefetch
(stats()["out_of_order_fetches"] stays constant after the first steps), for models
whose order is not "registration order, then its reverse" (tests/prefetch_models.py):
a T5-style encoder-decoder, a GPT under activation checkpointing with automatic
units, and a head registered before the trunk that feeds it — at 2 and 3 gloo
ranks, each trained next to DDP with the same data and ending at DDP's parameters.

Run: .venv/bin/python -m pytest -q tests/test_prefetch.py
"""
import pytest

from cases import Case, run_cases
from dist_harness import run_world
from test_parity import check

WARMUP_STEPS = 2     # the first step runs on the registration-order guess, the second on step 1's record


def prefetch_cases():
    return [
        Case("encdec-auto", model="encdec", stage=3, steps=8),
        Case("encdec-sublayers", model="encdec", stage=3, steps=8,
             config=dict(unit_modules=["Attention", "Sequential"], min_unit_numel=0)),
        Case("gpt-ckpt-auto", model="gpt_ckpt", stage=3, steps=8),
        Case("gpt-ckpt-linear", model="gpt_ckpt", stage=3, steps=8,
             config=dict(unit_modules=["Linear"], min_unit_numel=0, prefetch_depth=2)),
        Case("head-late-auto", model="head_late", stage=3, steps=8, config=dict(min_unit_numel=0)),
        Case("head-late-linear", model="head_late", stage=3, steps=8,
             config=dict(unit_modules=["Linear", "Sequential"], min_unit_numel=0)),
    ]


def steps_of(cumulative):
    return [b - a for a, b in zip([0] + cumulative, cumulative)]


@pytest.mark.parametrize("world", [2, 3])
def test_steady_state_prefetches_every_unit(world):
    cases = prefetch_cases()
    results = run_world(run_cases, world, cases, timeout_s=600)
    for rank, res in enumerate(results):
        for case in cases:
            r, name = res[case.name], f"world {world} rank {rank} {case.name}"
            check(name, r, "adamw")
            assert r["stats"]["num_units"] >= 3, f"{name}: {r['stats']['num_units']} units"
            per_step = steps_of(r["unforeseen"])
            assert per_step[WARMUP_STEPS:] == [0] * (case.steps - WARMUP_STEPS), (
                f"{name}: gathers not prefetched per step: {per_step}")
            # and nothing is gathered twice for one need: at most forward + backward
            s = r["stats"]
            padded = r["psi"] + s["padded_numel"] - s["num_params"]
            gathered = steps_of(r["gathered"])[WARMUP_STEPS:]
            assert max(gathered) <= 2 * padded, f"{name}: all-gathered {gathered} per step, 2Ψ = {2 * padded}"


@pytest.mark.parametrize("world", [2, 3])
def test_small_units_share_collectives(world):
    """Note [Coalesced unit gathers]: 24 blocks of ~300 parameters, each block a unit.
    With coalescing (the default) a steady step all-gathers the same elements as one
    collective per unit and pass does (coalesce_numel=0), in at most a quarter of the
    collectives; both runs end at DDP's parameters and prefetch every unit."""
    units = dict(unit_modules=["TinyBlock"], min_unit_numel=0)
    cases = [Case("tiny-coalesced", model="tiny_blocks", stage=3, steps=6, config=dict(units)),
             Case("tiny-one-by-one", model="tiny_blocks", stage=3, steps=6, config=dict(units, coalesce_numel=0))]
    results = run_world(run_cases, world, cases, timeout_s=300)
    for rank, res in enumerate(results):
        for case in cases:
            r, name = res[case.name], f"world {world} rank {rank} {case.name}"
            check(name, r, "adamw")
            assert steps_of(r["unforeseen"])[WARMUP_STEPS:] == [0] * (case.steps - WARMUP_STEPS), name
        co, one = res["tiny-coalesced"], res["tiny-one-by-one"]
        n_units = co["stats"]["num_units"] - 1          # the root unit stays gathered
        calls_co = steps_of(co["gather_calls"])[WARMUP_STEPS:]
        calls_one = steps_of(one["gather_calls"])[WARMUP_STEPS:]
        assert min(calls_one) >= 2 * n_units - 2, f"rank {rank}: one by one {calls_one} for {n_units} units"
        assert 4 * max(calls_co) <= min(calls_one), f"rank {rank}: coalesced {calls_co} vs one by one {calls_one}"
        assert steps_of(co["gathered"])[WARMUP_STEPS:] == steps_of(one["gathered"])[WARMUP_STEPS:], (
            f"rank {rank}: the same elements are gathered either way")
