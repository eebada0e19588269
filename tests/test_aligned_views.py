"""Note [Aligned pieces] (csrc/core/zx_core.h): every parameter starts 16-byte aligned in
its bucket, so every tensor the engine hands out over the flat buffers starts aligned:
parameter views (stages 0-2, stage 3's gathered units and frozen buckets), stage 0
gradient views, and the per-fragment views of the fp32 masters and gradient shards.

The model's sizes are chosen so that packing them tight would misalign most of them
(7-wide rows, 13 outputs; 221 trainable elements, which 2, 3 and 4 do not divide), and
stats() reports what the alignment costs."""
import pytest

from dist_harness import run_world

pytestmark = pytest.mark.dist

ALIGN = 16   # bytes


def _model():
    import torch
    from torch import nn

    class OddNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(13, 7)
            self.ln = nn.LayerNorm(7)
            self.fc1 = nn.Linear(7, 13)
            self.frozen = nn.Linear(13, 5)   # not trained: stage 3 shards it in a bucket of its own
            self.fc2 = nn.Linear(5, 2)
            for p in self.frozen.parameters():
                p.requires_grad_(False)

        def forward(self, idx):
            h = torch.tanh(self.fc1(self.ln(self.emb(idx))))
            return self.fc2(torch.tanh(self.frozen(h)))

    torch.manual_seed(0)
    return OddNet()


def _misaligned(what, t, out):
    if t is not None and t.numel() > 0 and t.data_ptr() % ALIGN:
        out.append(f"{what} at {t.data_ptr() % ALIGN} mod {ALIGN}")


def _check_one(rank, stage, dtype):
    """The tensors over the engine's buffers that start misaligned, after two steps."""
    import torch

    import zero_ext

    model = _model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    kw = dict(unit_modules=["Linear", "LayerNorm", "Embedding"], min_unit_numel=0) if stage == 3 else {}
    zm, zo = zero_ext.zeroify(model, opt, stage=stage, param_dtype=dtype, **kw)
    names = {id(p): n for n, p in model.named_parameters()}
    bad = []
    if stage < 3:
        for n, p in model.named_parameters():
            if p.requires_grad:
                _misaligned(f"parameter {n}", p, bad)
    else:
        # gathered units: each module's parameters when its forward runs (after zero_ext's gather hook)
        def look(mod, _inputs):
            for p in mod.parameters(recurse=False):
                _misaligned(f"gathered {names[id(p)]}", p, bad)
        for mod in model.modules():
            if any(True for _ in mod.parameters(recurse=False)):
                mod.register_forward_pre_hook(look)
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + rank)
        idx = torch.randint(0, 13, (4, 3), generator=g)
        zm(idx).square().mean().backward()
        if stage == 0 and dtype == "fp32":   # one dtype: gradients are views of flat_grad (stage 1 shows wrappers)
            for n, p in model.named_parameters():
                if p.requires_grad:
                    _misaligned(f"gradient {n}", p.grad, bad)
        zo.step()
        zo.zero_grad()
    if stage == 3:
        with zero_ext.gathered_parameters(model):
            for n, p in model.named_parameters():
                _misaligned(f"gathered (all) {n}", p, bad)
    eng = zo._engine
    grads = eng.grad_shards() if stage >= 2 else None
    for f in eng.fragment_views():
        _misaligned(f"master of parameter {f.param} from {f.param_offset}", f.master, bad)
        if grads is not None and grads[f.bucket].numel():
            _misaligned(f"gradient shard of parameter {f.param}", grads[f.bucket].narrow(0, f.slice_offset, f.numel),
                        bad)
    for f in eng.frozen_fragment_views():
        _misaligned(f"frozen shard of {f.param}", f.master, bad)
    s = zo.stats()
    return {"bad": bad, "gaps": s["alignment_padding_numel"], "padding": s["padded_numel"] - s["num_params"],
            "psi": s["num_params"]}


def _worker(rank, world):
    out = {}
    for stage in (0, 1, 2, 3):
        for dtype in ("fp32", "bf16"):
            out[(stage, dtype)] = _check_one(rank, stage, dtype)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_view_starts_aligned(world):
    results = run_world(_worker, world, reuse=True)
    for rank, per in enumerate(results):
        for (stage, dtype), r in per.items():
            name = f"world {world} rank {rank} stage {stage} {dtype}"
            assert r["psi"] == 221 and world > 1 and r["psi"] % world, name   # the premise: world does not divide Ψ
            assert not r["bad"], f"{name}: {r['bad']}"
            # packed tight, 7-element rows leave the next parameter misaligned: gaps must exist,
            # and they are part of the reported padding
            assert 0 < r["gaps"] <= r["padding"], f"{name}: gaps {r['gaps']}, padding {r['padding']}"


def test_alignment_cost_is_reported_by_the_planner():
    """The planner with and without aligned starts, on the same sizes: the padding grows by
    the gaps it reports, which are under one alignment per parameter."""
    from zero_ext import _C

    numel = [91, 7, 7, 91, 13, 10, 2]   # OddNet's trainable parameters
    groups = [0] * len(numel)
    for dtype, per_piece in ((0, ALIGN // 4), (1, ALIGN // 2)):
        tight = _C.plan_layout(numel, groups, [], 2, 3, 1 << 20, 1 << 20, 16, dtype, param_align_bytes=0)
        aligned = _C.plan_layout(numel, groups, [], 2, 3, 1 << 20, 1 << 20, 16, dtype)
        assert sum(r[2] for r in tight) == sum(r[2] for r in aligned) == sum(numel)
        grown = sum(r[3] for r in aligned) - sum(r[3] for r in tight)
        assert 0 <= grown <= len(numel) * per_piece, (dtype, grown)
        a, b = _C.plan_alignments(16, dtype)
        assert (a, b) == (per_piece, 16)
