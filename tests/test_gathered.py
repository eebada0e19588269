"""zero_ext.gathered_parameters — an edit made on the modifier
rank is visible on every rank afterwards (and training goes on from it, identically
on all ranks); without a modifier rank the parameters are read-only."""
import pytest

from dist_harness import run_world

pytestmark = pytest.mark.dist


def _worker(rank, world, stage, dtype="fp32"):
    import torch

    import zero_ext
    from cases import batch, build_model, loss_of

    model = build_model("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    kw = dict(unit_modules=["Block"], min_unit_numel=0) if stage == 3 else {}
    zm, zo = zero_ext.zeroify(model, opt, stage=stage, param_dtype=dtype, **kw)
    block = model.blocks[1]
    eng = zo._engine

    def step(s):
        x, y = batch("gpt", rank, s, 0)
        loss_of("gpt", zm, x, y).backward()
        zo.step()
        zo.zero_grad()

    step(0)
    masters_before = torch.cat([s.clone() for s in eng.param_shards()])
    with zero_ext.gathered_parameters(block, modifier_rank=1), torch.no_grad():
        full_shape = tuple(block.mlp.fc.weight.shape)
        if rank == 1:
            block.mlp.fc.weight.fill_(0.25)        # only rank 1 writes
    seen = zm.state_dict()["blocks.1.mlp.fc.weight"]
    edited = bool((seen == 0.25).all())
    # The fp32 masters: the edited elements are 0.25, every other one kept its bits
    # (with bf16 parameters, untouched elements must not be rounded to bf16).
    masters = torch.cat([s.clone() for s in eng.param_shards()])
    fc = {i for i, p in enumerate(zo._params) if p is block.mlp.fc.weight}
    in_fc = torch.zeros(masters.numel(), dtype=torch.bool)
    for i, po, so, k in eng.fragments(0 if stage == 0 else rank):
        if i in fc:
            in_fc[so:so + k] = True
    masters_ok = bool((masters[in_fc] == 0.25).all()) and torch.equal(masters[~in_fc], masters_before[~in_fc])
    with zero_ext.gathered_parameters([block.mlp.fc.weight]):
        readable = float(block.mlp.fc.weight.sum())
    try:
        with zero_ext.gathered_parameters(block), torch.no_grad():
            block.ln_1.weight.add_(1.0)
        read_only = ""
    except RuntimeError as e:
        read_only = str(e)
    step(1)
    after = {k: v.clone() for k, v in zm.state_dict().items()}
    return {"edited": edited, "masters_ok": masters_ok, "full_shape": full_shape, "readable": readable, "read_only": read_only,
            "after": after}


@pytest.mark.parametrize("stage, dtype", [(1, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16")])
def test_gathered_parameters(stage, dtype):
    outs = run_world(_worker, 2, stage, dtype, reuse=True)
    for rank, r in enumerate(outs):
        assert r["edited"], f"rank {rank}: rank 1's edit is not visible"
        assert r["masters_ok"], f"rank {rank}: the fp32 master does not hold exactly the edit"
        assert r["full_shape"] == (96, 24), r["full_shape"]
        assert r["readable"] == pytest.approx(0.25 * 96 * 24)
        assert "read-only" in r["read_only"], r["read_only"]
    for k, v in outs[0]["after"].items():   # training continued identically on both ranks
        assert (v - outs[1]["after"][k]).abs().max().item() <= 1e-6, k
