"""Meta-device builds lose nothing (zero_ext/materialize.py, Note [Meta builds
lose nothing]).

* An init_fn that, called on a parent, writes a child's parameter (value 7) lands, in
  every unit layout (parent and child in one unit, the child in a unit of its own, the
  root writing into another unit), fp32 and bf16 (where a unit is opened again after
  its commit), 2 and 3 ranks; everything else equals, bit for bit, the model built on
  the CPU with the same seed and model.apply(init_fn)'d.
* Whatever nothing initializes (a parameter without reset_parameters(), a frozen one,
  half of one, a buffer computed in a constructor under torch.device("meta")) raises on
  every rank, naming it and the fix; under zero_ext.meta_parameters() the buffer is
  computed and the build equals the CPU one, buffers included.
* Hugging Face models from small configs: GPT-2 and T5 built on meta with
  init_fn=model._init_weights have, tensor by tensor, the standard deviation of the
  normally built model within 5% (constant tensors equal); Llama with init_fn=None
  raises (its RMSNorm weights and RoPE inv_freq have no reset_parameters()); with
  init_fn=model._init_weights, Llama's inv_freq and BERT's position_ids equal the
  normally built model's.
"""
import contextlib
import functools

import pytest
import torch
from torch import nn

from dist_harness import run_world

pytestmark = pytest.mark.dist

D = 24


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x + self.lin(self.norm(x))


class Net(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.inp = nn.Linear(5, D)
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@torch.no_grad()
def parent_writes_child(m):
    """Writes children's parameters from their parents only (as HF's _init_weights)."""
    if isinstance(m, Block):
        m.lin.weight.fill_(7.0)
    elif isinstance(m, Net):
        m.head.bias.fill_(7.0)          # the root writes into the head's unit


LAYOUTS = {"block": dict(unit_modules=["Block"], min_unit_numel=0),
           "linear": dict(unit_modules=["Linear"], min_unit_numel=0),
           "auto": dict(unit_numel=700, min_unit_numel=0)}


def _masters(zm, zo):
    """Rank 0: the fp32 master values by name (None elsewhere)."""
    import zero_ext
    full = zero_ext.consolidated_state_dict(zm, zo, to=0)
    return None if full is None else {k: v.clone() for k, v in full["model"].items()}


def _lands_worker(rank, world):
    import zero_ext
    out = {}
    for layout, opts in LAYOUTS.items():
        for dtype in ("fp32", "bf16"):
            with torch.device("meta"):
                model = Net()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            torch.manual_seed(11)
            zm, zo = zero_ext.zeroify(model, opt, stage=3, param_dtype=dtype, init_fn=parent_writes_child, **opts)
            got = _masters(zm, zo)
            zm(torch.randn(4, 5)).square().mean().backward()      # it trains
            zo.step()
            if got is not None:
                torch.manual_seed(11)
                plain = Net()
                plain.apply(parent_writes_child)
                ref = plain.state_dict()
                out[(layout, dtype)] = {
                    "sevens": all(bool((got[f"blocks.{i}.lin.weight"].reshape(-1) == 7).all()) for i in range(3))
                    and bool((got["head.bias"] == 7).all()),
                    "differ": [k for k in ref if not torch.equal(got[k].reshape(ref[k].shape), ref[k])],
                    "units": zo.stats()["num_units"]}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_parent_init_lands_in_every_layout(world):
    res = run_world(_lands_worker, world, reuse=True)[0]
    for key, r in res.items():
        assert r["sevens"], f"{key}: a parent's write of 7 into its child's parameter was lost"
        assert r["differ"] == [], f"{key}: differs from the CPU build with the same seed: {r['differ']}"
    assert res[("linear", "fp32")]["units"] > res[("block", "fp32")]["units"] > 1


class Scale(nn.Module):
    """A parameter set in the constructor, no reset_parameters() (as HF's RMSNorm)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))

    def forward(self, x):
        return x * self.weight


class Table(nn.Module):
    """A buffer computed from the configuration in the constructor (as RoPE's inv_freq)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freq", 1.0 / 10000 ** (torch.arange(0, D, dtype=torch.float32) / D))
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return self.lin(x) * self.freq


def _build(kind: str, ctx):
    with ctx():
        if kind == "scale":
            return nn.Sequential(nn.Linear(D, D), Scale())
        if kind == "frozen":
            m = nn.Sequential(nn.Linear(D, D), Scale())
            m[1].weight.requires_grad_(False)
            return m
        return nn.Sequential(nn.Linear(D, D), Table())


@torch.no_grad()
def _half(m):
    if isinstance(m, Scale):
        m.weight[: D // 2].fill_(1.0)


@torch.no_grad()
def _full(m):
    if isinstance(m, Scale):
        m.weight.fill_(1.0)


def _refuse_worker(rank, world):
    import zero_ext
    meta = functools.partial(torch.device, "meta")
    cases = {"scale": ("scale", meta, None), "frozen": ("frozen", meta, None), "half": ("scale", meta, _half),
             "buffer": ("table", meta, None), "scale_init": ("scale", meta, _full),
             "buffer_meta_parameters": ("table", zero_ext.meta_parameters, None)}
    out = {}
    for name, (kind, ctx, init_fn) in cases.items():
        model = _build(kind, ctx)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        torch.manual_seed(5)
        try:
            zm, zo = zero_ext.zeroify(model, opt, stage=3, unit_modules=["Linear"], min_unit_numel=0,
                                      init_fn=init_fn)
        except RuntimeError as e:
            out[name] = {"error": str(e)}
            continue
        sd = zm.state_dict()
        torch.manual_seed(5)
        plain = _build(kind, contextlib.nullcontext)
        if init_fn is not None:
            plain.apply(init_fn)
        ref = plain.state_dict()
        out[name] = {"differ": [k for k in ref if not torch.equal(sd[k], ref[k])], "keys": sorted(sd),
                     "buffers_equal": all(torch.equal(a, b) for a, b in zip(zm.module.buffers(), plain.buffers()))}
    return out


def test_uninitialized_tensors_raise_on_every_rank():
    outs = run_world(_refuse_worker, 2)
    for rank, out in enumerate(outs):
        for case, needle in (("scale", "parameter '1.weight' (Scale)"), ("frozen", "parameter '1.weight' (Scale)"),
                             ("half", "parameter '1.weight' (Scale)"), ("buffer", "buffer '1.freq' (Table)")):
            msg = out[case].get("error", "")
            assert needle in msg, f"rank {rank}, {case}: {out[case]}"
            assert "init_fn=model._init_weights" in msg and "zero_ext.meta_parameters()" in msg, msg
        for case in ("scale_init", "buffer_meta_parameters"):
            assert "error" not in out[case], f"rank {rank}, {case}: {out[case]}"
            assert out[case]["differ"] == [], f"rank {rank}, {case}: {out[case]}"
        assert "1.freq" in out["buffer_meta_parameters"]["keys"] and out["buffer_meta_parameters"]["buffers_equal"]


# ----------------------------------------------------------------------------- Hugging Face

def hf_configs():
    """Small configs whose random tensors have >= 8192 elements each, so that two
    independent draws' standard deviations agree to ~1% (5% is > 4 sigma)."""
    from transformers import (BertConfig, BertForPreTraining, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM, T5Config, T5ForConditionalGeneration)
    return {
        "gpt2": (GPT2LMHeadModel, GPT2Config(vocab_size=256, n_positions=128, n_embd=128, n_layer=2, n_head=4)),
        "t5": (T5ForConditionalGeneration, T5Config(vocab_size=128, d_model=128, d_kv=16, d_ff=256, num_layers=2,
                                                    num_heads=8, relative_attention_num_buckets=2048,
                                                    relative_attention_max_distance=4096)),
        "llama": (LlamaForCausalLM, LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                                max_position_embeddings=64)),
        "bert": (BertForPreTraining, BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=128,
                                                max_position_embeddings=64)),
    }


def _hf_worker(rank, world):
    import zero_ext
    out = {}
    for name, (cls, cfg) in hf_configs().items():
        torch.manual_seed(0)
        ref = cls(cfg)
        ref_sd = {k: v.clone() for k, v in ref.state_dict().items()}
        ref_bufs = dict(ref.named_buffers())
        for init in ("init_weights", None) if name == "llama" else ("init_weights",):
            with torch.device("meta"):
                model = cls(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            torch.manual_seed(1)
            try:
                zm, _ = zero_ext.zeroify(model, opt, stage=3, init_fn=model._init_weights if init else None)
            except RuntimeError as e:
                out[(name, init)] = {"error": str(e)}
                continue
            sd = zm.state_dict()
            stds, consts = {}, []
            for k, r in ref_sd.items():
                if k in ref_bufs:
                    continue
                if r.std() == 0:
                    if not torch.equal(sd[k], r):
                        consts.append(k)
                else:
                    stds[k] = (sd[k].std() / r.std()).item()
            bufs = {k: (torch.equal(b, ref_bufs[k]), str(b.dtype)) for k, b in zm.module.named_buffers()}
            out[(name, init)] = {"stds": stds, "const_differ": consts, "bufs": bufs}
    return out


@pytest.fixture(scope="module")
def hf_meta():
    pytest.importorskip("transformers", reason="transformers is a test dependency (make test installs it)")
    return run_world(_hf_worker, 2, timeout_s=600, reuse=True)


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_hf_meta_init_fn_matches_normal_build_in_distribution(hf_meta, name):
    for rank, out in enumerate(hf_meta):
        r = out[(name, "init_weights")]
        assert r["stds"], r
        off = {k: v for k, v in r["stds"].items() if abs(v - 1) > 0.05}
        assert not off, f"rank {rank}, {name}: std ratio meta/normal outside 1 +- 5%: {off}"
        assert r["const_differ"] == [], r["const_differ"]


def test_hf_llama_without_init_fn_raises(hf_meta):
    for out in hf_meta:
        msg = out[("llama", None)].get("error", "")
        assert "(LlamaRMSNorm)" in msg and "inv_freq" in msg and "init_fn=model._init_weights" in msg, msg


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_hf_init_weights_recomputes_buffers(hf_meta, name):
    for out in hf_meta:
        r = out[(name, "init_weights")]
        assert r["bufs"] and all(eq for eq, _ in r["bufs"].values()), r["bufs"]
        assert r["const_differ"] == [], r["const_differ"]
