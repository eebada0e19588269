"""The bf16 master kept as a remainder (master_remainder, Note [Split master in the engine]
in csrc/engine/master_split.h; the bit formats: Note [Split master] in
csrc/core/zx_master_split.c).

With param_dtype="bf16" in stages 0-2 and one fused optimizer, the fp32 master shard is
kept as a 16-bit remainder and a tie bit under the bf16 parameter. It must change no bit
and save what it says:

1. Each case trains twice from the same start, master_remainder=False (a separate fp32
   master shard) and True, and every loss, every parameter and every optimizer state
   tensor (opt.state_dict(), the fp32 masters included) must be bit-identical, on 1-3
   gloo ranks (3 divides no parameter count here), stages 0-2: the GPT on tinyshakespeare
   with AdamW and clipping, Adam with an fp32 reduce, SGD with Nesterov momentum under
   no_sync accumulation, a parameter no rank uses (stepped runs start inside tie bytes),
   bf16 optimizer states, step_in_backward, step_control=True; the CPU steps each through
   one call over the split master (Note [Fused split-master step]: stepped runs that start
   inside tie bytes included; the GPU's chunked path: tests/test_gpu_engine.py).
2. A state_dict round trip with the split master resumes bit for bit like the run without.
3. fp32 masters exactly halfway between two bf16 numbers (both tie directions) loaded with
   model.load_state_dict come back from opt.state_dict() bit for bit.
4. opt.stats() equals estimate_memory byte for byte: master_weights is 2 bytes + 1 bit per
   shard element (stage 2, AdamW: 16 -> 14.125 bytes per parameter of model state).
5. It is on exactly where it applies (not with master_remainder=False, fp16, stage 3,
   param_quant, offload, or a torch optimizer without fused kernel).
6. gathered_parameters(modifier_rank=0) folds an edit exactly as with an fp32 master.
"""
import struct

import pytest
import torch

from dist_harness import run_world
from mode_cases import differences, saved, train

STEPS = 6
BF16 = dict(param_dtype="bf16")

CASES = {
    # name: train() arguments (all bf16 parameters)
    "gpt-adamw-clip": dict(kind="gpt", clip=1.0, reduce_dtype="bf16"),
    "mlp-adam-fp32-reduce": dict(opt="adam"),
    "mlp-sgd-nesterov-accumulate": dict(opt="sgd", micro=2),
    "mlp-adamw-unused": dict(kind="unused", find_unused_parameters=True),
    "mlp-adamw-bf16-states": dict(state_dtype="bf16"),
    "mlp-adamw-step-control": dict(step_control=True),
    "mlp-adamw-step-in-backward": dict(step_in_backward=True),
}


def _train(rank, stage, remainder, case, **kw):
    args = dict(CASES[case], **kw)
    if stage == 0 and args.get("step_in_backward"):   # it needs stage 1-3
        return None
    return train(rank, stage, master_remainder=remainder, **BF16, **args)


def _compare_worker(rank, world, stage, cases):
    diffs = []
    for case in cases:
        ref = _train(rank, stage, False, case, steps=STEPS)
        if ref is None:
            continue
        split = _train(rank, stage, True, case, steps=STEPS)
        diffs += differences(ref, split, f"rank {rank}, stage {stage}, {case}")
        engines = (ref.objects[1]._engine.split_master, split.objects[1]._engine.split_master)
        if engines != (False, True):
            diffs.append(f"rank {rank}, {case}: split master on (False, True) runs: {engines}")
    return diffs


@pytest.mark.parametrize("stage, case", [(s, c) for c in sorted(CASES) for s in (0, 1, 2)
                                         if not (s == 0 and CASES[c].get("step_in_backward"))])
def test_split_master_bit_identical_one_rank(stage, case):
    """World 1, in process: every case, stages 0-2 (step_in_backward: 1-2)."""
    diffs = _compare_worker(0, 1, stage, [case])
    assert not diffs, "\n".join(diffs)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_split_master_bit_identical_ranks(world, stage):
    """Every case on 2 and 3 gloo ranks; every difference on every rank is reported."""
    results = run_world(_compare_worker, world, stage, sorted(CASES), reuse=True, timeout_s=600)
    diffs = [d for r in results for d in r]
    assert not diffs, "\n".join(diffs)


def _resume_worker(rank, world, stage):
    diffs = []
    case = "gpt-adamw-clip"
    runs = []
    for remainder in (False, True):
        first = saved(_train(rank, stage, remainder, case, steps=STEPS // 2))
        runs.append(_train(rank, stage, remainder, case, steps=STEPS // 2 + 2, state=first, start=STEPS // 2))
    diffs += differences(runs[0], runs[1], f"rank {rank}, stage {stage}, {case} resumed")
    straight = _train(rank, stage, True, case, steps=STEPS + 2)
    straight.losses = straight.losses[-len(runs[1].losses):]
    diffs += differences(straight, runs[1], f"rank {rank}, {case} resumed vs uninterrupted", states=False)
    return diffs


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2])
def test_split_master_state_dict_round_trip(stage):
    """Save after 3 steps, load into a fresh run: the next 5 steps equal the same round trip
    with an fp32 master shard, bit for bit, and steps 4-8 of an uninterrupted run."""
    diffs = [d for r in run_world(_resume_worker, 2, stage, reuse=True) for d in r]
    assert not diffs, "\n".join(diffs)


def _f32(bits):
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _masters(zo) -> dict:
    """The fp32 masters in opt.state_dict(), by model state_dict key."""
    return {k: v.clone() for k, v in zo.state_dict()["zero_ext_complete"]["master_weights"].items()}


@pytest.mark.parametrize("stage", [1, 2])
def test_split_master_ties_come_back(stage):
    """Masters halfway between two bf16 numbers, under both even and odd truncations (so
    that rounding to even goes down for one and up for the other), and every other kind
    of low half, survive load -> split -> join bit for bit."""
    import zero_ext
    from cases import MLP
    torch.manual_seed(0)
    model = MLP()
    sd = {}
    for name, p in model.named_parameters():
        n = p.numel()
        g = torch.Generator().manual_seed(n)
        high = torch.randint(0x3c00, 0x4000, (n,), generator=g, dtype=torch.int64)
        low = torch.randint(0, 0x10000, (n,), generator=g, dtype=torch.int64)
        low[::3] = 0x8000                                   # ties
        bits = ((high << 16) | low).to(torch.int32)
        sd[name] = bits.view(torch.float32).reshape(p.shape).clone()
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), stage=stage, param_dtype="bf16")
    assert zo._engine.split_master
    zm.load_state_dict(sd)
    got = _masters(zo)
    ties = sum(int((v.reshape(-1).view(torch.int32) & 0xFFFF).eq(0x8000).sum()) for v in sd.values())
    assert ties > 100, ties
    for name, v in sd.items():
        assert torch.equal(got[name].reshape(-1).view(torch.int32), v.reshape(-1).view(torch.int32)), name
        # the model computes with the rounding of the master
        assert torch.equal(dict(model.named_parameters())[name].detach(), v.to(torch.bfloat16)), name


def _stats_worker(rank, world, stage, opt_name):
    from mode_cases import estimate_and_stats
    return estimate_and_stats(rank, world, stage, opt=opt_name, param_dtype="bf16")


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_split_master_stats_equal_estimate(stage, opt):
    """opt.stats() == estimate_memory byte for byte on 3 ranks; the master is 2 bytes and a
    bit per shard element where the fp32 master shard was 4."""
    for rank, (est, s) in enumerate(run_world(_stats_worker, 3, stage, opt, reuse=True)):
        assert s["model_state_bytes"] == est["model_state_bytes"], (rank, s["model_state_bytes"],
                                                                      est["model_state_bytes"])
        # on the CPU each task steps its pieces through its own buffer: no scratch tensor
        assert s["buffer_bytes"]["split_master_scratch"] == est["buffer_bytes"]["split_master_scratch"] == 0
        shard = s["shard_numel"]
        assert 2 * shard < s["model_state_bytes"]["master_weights"] <= 2 * shard + shard // 8 + s["num_buckets"]


def test_split_master_bytes_per_parameter_stage2():
    """Stage 2, bf16, AdamW on 8 ranks, from the estimate (what the engine allocates, by
    the test above): model state per parameter 16 bytes with an fp32 master shard (bf16
    parameter 2 + (master 4 + gradient 4 + Adam 8) / 8) and 2 + (2.125 + 4 + 8) / 8 split."""
    import zero_ext
    n = 1 << 24
    kw = dict(param_dtype="bf16", reduce_dtype="fp32", optimizer="adamw")
    split = zero_ext.estimate_memory(n, 8, 2, **kw)["model_state_bytes"]
    full = zero_ext.estimate_memory(n, 8, 2, master_remainder=False, **kw)["model_state_bytes"]
    per = lambda m: m["total"] / n   # noqa: E731
    assert abs(per(full) - (2 + 16 / 8)) < 0.01, per(full)
    assert abs(per(split) - (2 + 14.125 / 8)) < 0.01, per(split)
    assert full["master_weights"] - split["master_weights"] > 1.8 * n / 8


@pytest.mark.parametrize("opts, on", [
    (dict(stage=2), True),
    (dict(stage=0), True),
    (dict(stage=2, master_remainder=False), False),
    (dict(stage=2, param_dtype="fp16"), False),
    (dict(stage=3), False),
    (dict(stage=2, offload="cpu"), False),
    (dict(stage=2, opt="rmsprop"), False),
    (dict(stage=2, fused="never"), False),
], ids=["stage2", "stage0", "off", "fp16", "stage3", "offload", "rmsprop", "fused-never"])
def test_split_master_where_it_applies(opts, on):
    import warnings

    import zero_ext
    from cases import MLP
    from mode_cases import optimizer
    opts = dict({"param_dtype": "bf16"}, **opts)
    model = MLP()
    opt = optimizer(opts.pop("opt", "adamw"), model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zm, zo = zero_ext.zeroify(model, opt, **opts)
    assert zo._engine.split_master == on
    masters = zo.stats()["model_state_bytes"]["master_weights"]
    shard = zo.stats()["shard_numel"]
    if on:
        assert masters < 3 * shard, masters
    elif opts.get("stage") != 3 and "offload" not in opts:
        assert masters == 4 * shard, masters


def test_split_master_option_is_checked():
    import zero_ext
    from cases import MLP
    model = MLP()
    with pytest.raises(ValueError, match="master_remainder must be True or False"):
        zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), stage=2, param_dtype="bf16",
                         master_remainder="yes")


@pytest.mark.parametrize("remainder", [False, True])
def test_split_master_gathered_edit_is_exact(remainder):
    """An edit inside gathered_parameters(modifier_rank=0) replaces exactly the edited
    elements' masters by their new bf16 values, as with an fp32 master shard."""
    import zero_ext
    from cases import MLP, batch
    torch.manual_seed(1234)
    model = MLP()
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=2,
                              param_dtype="bf16", master_remainder=remainder)
    for step in range(2):   # masters that are not bf16 numbers
        x, y = batch("mlp", 0, step, 0)
        zm(x, y).backward()
        zo.step()
        zo.zero_grad()
    before = _masters(zo)
    name, first = next(iter(model.named_parameters()))
    with zero_ext.gathered_parameters(first, modifier_rank=0):
        with torch.no_grad():
            first[0].fill_(0.5)
    after = _masters(zo)
    edited = after[name].reshape(first.shape)
    assert torch.all(edited[0] == 0.5)
    assert torch.equal(edited[1:], before[name].reshape(first.shape)[1:])
    assert not torch.equal(before[name].reshape(first.shape)[0], edited[0])
    for k in before:
        if k != name:
            assert torch.equal(after[k], before[k]), k
