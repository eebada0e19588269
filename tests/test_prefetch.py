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
import torch

from cases import Case, run_cases
from dist_harness import run_world
from test_parity import check

pytestmark = pytest.mark.dist

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
    results = run_world(run_cases, world, cases, timeout_s=600, reuse=True)
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
    results = run_world(run_cases, world, cases, timeout_s=300, reuse=True)
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


class _SkipNet:
    """Built inside the worker: three Linear units, the middle one skipped on odd steps."""

    @staticmethod
    def build():
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b, self.c = (torch.nn.Linear(32, 32) for _ in range(3))

            def forward(self, x, skip):
                x = torch.tanh(self.a(x))
                if not skip:
                    x = torch.tanh(self.b(x))
                return self.c(x).square().mean()

        torch.manual_seed(0)
        return Net()


def _skipped_unit_worker(rank, world):
    import copy

    import torch

    import zero_ext

    model = _SkipNet.build()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    zm, zo = zero_ext.zeroify(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3,
                              unit_modules=["Linear"], min_unit_numel=0, coalesce_numel=0,
                              find_unused_parameters=True)   # b is skipped at odd steps, as DDP needs it
    held = []
    for step in range(6):
        xs = [torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * r + step)) for r in range(world)]
        zm(xs[rank], skip=step % 2 == 1).backward()
        zo.step()
        zo.zero_grad()
        held.append(zo.stats()["buffer_bytes"]["gathered_params"])
        # the same step on one replica: the mean of every rank's loss
        (sum(ref(x, skip=step % 2 == 1) for x in xs) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with zero_ext.gathered_parameters(zm):
        ours = [p.detach().clone() for p in zm.module.parameters()]
    return held, ours, [p.detach().clone() for p in ref.parameters()]


def test_skipped_unit_is_released():
    """A unit prefetched from the previous pass's sequence but skipped by this pass
    (a data-dependent branch) is freed and uncounted at the end of the step: after
    every step no unit stays gathered (stats' gathered_params is 0), and training
    matches one plain torch replica."""
    for rank, (held, ours, ref) in enumerate(run_world(_skipped_unit_worker, 2, reuse=True)):
        assert held == [0] * len(held), f"rank {rank}: bytes still gathered after each step: {held}"
        for a, b in zip(ours, ref):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"rank {rank}: {(a - b).abs().max():.2e}"
