"""Model-state bytes per rank follow the fp32 formulas of the README's table
(stage 0 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N, with Adam) within 1%, with
the fixed buffers reported separately — on real gloo ranks and, for large N, on
torch's fake backend (one process allocating what rank 0 of N would)."""
import pytest

from dist_harness import run_world

pytestmark = pytest.mark.dist

FORMULA = {0: lambda psi, n: 16 * psi, 1: lambda psi, n: 8 * psi + 8 * psi / n,
           2: lambda psi, n: 4 * psi + 12 * psi / n}


def _memory_worker(rank, world, stages, fake_world=None):
    import torch
    import torch.distributed as dist

    import zero_ext
    from cases import build_model, batch, loss_of

    if fake_world is not None:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=fake_world)
    out = {}
    for stage in stages:
        model = build_model("mlp_big")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        zm, zo = zero_ext.zeroify(model, opt, stage=stage)
        x, y = batch("mlp_big", rank, 0, 0)
        loss_of("mlp_big", zm, x, y).backward()
        zo.step()
        s = zo.stats()
        out[stage] = {"stats": s, "psi": sum(p.numel() for p in model.parameters())}
    if fake_world is not None:
        dist.destroy_process_group()
    return out


def _check(out, n):
    for stage, r in out.items():
        s, psi = r["stats"], r["psi"]
        assert s["world_size"] == n
        msb = s["model_state_bytes"]
        want = FORMULA[stage](psi, n)
        assert abs(msb["total"] - want) <= 0.01 * want, f"stage {stage} N={n}: {msb['total']} vs {want:.0f}"
        assert msb["total"] == msb["parameters"] + msb["gradients"] + msb["master_weights"] + msb["optimizer_states"]
        # the sharded categories are sharded
        parts = 1 if stage == 0 else n
        assert abs(msb["optimizer_states"] - 8 * psi / parts) <= 0.01 * 8 * psi / parts + 64 * n * 8
        if stage == 2:
            assert abs(msb["gradients"] - 4 * psi / n) <= 0.01 * 4 * psi / n + 64 * n * 4
            assert s["buffer_bytes"]["total"] > 0, "stage 2's gradient ring is reported separately"
        else:
            assert abs(msb["gradients"] - 4 * psi) <= 0.01 * 4 * psi


@pytest.mark.parametrize("world", [2, 3])
def test_memory_formulas_real_ranks(world):
    results = run_world(_memory_worker, world, (0, 1, 2), timeout_s=300)
    for out in results:
        _check(out, world)


@pytest.mark.parametrize("n", [8, 64, 1024])
def test_memory_formulas_fake_backend(n):
    out = run_world(_memory_worker, 1, (1, 2), n, init_pg=False, timeout_s=300)[0]
    _check(out, n)
