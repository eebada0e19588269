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
