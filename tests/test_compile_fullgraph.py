"""torch.compile(model, fullgraph=True) on what zeroify returned (Note [Compiled wrapper] in
zero_ext/compiled.py): the user's module is one graph, dynamo counts no graph break, no
graph is compiled after the second step, and training equals compiled DDP's (every loss
and the parameters after the last step within 1e-5 relative, fp32) and zero_ext's own
eager run, with and without gradient accumulation (no_sync), at 1, 2 and 3 gloo ranks;
param_dtype="bf16" within 1e-2 of fp32 compiled DDP and of its own eager run. Stage 3
compiles whole with compile_units="whole" (the default, "per_unit", breaks at each unit:
tests/test_compile.py). Hugging Face models (GPT-2, Llama, and Llama with a peft LoRA: frozen
base parameters) compile whole in stages 2 and 3, compile nothing after step 2, and follow
compiled DDP's losses and parameters within 1e-5.
Inductor's CPU backend, as users get it; its compile cache makes the repeats cheap.
"""
import functools

import pytest
import torch

from dist_harness import run_world
from test_compile import _own_inductor_cache

pytestmark = pytest.mark.dist

REL = 1e-5
BF16_REL = 1e-2   # param_dtype="bf16" against fp32 compiled DDP: the losses (measured 2.4e-4)
# and the parameters' norm of difference; an element's difference reaches 5e-2 of the largest
# parameter after 4 AdamW steps (bf16 gradients of near-zero elements, m/sqrt(v) magnifies them)
# Against the eager run the kernels differ (inductor fuses and reorders): the losses agree
# to 3e-7, but AdamW's m/sqrt(v) turns last-bit gradient differences of near-zero elements
# into visible ones (7e-5 of the largest parameter after 4 steps with accumulation).
EAGER_PARAM_REL = 1e-3
STEPS = 4


class _Net(torch.nn.Module):
    """A module class of the test's own (dynamo never captures torch.nn's frames: a
    Sequential checks the wrapper's captured frame too) with a buffer (broadcast by the
    wrapper before the graph runs)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)
        self.register_buffer("scale", torch.full((32,), 0.5))

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        return self.fc3(torch.nn.functional.gelu(self.fc2(h)) * self.scale.to(h.dtype))


def _doubled(fc, x):
    return 2 * torch.nn.functional.linear(x, fc.weight, fc.bias)


class _Even(torch.nn.Module):
    """Four units of one size (Linear(16, 16)), so stage 3's gathered bytes compare plainly:
    eager holds a unit and the one prefetched after it. The third's forward is its own
    (set on the instance), which the units in the graph must call and put back."""

    def __init__(self):
        super().__init__()
        self.fcs = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.fcs[2].forward = functools.partial(_doubled, self.fcs[2])

    def forward(self, x):
        for fc in self.fcs:
            x = torch.nn.functional.gelu(fc(x))
        return x[:, :4]


def _net(seq=False, even=False):
    torch.manual_seed(0)
    if even:
        return _Even()
    if seq:
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    return _Net()


def _train(model, opt, rank, accum, counters=None):
    """STEPS steps of `accum` micro-batches (all but the last under no_sync); the losses,
    and the graphs compiled by the end of step 2 (None without counters)."""
    losses, graphs_at_2 = [], None
    for step in range(STEPS):
        for micro in range(accum):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            with model.no_sync() if micro < accum - 1 else torch.enable_grad():
                loss = torch.nn.functional.mse_loss(model(x), y) / accum
                loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        if step == 1 and counters is not None:
            graphs_at_2 = counters["stats"]["unique_graphs"]
    return losses, graphs_at_2


def _fullgraph(rank, world, cases):
    import zero_ext
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP
    _own_inductor_cache()
    torch._dynamo.reset()
    out = {}
    for accum in sorted({c[2] for c in cases}):
        net = _net()
        ddp = DDP(torch.compile(net))
        losses, _ = _train(ddp, torch.optim.AdamW(net.parameters(), lr=1e-2), rank, accum)
        out[("ddp", accum)] = (losses, [p.detach().clone() for p in net.parameters()])
    for stage, mode, accum, opts in cases:
        net = _net(seq=opts.get("seq", False), even=opts.get("even", False))
        kw = dict({"min_unit_numel": 0, "compile_units": "whole"} if stage == 3 else {},
                  **{k: v for k, v in opts.items() if k not in ("seq", "in_graph", "even")})
        zero_ext.compiled.UNITS_IN_GRAPH = opts.get("in_graph", False)
        zm, zo = zero_ext.zeroify(net, torch.optim.AdamW(net.parameters(), lr=1e-2), stage=stage, **kw)
        counters.clear()
        model = torch.compile(zm, fullgraph=True) if mode == "compiled" else zm
        losses, graphs_at_2 = _train(model, zo, rank, accum, counters)
        graphs, calls = counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"]
        units = zm._engine.num_units if stage == 3 else 0
        held = [zm._engine.unit_gathered(k) for k in range(units)]   # after the last step
        own_forward = [type(m.__dict__.get("forward")).__name__ for m in net.modules()]
        # stage 3's gathered bytes at most, training: the engine's (its buffers; in the graph only
        # the one being copied out) and, in the graph, the gathered flats alive at once
        peak = zo.stats()["buffer_bytes"]["peak_gathered_params"] if stage == 3 else None
        flats = zm._units.ops.peak if stage == 3 and zm._units.ops is not None else 0
        evaluated = None
        if stage == 3:   # an evaluation (a graph of its own): every unit but the root released after it
            with torch.no_grad():
                evaluated = model(torch.ones(2, 16)).float()
        held_eval = [zm._engine.unit_gathered(k) for k in range(units)]
        ops = zm._units.ops if stage == 3 else None
        gathers = (ops.gathers, ops.regathers, sum(1 for m in ops.members if m), ops.prefetched) if ops is not None else None
        with zero_ext.gathered_parameters(zm):
            params = [p.detach().clone() for p in net.parameters()]
        out[(stage, mode, accum, tuple(sorted(opts)))] = dict(
            losses=losses, params=params, breaks=dict(counters["graph_break"]), graphs_at_2=graphs_at_2,
            graphs=graphs, calls=calls, held=held, held_eval=held_eval, evaluated=evaluated, units=units,
            gathers=gathers, peak=peak, flats=flats, own_forward=own_forward)
    return out


def _close(a, b, what, param_rel=REL, rel=REL, model_scale=False):
    """Losses, and each parameter's largest difference against its own largest element (its
    norm for bf16); with model_scale against the model's largest element."""
    assert len(a["losses"]) == len(b["losses"]) == STEPS * len(a["losses"]) // STEPS > 0
    for k, (x, y) in enumerate(zip(a["losses"], b["losses"])):
        assert abs(x - y) <= rel * abs(y), f"{what}: loss {k}: {x} vs {y}"
    assert len(a["params"]) == len(b["params"]), what
    largest = max(y.abs().max() for y in b["params"])
    for x, y in zip(a["params"], b["params"]):
        diff, ref = ((x - y).norm(), y.norm()) if param_rel == BF16_REL else ((x - y).abs().max(), y.abs().max())
        assert diff <= param_rel * (largest if model_scale else ref) + 1e-7, f"{what}: parameters {diff} vs {ref}"


def _check(results, cases):
    for rank, out in enumerate(results):
        for stage, mode, accum, opts in cases:
            got = out[(stage, mode, accum, tuple(sorted(opts)))]
            what = f"rank {rank} stage {stage} {mode} accum={accum} {opts}"
            rel = BF16_REL if opts.get("param_dtype") == "bf16" else REL
            if mode == "compiled":
                assert got["breaks"] == {}, f"{what}: graph breaks {got['breaks']}"
                assert got["graphs"] == 1 and got["calls"] > 0, f"{what}: {got['graphs']} graphs, not the module whole"
                assert got["graphs_at_2"] == got["graphs"], f"{what}: compiled again after step 2"
                eager = out.get((stage, "eager", accum, tuple(sorted(opts))))
                if eager is not None:
                    _close(got, eager, f"{what} against zero_ext's eager run", EAGER_PARAM_REL)
                    if stage == 3:
                        assert torch.allclose(got["evaluated"], eager["evaluated"], rtol=1e-3, atol=1e-5), what
                    assert got["held"] == eager["held"], f"{what}: units gathered after the step"
                    assert got["held_eval"] == eager["held_eval"], f"{what}: units gathered after an evaluation"
                assert not any(got["held"][1:] + got["held_eval"][1:]), f"{what}: units left gathered"
            if mode == "compiled" and "seq" not in opts and "even" not in opts:
                ddp_losses, ddp_params = out[("ddp", accum)]
                _close(got, dict(losses=ddp_losses, params=ddp_params), f"{what} against compiled DDP", rel, rel)


def test_fullgraph_stages_0_3_two_ranks():
    cases = [(s, m, a, {}) for s in (0, 1, 2, 3) for m in ("compiled", "eager") for a in (1, 2)]
    cases += [(2, "compiled", 1, {"overlap_param_gather": True}), (1, "compiled", 1, {"seq": True})]
    cases += [(s, m, 2, {"param_dtype": "bf16"}) for s in (2, 3) for m in ("compiled", "eager")]
    cases += [(3, "compiled", 1, {"seq": True})]
    _check(run_world(_fullgraph, 2, cases, timeout_s=600), cases)


def test_stage3_units_gathered_in_the_graph():
    """Note [Stage 3 collectives in the graph]'s prototype: each unit gathered by
    zero_ext::unit_gather at its first use inside the graph and again in backward (not
    saved), the next unit's gather in flight meanwhile (prefetched), its gradient handed to the engine by zero_ext::unit_reduce inside the compiled
    backward; equal to compiled DDP, and at most ~eager stage 3's gathered bytes at once."""
    cases = [(3, "compiled", a, {"in_graph": True}) for a in (1, 2)]
    even = {"even": True, "coalesce_numel": 0}   # each unit gathered alone, as a large model's
    cases += [(3, "compiled", 1, dict(even, in_graph=True)), (3, "eager", 1, even)]
    results = run_world(_fullgraph, 2, cases, timeout_s=600)
    _check(results, cases)
    for out in results:
        for accum in (1, 2):
            # every unit, every forward (training micro-steps, then the evaluation); in
            # backward every unit but fc1 (its input needs no gradient: its weight is not read)
            calls, again, units, _ = out[(3, "compiled", accum, ("in_graph",))]["gathers"]
            assert units == 3 and calls - again == units * (STEPS * accum + 1), (calls, again)
            assert again == (units - 1) * STEPS * accum, (calls, again)
        got = out[(3, "compiled", 1, ("coalesce_numel", "even", "in_graph"))]
        eager = out[(3, "eager", 1, ("coalesce_numel", "even"))]
        _close(got, eager, "four even units in the graph against eager stage 3", EAGER_PARAM_REL)
        unit = 4 * (16 * 16 + 16)
        assert got["gathers"][1] == 3 * STEPS and got["flats"] >= unit, got["gathers"]
        # prefetched (in flight while the unit before computes): every gather but each forward's
        # first; in backward the first is the last forward's unit, kept (6 a step, 3 evaluating)
        assert got["gathers"][3] == 6 * STEPS + 3, got["gathers"]
        assert got["own_forward"] == eager["own_forward"] and got["own_forward"].count("partial") == 1
        # eager: a unit and the one prefetched; the graph: one flat alive (a second while the
        # next is copied out of the engine's buffer), the engine's buffer one unit (the one
        # copied out, then the next in flight while the flat is read); everything
        # gathered at the start, or the flats saved for backward, would be 4 units or more
        compiled = got["flats"] + got["peak"]
        assert compiled <= 1.05 * eager["peak"], (got["flats"], got["peak"], eager["peak"])


@pytest.mark.parametrize("world", [1, 3])
def test_fullgraph_one_and_three_ranks(world):
    cases = [(2, "compiled", 2, {}), (1, "compiled", 1, {}), (3, "compiled", 2, {})]
    _check(run_world(_fullgraph, world, cases, timeout_s=600), cases)


def _hf_model(name):
    """A tiny Hugging Face model: GPT-2, Llama (2 layers each), or that Llama with a LoRA (peft:
    q_proj and v_proj adapted, every base parameter frozen)."""
    import transformers as tf
    torch.manual_seed(0)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                                bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, embd_pdrop=0.0,
                                                resid_pdrop=0.0))
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64))
    if name == "lora":
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules=["q_proj", "v_proj"]))
    return model


def _hf(rank, world, names):
    """Each named model compiled fullgraph in stages 2 and 3 ("whole") beside compiled DDP: the
    losses of 3 steps, the parameters after them (every one, the frozen included), dynamo's
    counters at the end and after step 2. The loss is taken outside the model: with labels=,
    transformers' own logger.warning_once stops fullgraph (with or without zero_ext)."""
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_ext
    _own_inductor_cache()
    torch._dynamo.reset()

    def train(model, opt):
        losses, graphs_at_2 = [], None
        for step in range(3):
            x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(step + 10 * rank))
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), x[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if step == 1:
                graphs_at_2 = counters["stats"]["unique_graphs"]
        return losses, graphs_at_2

    def adamw(model):
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    out = {}
    for name in names:
        ref = _hf_model(name)
        losses, _ = train(DDP(torch.compile(ref)), adamw(ref))
        out[(name, "ddp")] = dict(losses=losses, params=[p.detach().clone() for p in ref.parameters()])
        for stage in (2, 3):
            m = _hf_model(name)
            kw = {"compile_units": "whole", "min_unit_numel": 0} if stage == 3 else {}
            zm, zo = zero_ext.zeroify(m, adamw(m), stage=stage, **kw)
            counters.clear()
            losses, graphs_at_2 = train(torch.compile(zm, fullgraph=True), zo)
            with zero_ext.gathered_parameters(zm):
                params = [p.detach().clone() for p in m.parameters()]
            out[(name, stage)] = dict(losses=losses, params=params, breaks=dict(counters["graph_break"]),
                                      graphs=counters["stats"]["unique_graphs"], graphs_at_2=graphs_at_2,
                                      frozen=sum(not p.requires_grad for p in m.parameters()))
    return out


def test_hf_models_fullgraph_stages_2_3():
    """GPT-2, Llama and a LoRA'd Llama (frozen base parameters; sharded in stage 3) each trace
    as one graph with no break, compile nothing after step 2, and train as compiled DDP."""
    pytest.importorskip("transformers", reason="transformers is installed by make test")
    pytest.importorskip("peft", reason="peft is a test dependency (make test installs it)")
    names = ("gpt2", "llama", "lora")
    for rank, out in enumerate(run_world(_hf, 2, names, timeout_s=900)):
        for name in names:
            for stage in (2, 3):
                got, what = out[(name, stage)], f"rank {rank} {name} stage {stage}"
                assert got["breaks"] == {} and got["graphs"] == 1, f"{what}: {got['breaks']}, {got['graphs']} graphs"
                assert got["graphs_at_2"] == got["graphs"], f"{what}: compiled again after step 2"
                assert (got["frozen"] > 0) == (name == "lora"), what
                # GPT-2 against the model's largest parameter: compiled DDP's graph is split at its
                # buckets (DDPOptimizer), so inductor fuses the gradients' kernels otherwise, and AdamW's
                # m/sqrt(v) turns their last-bit differences into visible ones in near-zero elements (a
                # bias after 3 steps: 2e-6 against its largest element's 3e-3, 2e-6 of the model's
                # largest; the losses are equal). Llama's and the LoRA's: 2e-7 of each tensor's own.
                _close(got, out[(name, "ddp")], f"{what} against compiled DDP", model_scale=name == "gpt2")
