"""Optimizer offload (offload="cpu", Note [Optimizer offload] in csrc/engine/offload.h).

On a CPU engine the whole offload pipeline runs: separate host buffers for the master,
the optimizer states and the gradient shard, the down ring filled as each bucket's
reduction lands and emptied by the worker thread, the per-bucket host step, the up ring
copied into the owned slices before the parameter gather. It must change no bit:

1. Each case trains twice from the same start, with and without offload, and every
   loss, every parameter and every optimizer state tensor (opt.state_dict()) must be
   bit-identical, on 1-3 gloo ranks (3 divides no parameter count here), stages 1-3:
   the GPT on tinyshakespeare with AdamW and clipping (fp32, and bf16 parameters with a
   bf16 reduce), SGD with Nesterov momentum under no_sync accumulation, a torch optimizer
   without fused kernel (RMSprop: stepped on the host shards), the native reduce-scatter
   and the all-to-all one, and a parameter no rank uses.
2. A state_dict round trip with offload resumes bit for bit like the run without it.
3. opt.stats() equals estimate_memory byte for byte: the host part (master, states,
   gradient shard, pinned rings) and the device part (no master/states, no stage-2/3
   gradients, stage 3's parameter shard in param_dtype); and the copy counters say one down copy per bucket and backward, one up
   copy per bucket and step.
4. Bad input is refused before any collective, naming the fix: stage 0, grad_quant,
   param_quant, step_control=True, too little host memory (on every rank).
"""
import warnings

import pytest
import torch

from dist_harness import run_world
from mode_cases import differences, saved, train

STEPS = 6

CASES = {
    # name: train() arguments
    "gpt-adamw-fp32-clip": dict(kind="gpt", clip=1.0),
    "gpt-adamw-bf16": dict(kind="gpt", clip=1.0, param_dtype="bf16", reduce_dtype="bf16"),
    "mlp-sgd-nesterov-accumulate": dict(opt="sgd", micro=2),
    "mlp-rmsprop-host-torch": dict(opt="rmsprop", clip=0.5),
    "mlp-adam-native-reduce-scatter": dict(opt="adam", reduce_scatter="native"),
    "mlp-adamw-unused": dict(kind="unused", find_unused_parameters=True),
}


def _compare_worker(rank, world, stage, cases):
    diffs = []
    for case in cases:
        ref = train(rank, stage, steps=STEPS, offload=None, **CASES[case])
        off = train(rank, stage, steps=STEPS, offload="cpu", **CASES[case])
        diffs += differences(ref, off, f"rank {rank}, stage {stage}, {case}")
        if off.stats["offload"]["down_copies"] == 0:
            diffs.append(f"rank {rank}, {case}: the offload run made no down copy")
    return diffs


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_offload_bit_identical_one_rank(stage, case):
    """World 1, in process (no process group): every case, both stages."""
    diffs = _compare_worker(0, 1, stage, [case])
    assert not diffs, "\n".join(diffs)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_bit_identical_ranks(world, stage):
    """Every case on 2 and 3 gloo ranks; every difference on every rank is reported."""
    results = run_world(_compare_worker, world, stage, sorted(CASES), reuse=True, timeout_s=600)
    diffs = [d for r in results for d in r]
    assert not diffs, "\n".join(diffs)


def _resumed(rank, case, stage, offload):
    """3 steps, model and optimizer state_dict(), fresh objects, load, 5 more steps."""
    first = saved(train(rank, stage, steps=STEPS // 2, offload=offload, **CASES[case]))
    return train(rank, stage, steps=STEPS // 2 + 2, state=first, start=STEPS // 2, offload=offload, **CASES[case])


def _resume_worker(rank, world, stage):
    diffs = []
    for case in ("gpt-adamw-fp32-clip", "gpt-adamw-bf16"):
        ref, off = _resumed(rank, case, stage, None), _resumed(rank, case, stage, "cpu")
        diffs += differences(ref, off, f"rank {rank}, {case} resumed")
        # the resumed run is the uninterrupted one (bf16: the fp32 masters travel in the
        # optimizer's complete state, Note [Complete optimizer state])
        straight = train(rank, stage, steps=STEPS + 2, offload=None, **CASES[case])
        straight.losses = straight.losses[-len(off.losses):]
        diffs += differences(straight, off, f"rank {rank}, {case} resumed vs uninterrupted", states=False)
    return diffs


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_state_dict_round_trip(stage):
    """Save after 3 offloaded steps, load into a fresh offloaded run: the next 5 steps
    equal the same round trip without offload, bit for bit, and steps 4-8 of an
    uninterrupted run."""
    results = run_world(_resume_worker, 2, stage, reuse=True)
    diffs = [d for r in results for d in r]
    assert not diffs, "\n".join(diffs)


def _stats_worker(rank, world, stage, opts):
    from mode_cases import estimate_and_stats
    steps = 3
    est, s = estimate_and_stats(rank, world, stage, steps=steps, offload="cpu", **opts)
    return est, s, s["num_buckets"], steps


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opts", [{}, dict(param_dtype="bf16", reduce_dtype="bf16"),
                                  dict(param_dtype="bf16", reduce_dtype="bf16", reduce_scatter="native")],
                         ids=["fp32", "bf16", "bf16-native"])
def test_offload_stats_equal_estimate(stage, opts):
    """Host and device bytes of opt.stats() == estimate_memory's, byte for byte, on 3
    ranks; one down copy per bucket and backward, one up copy per bucket and step; with
    bf16 and the native reduce-scatter (NCCL's) the link carries 2 + 2 bytes per element
    of the shard per step (gloo's all-to-all lands all N slices: N x 2 down)."""
    for rank, (est, s, buckets, steps) in enumerate(run_world(_stats_worker, 3, stage, opts, reuse=True)):
        host = {k: s["offload"][k] for k in est["offload"]}
        assert host == est["offload"], (rank, host, est["offload"])
        assert s["model_state_bytes"] == est["model_state_bytes"], (rank, s["model_state_bytes"],
                                                                      est["model_state_bytes"])
        assert s["model_state_bytes"]["master_weights"] == 0 and s["model_state_bytes"]["optimizer_states"] == 0
        assert (s["model_state_bytes"]["gradients"] == 0) == (stage >= 2)
        assert s["offload"]["down_copies"] == buckets * steps, s["offload"]
        uploads = steps + (stage == 3)   # stage 3 fills its device parameter shard once at zeroify
        assert s["offload"]["up_copies"] == buckets * uploads, s["offload"]
        item = 2 if opts else 4
        assert s["offload"]["up_bytes"] == s["shard_numel"] * item * uploads, s["offload"]
        if opts.get("reduce_scatter") == "native" and stage >= 2:
            assert s["offload"]["down_bytes"] == s["shard_numel"] * 2 * steps, s["offload"]


@pytest.mark.parametrize("opts, needle", [
    (dict(stage=0), "needs stage 1, 2 or 3"),
    (dict(stage=2, grad_quant="int8"), "grad_quant=None"),
    (dict(stage=2, param_quant="int8"), "param_quant=None"),
    (dict(stage=2, step_control=True), "step_control='auto'"),
    (dict(stage=2, offload="gpu"), "offload must be None or 'cpu'"),
])
def test_offload_bad_options_name_the_fix(opts, needle):
    import zero_ext
    from cases import MLP
    opts = dict({"offload": "cpu"}, **opts)
    model = MLP()
    with pytest.raises(ValueError, match="offload") as err:
        zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), **opts)
    assert needle in str(err.value), str(err.value)


def test_offload_unfused_optimizer_warns_once():
    import zero_ext
    from cases import MLP
    model = MLP()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        zero_ext.zeroify(model, torch.optim.RMSprop(model.parameters()), stage=2, offload="cpu")
    said = [w for w in seen if "offload='cpu' with RMSprop" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in seen]


def _too_little_memory_worker(rank, world):
    import zero_ext
    import zero_ext.offload as off
    from cases import MLP
    off.available_host_bytes = lambda: 1000   # this node "has" 1000 bytes
    model = MLP()
    try:
        zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), stage=2, offload="cpu")
    except Exception as e:   # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.dist
def test_offload_too_little_host_memory_raises_on_every_rank():
    """Found before any buffer or training collective: the bytes needed and available,
    and the fixes; the other rank hears of it through zeroify's input agreement."""
    out = run_world(_too_little_memory_worker, 2)
    assert "host memory" in out[0] and "are available" in out[0] and "offload=None" in out[0], out[0]
    assert "rejected their zeroify() inputs" in out[1] or "host memory" in out[1], out[1]


@pytest.mark.parametrize("pdt", ["fp32", "bf16"])
def test_offload_stage3_meta_init_bit_identical(pdt):
    """Stage 3 built on the meta device (units initialized one by one, committed into the
    host master and uploaded into the device's parameter shard): the same losses as the
    same build without offload."""
    import zero_ext
    from cases import TINY_GPT
    from gpt import GPT, GPTConfig

    def run(offload):
        torch.manual_seed(3)
        with torch.device("meta"):
            model = GPT(GPTConfig(**TINY_GPT))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

        def init(mod):
            if isinstance(mod, torch.nn.Linear):
                torch.nn.init.normal_(mod.weight, std=0.02)
        zm, zo = zero_ext.zeroify(model, opt, stage=3, offload=offload, param_dtype=pdt, init_fn=init)
        losses = []
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, TINY_GPT["vocab_size"], (4, TINY_GPT["block_size"] + 1), generator=g)
            loss = zm(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())[1]
            loss.backward()
            zo.step()
            zo.zero_grad()
            losses.append(float(loss.detach()))
        return losses

    ref, off = run(None), run("cpu")
    assert ref == off, (ref, off)
    assert len(set(ref)) > 1, ref   # it trained
