"""A model built on the meta device is materialized unit by
unit — it equals the unsharded model initialized with the same seed, and the peak
resident-memory growth of each rank during zeroify stays within one unit + the
shards + a bounded margin (measured from /proc, not assumed), also when the init_fn
writes each unit's weight from its parent module (the write opens the unit it
touches, and only that one)."""
import pytest
import torch
from torch import nn

from dist_harness import run_world

pytestmark = pytest.mark.dist


def gpt_init(m):
    """The same init for both sides (children before parents, as model.apply)."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)


def _equal_worker(rank, world, use_init_fn):
    import zero_ext
    from cases import TINY_GPT
    from gpt import GPT, GPTConfig

    cfg = GPTConfig(**TINY_GPT)
    with torch.device("meta"):
        meta_model = GPT(cfg)
    opt = torch.optim.AdamW(meta_model.parameters(), lr=1e-3)
    torch.manual_seed(7)
    zm, zo = zero_ext.zeroify(meta_model, opt, stage=3, unit_modules=["Block"], min_unit_numel=0,
                              init_fn=gpt_init if use_init_fn else None)
    torch.manual_seed(7)
    plain = GPT(cfg, init=False)          # constructors' own init only
    if use_init_fn:
        plain.apply(gpt_init)
    sd, ref = zm.state_dict(), plain.state_dict()
    diff = max((sd[k] - ref[k]).abs().max().item() for k in ref)
    # it trains: the optimizer holds the materialized parameters
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    loss0 = zm(x, x)[1].item()
    for _ in range(3):
        zm(x, x)[1].backward()
        zo.step()
        zo.zero_grad()
    return {"diff": diff, "tied": meta_model.lm_head.weight is meta_model.wte.weight,
            "loss0": loss0, "loss": zm(x, x)[1].item()}


def _post_order(m):
    for c in m.children():
        yield from _post_order(c)
    yield m


@pytest.mark.parametrize("use_init_fn", [True, False])
def test_meta_model_equals_unsharded(use_init_fn):
    for r in run_world(_equal_worker, 2, use_init_fn, reuse=True):
        assert r["diff"] == 0.0, r
        assert r["tied"], "the tied embedding/head stay one parameter"
        assert r["loss"] < r["loss0"], r


class Wrap(nn.Module):
    """A unit: a module whose only parameters are its child's."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return self.lin(x)


@torch.no_grad()
def seven_from_parent(m):
    if isinstance(m, Wrap):
        m.lin.weight[0].fill_(7.0)


def _rss_worker(rank, world, layers, width):
    import ctypes

    import zero_ext

    # Measure our allocations, not glibc's caching: its dynamic mmap threshold
    # otherwise keeps freed unit-sized blocks resident (users can set the same with
    # MALLOC_MMAP_THRESHOLD_=1048576). M_MMAP_THRESHOLD is -3.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    with torch.device("meta"):
        model = nn.Sequential(*[Wrap(width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    open("/proc/self/clear_refs", "w").write("5")     # reset the peak (VmHWM) to now
    base = status("VmRSS:")
    zm, zo = zero_ext.zeroify(model, opt, stage=3, unit_modules=["Wrap"], min_unit_numel=0,
                              init_fn=seven_from_parent)
    peak = status("VmHWM:") - base
    sevens = []
    for k in (0, layers - 1):
        with zero_ext.gathered_parameters(zm.module[k]):
            sevens.append(bool((zm.module[k].lin.weight[0] == 7).all()))
    psi = layers * (width * width + width)      # (released parameters show 0 elements)
    # a few steps train it
    x = torch.randn(4, width)
    for _ in range(2):
        zm(x).square().mean().backward()
        zo.step()
        zo.zero_grad()
    return {"peak": peak, "psi": psi, "unit": (width * width + width) * 4, "sevens": sevens,
            "shard": zo.stats()["model_state_bytes"]["parameters"]}


def test_meta_build_peak_memory():
    world, layers, width = 4, 16, 1536
    outs = run_world(_rss_worker, world, layers, width, timeout_s=600)
    full = outs[0]["psi"] * 4
    for rank, r in enumerate(outs):
        bound = r["unit"] + r["shard"] + 24 * 2**20
        assert r["sevens"] == [True, True], "the parent's init_fn wrote into its child"
        assert r["shard"] <= full / world * 1.01
        assert r["peak"] <= bound, (f"rank {rank}: zeroify grew RSS by {r['peak'] / 2**20:.1f} MiB; "
                                    f"one unit + shard + 24 MiB = {bound / 2**20:.1f} MiB "
                                    f"(the full model is {full / 2**20:.1f} MiB)")
        assert full > 3 * (r["unit"] + r["shard"]), "the model is several times the per-rank budget"
