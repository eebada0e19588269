"""step_in_backward=True (Note [Step in backward] in csrc/engine/backward_step.cpp).

Each bucket steps as its reduced gradient lands during backward, with the param groups as
they are when the backward starts, and stages 2-3 keep no gradient shard. The maths is the
run without it, so the test is bit-identity:

1. Losses and parameters bit-identical to the same run with step_in_backward=False, on
   1-3 gloo ranks, stages 1-3, fp32 and bf16 (+ bf16 reduce), AdamW and SGD with momentum,
   an LR scheduler stepped after every opt.step() (its new lr must reach the next
   backward's steps), no_sync accumulation, the native and the all-to-all reduce-scatter;
   and the tiny GPT on tinyshakespeare for 200 steps at stage 3 bf16 (the real-text check:
   the same loss curve, bit for bit, so within any tolerance of exact).
2. Memory: stats() == estimate_memory byte for byte; no gradient bytes in stages 2-3; stage
   3 with Adam holds 12 bytes per sharded element (master 4 + Adam 8), 8 with
   state_dtype="bf16" (half of FSDP2's 16).
3. A state_dict() round trip in the middle resumes bit for bit.
4. Refused, naming the fix: clipping after zeroify, fp16 loss scaling, an optimizer
   without fused kernel, offload, stage 0.
"""
import pytest
import torch

from dist_harness import run_world
from mode_cases import differences, saved, train

CASES = {
    # name: train() arguments; every case steps an LR scheduler after each opt.step(), whose
    # new lr must reach the next backward's steps
    "adamw-fp32": dict(),
    "adamw-bf16": dict(param_dtype="bf16", reduce_dtype="bf16"),
    "sgd-fp32-accumulate": dict(opt="sgd", micro=2),
    "adamw-native-reduce-scatter": dict(reduce_scatter="native"),
    "adamw-bf16-states": dict(param_dtype="bf16", state_dtype="bf16"),
}


def _compare(rank, world, stage, cases):
    diffs = []
    for case in cases:
        ref = train(rank, stage, sched_every=2, step_in_backward=False, **CASES[case])
        sib = train(rank, stage, sched_every=2, step_in_backward=True, **CASES[case])
        what = f"rank {rank}, stage {stage}, {case}"
        diffs += differences(ref, sib, what)
        if stage >= 2 and sib.stats["model_state_bytes"]["gradients"] != 0:
            diffs.append(f"{what}: {sib.stats['model_state_bytes']['gradients']} gradient bytes kept")
    return diffs


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_step_in_backward_bit_identical_one_rank(stage, case):
    diffs = _compare(0, 1, stage, [case])
    assert not diffs, "\n".join(diffs)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_in_backward_bit_identical_ranks(world, stage):
    results = run_world(_compare, world, stage, sorted(CASES), reuse=True, timeout_s=600)
    diffs = [d for r in results for d in r]
    assert not diffs, "\n".join(diffs)


def _gpt_curves(rank, world, steps):
    opts = dict(kind="gpt", steps=steps, sched_every=50, param_dtype="bf16", reduce_dtype="bf16")
    ref, sib = train(rank, 3, step_in_backward=False, **opts), train(rank, 3, step_in_backward=True, **opts)
    return ref.losses, sib.losses


@pytest.mark.dist
def test_step_in_backward_gpt_on_real_text_same_curve():
    """The tiny GPT on tinyshakespeare, 200 steps, stage 3 bf16 on 2 ranks: the loss curve
    with step_in_backward is the exact run's, bit for bit (the last 20 steps' mean printed)."""
    for rank, (ref, sib) in enumerate(run_world(_gpt_curves, 2, 200, reuse=True, timeout_s=600)):
        tail = sum(ref[-20:]) / 20
        print(f"rank {rank}: mean loss of steps 181-200: exact {tail:.5f}, step_in_backward "
              f"{sum(sib[-20:]) / 20:.5f}")
        assert ref == sib, f"rank {rank}: curves differ first at step {next(i for i in range(len(ref)) if ref[i] != sib[i])}"
        assert ref[-1] < ref[0] - 0.5, (ref[0], ref[-1])   # it trained


def _memory(rank, world, stage, opts):
    from mode_cases import estimate_and_stats
    return estimate_and_stats(rank, world, stage, steps=2, step_in_backward=True, **opts)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("opts", [{}, dict(param_dtype="bf16", reduce_dtype="bf16"), dict(reduce_scatter="native"),
                                  dict(param_dtype="bf16", state_dtype="bf16")],
                         ids=["fp32-alltoall", "bf16-alltoall", "fp32-native", "bf16-states"])
def test_step_in_backward_memory_equals_estimate(stage, opts):
    for rank, (est, s) in enumerate(run_world(_memory, 3, stage, opts, reuse=True)):
        assert s["model_state_bytes"] == est["model_state_bytes"], (rank, s["model_state_bytes"],
                                                                      est["model_state_bytes"])
        assert s["buffer_bytes"]["grad_landing"] == est["buffer_bytes"]["grad_landing"], (rank, s["buffer_bytes"])
        assert s["buffer_bytes"]["grad_ring"] == est["buffer_bytes"]["grad_ring"], (rank, s["buffer_bytes"])
        assert s["model_state_bytes"]["gradients"] == 0
        if stage == 3:   # master 4 + Adam 8 (bf16 states: 4) per element of the shard, nothing else
            per = 8 if opts.get("state_dtype") == "bf16" else 12
            assert s["model_state_bytes"]["total"] == per * s["shard_numel"], s["model_state_bytes"]


def _resume(rank, world, stage):
    straight = train(rank, stage, steps=6, sched_every=2, step_in_backward=True)
    first = saved(train(rank, stage, steps=3, sched_every=2, step_in_backward=True))
    resumed = train(rank, stage, steps=3, sched_every=2, step_in_backward=True, state=first, start=3)
    return [i for i, (a, b) in enumerate(zip(straight.params, resumed.params)) if not torch.equal(a, b)]


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_in_backward_state_dict_round_trip(stage):
    for rank, bad in enumerate(run_world(_resume, 2, stage, reuse=True)):
        assert not bad, f"rank {rank}: parameters {bad} differ after resuming"


@pytest.mark.parametrize("opts, needle", [
    (dict(stage=0), "needs stage 1, 2 or 3"),
    (dict(stage=2, param_dtype="fp16"), "loss scaling"),
    (dict(stage=2, offload="cpu"), "offload"),
    (dict(stage=2, step_control=True), "step_control"),
    (dict(stage=2, step_in_backward="yes"), "True or False"),
])
def test_step_in_backward_bad_options_name_the_fix(opts, needle):
    import zero_ext
    from cases import MLP
    model = MLP()
    opts = dict({"step_in_backward": True}, **opts)
    with pytest.raises(ValueError, match="step_in_backward") as err:
        zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), **opts)
    assert needle in str(err.value), str(err.value)


def test_step_in_backward_refuses_unfused_optimizer_and_clipping():
    import zero_ext
    from cases import MLP, batch
    model = MLP()
    with pytest.raises(ValueError, match="fused kernel"):
        zero_ext.zeroify(model, torch.optim.RMSprop(model.parameters()), stage=2, step_in_backward=True)
    model = MLP()
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), stage=2, step_in_backward=True)
    x, y = batch("mlp", 0, 0, 0)
    zm(x, y).backward()
    with pytest.raises(zero_ext.ZeroUsageError, match="step_in_backward=False"):
        zo.clip_grad_norm_(1.0)
    with pytest.raises(zero_ext.ZeroUsageError, match="step_in_backward=False"):
        torch.nn.utils.clip_grad_norm_(zm.parameters(), 1.0)
