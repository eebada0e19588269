"""state_dtype="bf16": Adam/AdamW's exp_avg and exp_avg_sq in bfloat16 with stochastic
rounding (Note [bf16 optimizer states] in csrc/engine/stepper.cpp).

1. Accuracy on real text: the tiny GPT (tests/cases.py TINY_GPT) on tinyshakespeare,
   ACC_STEPS steps of AdamW (lr 3e-3, weight decay 0.1, clip 1.0) on 2 gloo ranks, fp32
   states vs bf16 states from the same start on the same batches: the mean training loss
   of the last ACC_WINDOW steps, averaged over ACC_SEEDS initializations/batch orders, is
   within 1% of the fp32 states'. One seed alone is too noisy for a 1% bound: fp32-state
   runs whose states were perturbed by 1e-6 (relative) once per step ended from -1.45% to
   +0.06% away from the unperturbed run (5 perturbations, seed 0), as the training
   diverges chaotically. Controls, emulated on fp32 states after each step (seed 0):
   "lost" (exp_avg never stored) must miss the bound, so it can fail; "nearest" (bf16
   round-to-nearest) is printed only. On this small model rounding the states to nearest
   (-0.13%), toward zero (+0.27%) or freezing exp_avg_sq after step 50 (-0.44%) stays
   within 1% too (measured once, seed 0): the bound catches gross errors, not the rounding
   mode; tests 2-3 pin the rounding down bit for bit. Measured (2 ranks, stage 2, 300
   steps, last 50, 4 seeds, about 25 s): fp32 2.6039, bf16 2.6039 (-0.00%); per seed
   fp32 2.6192 / 2.6282 / 2.5847 / 2.5837, bf16 2.6151 / 2.6360 / 2.5815 / 2.5828;
   lost +23.69%. Reproduce (prints every figure):
   `python -m pytest -s -k accuracy tests/test_state_dtype.py`.
2. The step's rounding is the kernel's: two steps at world 1 redone with
   zero_ext._C.adam_step_bf16_states on the same inputs, seed BF16_STATE_SEED + step and
   each element's counter its position in the flat layout, give the same state bits, with
   the host step count and with step_control=True; on a GPU the same for the CUDA kernel
   table (skipped without one: not yet run on a GPU).
3. World-size independence: with the same batch on every rank (so the averaged gradient
   is bit-identical at any N), N steps at world 1 and 2 give the same parameters and the
   same bf16 states, bit for bit (the counters are positions in the unpadded layout).
4. Bit-identical with offload="cpu" and without, world 1 and 2, stages 1-2.
5. opt.stats() == estimate_memory byte for byte (stages 0-3, offload's host part too),
   and bf16 states are 4 bytes per element of the shard less than fp32 ones.
6. Checkpoints: state_dict()/load_state_dict and zero_ext.save/load round-trip bf16
   states bit for bit (they are written widened to fp32), also into an fp32-state run
   (exact widening) and back; a sharded state of the other state_dtype is refused.
7. Bad input (amsgrad, SGD, RMSprop, fused='never', an unknown dtype) raises ValueError
   before any collective, naming the fix.
8. Beside Muon (AdamW's pieces filling Muon's tensor-atomic buckets at world 2): bf16
   states, training goes on, a state_dict round-trips bit for bit.
"""
import os
import time

import pytest
import torch

from dist_harness import ROOT, run_world
from mode_cases import tensors

DATA = os.path.join(ROOT, "examples", "data", "tinyshakespeare.txt")
ACC_STEPS, ACC_WINDOW = 300, 50
CONTROLS = ("nearest", "lost")
ACC_SEEDS = 4


# ----------------------------------------------------------------------------- helpers

def _gpt(seed=0):
    from cases import TINY_GPT
    from gpt import GPT, CharDataset, GPTConfig
    data = CharDataset(DATA)
    torch.manual_seed(1 + seed)
    return GPT(GPTConfig(**{**TINY_GPT, "vocab_size": data.vocab_size})), data


def _round_states(zo, how):
    """Emulate other roundings of bf16 states on fp32 states, in place, after a step
    (the step used the fp32 states before they are rounded, as the bf16 kernel does)."""
    st = zo._engine.states()
    with torch.no_grad():
        if how == "nearest":          # bf16 states without stochastic rounding
            for t in st.values():
                t.copy_(t.bfloat16().float())
        elif how == "truncate":       # stochastic rounding without its random bits: toward zero
            for t in st.values():
                t.copy_((t.view(torch.int32) & ~0xFFFF).view(torch.float32))
        elif how == "lost":           # exp_avg never stored (a lost write every step)
            st["exp_avg"].zero_()
        elif how == "stale":          # exp_avg_sq no longer stored after step 50 (a lost write)
            zo._stale_n = getattr(zo, "_stale_n", 0) + 1
            if zo._stale_n == 50:
                zo._stale_v = st["exp_avg_sq"].clone()
            if zo._stale_n > 50:
                st["exp_avg_sq"].copy_(zo._stale_v)


def _gpt_curve(rank, world, opts, steps, emulate=None, seed=0):
    """Per-step training losses of the tiny GPT (AdamW lr 3e-3, clip 1.0), stage 2; `seed`
    picks the initialization and the batches."""
    import zero_ext
    model, data = _gpt(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    zm, zo = zero_ext.zeroify(model, opt, stage=2, **opts)
    losses = []
    for step in range(steps):
        x, y = data.get_batch("train", 8, model.config.block_size, torch.Generator().manual_seed(100_000 * seed + 1000 * rank + step))
        loss = zm(x, y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(zm.parameters(), 1.0)
        zo.step()
        zo.zero_grad()
        if emulate is not None:
            _round_states(zo, emulate)
        losses.append(float(loss.detach()))
    return losses


def _accuracy_worker(rank, world, steps):
    t0 = time.perf_counter()
    out = {}
    for seed in range(ACC_SEEDS):
        out[f"fp32/{seed}"] = _gpt_curve(rank, world, {}, steps, seed=seed)
        out[f"bf16/{seed}"] = _gpt_curve(rank, world, dict(state_dtype="bf16"), steps, seed=seed)
    for control in CONTROLS:
        out[f"{control}/0"] = _gpt_curve(rank, world, {}, steps, emulate=control)
    out["seconds"] = time.perf_counter() - t0
    return out


def _mlp(seed=1234):
    from cases import MLP
    torch.manual_seed(seed)
    return MLP(d_in=101, hidden=331, d_out=7, depth=4)


def _train_mlp(rank, stage, opts, steps=4, same_batch=False, optimizer="adamw", state=None, start=0):
    """Final fp32 masters (state_dict) and the flat states of an MLP run; (zm, zo)."""
    import zero_ext
    from cases import batch
    model = _mlp()
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1) if optimizer == "adamw"
           else torch.optim.Adam(model.parameters(), lr=1e-3))
    zm, zo = zero_ext.zeroify(model, opt, stage=stage, bucket_bytes=65536, first_bucket_bytes=8192, **opts)
    if state is not None:
        zo.load_state_dict(state)
    for step in range(start, start + steps):
        x, y = batch("mlp_big", 0 if same_batch else rank, step, 0)
        zm(x, y).backward()
        zo.step()
        zo.zero_grad()
    return zm, zo


def _snapshot(zm, zo):
    """Every parameter (fp32) and every optimizer state tensor (complete state dict)."""
    params = [p.detach().float().clone() for p in zm.module.parameters()] if hasattr(zm, "module") else \
        [p.detach().float().clone() for p in zm.parameters()]
    return params, dict(tensors(zo.state_dict()))


def _differences(a, b, what):
    out = []
    for i, (x, y) in enumerate(zip(a[0], b[0])):
        if not torch.equal(x, y):
            out.append(f"{what}: parameter {i} differs by up to {(x - y).abs().max().item():.3g}")
    if sorted(a[1]) != sorted(b[1]):
        out.append(f"{what}: state keys differ: {sorted(set(a[1]) ^ set(b[1]))}")
    for k in sorted(set(a[1]) & set(b[1])):
        if a[1][k].shape != b[1][k].shape or not torch.equal(a[1][k].float(), b[1][k].float()):
            out.append(f"{what}: state {k} differs")
    return out


# ----------------------------------------------------------------------------- 1. accuracy

@pytest.mark.dist
def test_bf16_states_accuracy_on_text():
    """Last-window mean loss with bf16 states, averaged over ACC_SEEDS initializations and
    batch orders, within 1% of fp32 states'; the control "lost" is not, so the bound can
    fail ("nearest" is printed only: see the module docstring)."""
    res = run_world(_accuracy_worker, 2, ACC_STEPS, timeout_s=600, reuse=True)

    def last(key):   # mean loss of the last ACC_WINDOW steps over both ranks
        return sum(sum(r[key][-ACC_WINDOW:]) for r in res) / (ACC_WINDOW * len(res))

    per_seed = {k: [last(f"{k}/{s}") for s in range(ACC_SEEDS)] for k in ("fp32", "bf16")}
    means = {k: sum(v) / ACC_SEEDS for k, v in per_seed.items()}
    rel = means["bf16"] / means["fp32"] - 1
    control = {c: last(f"{c}/0") / per_seed["fp32"][0] - 1 for c in CONTROLS}
    print(f"\nstate_dtype accuracy, tiny GPT, {ACC_STEPS} steps on 2 ranks, mean loss of the last {ACC_WINDOW} "
          f"over {ACC_SEEDS} seeds: fp32 {means['fp32']:.4f}, bf16 {means['bf16']:.4f} ({100 * rel:+.2f}%); "
          f"per seed fp32 {[round(x, 4) for x in per_seed['fp32']]}, bf16 {[round(x, 4) for x in per_seed['bf16']]}; "
          f"controls against seed 0's fp32: " + ", ".join(f"{c} {100 * d:+.2f}%" for c, d in control.items())
          + f"; {max(r['seconds'] for r in res):.1f} s")
    assert means["fp32"] < 3.0, means          # the runs learned (the first loss is about ln 65 = 4.17)
    assert res[0]["fp32/0"] != res[0]["bf16/0"], "bf16 states changed no loss: the option did nothing"
    assert abs(rel) < 0.01, (means, per_seed)
    assert abs(control["lost"]) >= 0.01, ("the control 'lost' is within the bound too, so the bound tests nothing",
                                          control)


# ----------------------------------------------------------------------------- 2. the kernel's rounding

def _kernel_check(device, step_control):
    """Two steps at world 1 (one bucket, so an element's counter is its shard offset),
    redone with the CPU kernel binding on the engine's own inputs: the same bits."""
    import zero_ext
    from zero_ext import _C
    from cases import batch
    model = _mlp().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    zm, zo = zero_ext.zeroify(model, opt, stage=2, state_dtype="bf16", bucket_bytes=16 << 20,
                              first_bucket_bytes=16 << 20, step_control=step_control)
    e = zo._engine
    assert zo.stats()["num_buckets"] == 1
    n = e.param_shards()[0].numel()
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    for step in (1, 2):
        x, y = batch("mlp_big", 0, step, 0)
        zm(x.to(device), y.to(device)).backward()
        e.wait_reductions()
        p = e.param_shards()[0].cpu().clone()
        g = e.grad_shards()[0].cpu().clone()
        zo.step()
        zo.zero_grad()
        _C.adam_step_bf16_states("auto", p, g, m, v, None, 1e-3, 0.9, 0.999, 1e-8, 0.1, step, True, False, 1.0,
                                 _C.BF16_STATE_SEED + step, 0)
        got = {k: t.cpu() for k, t in e.states().items()}
        assert torch.equal(got["exp_avg"].view(torch.int16), m.view(torch.int16)), step
        assert torch.equal(got["exp_avg_sq"].view(torch.int16), v.view(torch.int16)), step
        assert torch.equal(e.param_shards()[0].cpu(), p), step
    return p, g, m, v


@pytest.mark.parametrize("step_control", [False, True])
def test_bf16_states_are_the_kernels_rounding(step_control):
    """On the CPU, with the host step count and with the step control's (the count read by
    the kernel table). A seed that did not change per step or counters off by one would
    not match."""
    from zero_ext import _C
    p, g, m, v = _kernel_check("cpu", step_control)
    # the check has power: the same step with the seed of another step rounds differently
    m2, v2 = m.clone(), v.clone()
    _C.adam_step_bf16_states("auto", p.clone(), g, m2, v2, None, 1e-3, 0.9, 0.999, 1e-8, 0.1, 3, True, False, 1.0,
                             _C.BF16_STATE_SEED + 3, 0)
    m3, v3 = m.clone(), v.clone()
    _C.adam_step_bf16_states("auto", p.clone(), g, m3, v3, None, 1e-3, 0.9, 0.999, 1e-8, 0.1, 3, True, False, 1.0,
                             _C.BF16_STATE_SEED + 2, 0)
    assert not torch.equal(v2.view(torch.int16), v3.view(torch.int16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("step_control", [False, True])
def test_bf16_states_cuda_engine_is_the_kernels_rounding(step_control):
    """The CUDA kernel table (step_control=True: the device step count, seed + step on the
    device) gives the CPU kernel's bits on the engine's own inputs."""
    from cuda_guard import CudaBuildError, cuda_build_problem
    problem = cuda_build_problem("cuda_adam_step_bf16_states")   # on a GPU machine: fail, not skip
    if problem is not None:
        raise CudaBuildError(problem)
    _kernel_check("cuda", step_control)


# ----------------------------------------------------------------------------- 3. world-size independence

def _independence_worker(rank, world, stage):
    torch.set_num_threads(1)
    out = {}
    for name, opts in (("bf16", dict(state_dtype="bf16")), ("fp32", {})):
        zm, zo = _train_mlp(rank, stage, opts, steps=4, same_batch=True)
        out[name] = _snapshot(zm, zo)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_states_world_size_independent(stage):
    """The same batch on every rank: 4 steps at world 1 and 2 give the same parameters and
    bf16 states, bit for bit (fp32 states: the same check, as the baseline that the
    gradients match). Stochastic rounding happened: the bf16 states differ from the fp32
    states rounded to nearest."""
    one = run_world(_independence_worker, 1, stage, reuse=True)[0]
    two = run_world(_independence_worker, 2, stage, reuse=True)
    diffs = _differences(one["fp32"], two[0]["fp32"], "fp32 states, world 1 vs 2")
    assert not diffs, "\n".join(diffs)     # the premise: identical gradients at both sizes
    for r in range(2):
        diffs = _differences(one["bf16"], two[r]["bf16"], f"bf16 states, world 1 vs 2 rank {r}")
        assert not diffs, "\n".join(diffs)
    sr = [k for k in one["bf16"][1] if k.endswith("exp_avg_sq")]
    assert sr and any(not torch.equal(one["bf16"][1][k], one["fp32"][1][k].bfloat16().float()) for k in sr)


# ----------------------------------------------------------------------------- 4. offload

def _offload_worker(rank, world, stage):
    diffs = []
    for opts in (dict(state_dtype="bf16"), dict(state_dtype="bf16", param_dtype="bf16", reduce_dtype="bf16")):
        ref = _snapshot(*_train_mlp(rank, stage, opts))
        off = _snapshot(*_train_mlp(rank, stage, dict(opts, offload="cpu")))
        diffs += _differences(ref, off, f"rank {rank} stage {stage} {opts}")
    return diffs


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_states_offload_bit_identical_one_rank(stage):
    diffs = _offload_worker(0, 1, stage)
    assert not diffs, "\n".join(diffs)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_states_offload_bit_identical_two_ranks(stage):
    diffs = [d for r in run_world(_offload_worker, 2, stage, reuse=True) for d in r]
    assert not diffs, "\n".join(diffs)


# ----------------------------------------------------------------------------- 5. memory

def _stats_worker(rank, world, stage, offload):
    import zero_ext
    out = {}
    for sd in ("fp32", "bf16"):
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        kw = dict(bucket_bytes=65536, first_bucket_bytes=8192, offload=offload, state_dtype=sd)
        est = zero_ext.estimate_memory(model, world, stage, optimizer=opt, **kw)
        zm, zo = _train_mlp(rank, stage, {k: v for k, v in kw.items() if "bucket" not in k}, steps=2)
        out[sd] = (est, zo.stats())
    return out


def _check_stats(results, offload):
    for rank, out in enumerate(results):
        for sd, (est, s) in out.items():
            assert s["model_state_bytes"] == est["model_state_bytes"], (rank, sd, s["model_state_bytes"],
                                                                        est["model_state_bytes"])
            if offload:
                host = {k: s["offload"][k] for k in est["offload"]}
                assert host == est["offload"], (rank, sd, host, est["offload"])
        f, b = out["fp32"][1], out["bf16"][1]
        where = (lambda s: s["offload"]) if offload else (lambda s: s["model_state_bytes"])
        # Adam's two states: 8 -> 4 bytes per element of the shard
        assert where(f)["optimizer_states"] - where(b)["optimizer_states"] == 4 * f["shard_numel"], (f, b)


@pytest.mark.parametrize("stage, offload", [(0, None), (1, None), (2, None), (3, None), (1, "cpu"), (2, "cpu")])
def test_bf16_states_stats_equal_estimate_one_rank(stage, offload):
    _check_stats([_stats_worker(0, 1, stage, offload)], offload)


@pytest.mark.dist
@pytest.mark.parametrize("stage, offload", [(1, None), (2, None), (3, None), (2, "cpu")])
def test_bf16_states_stats_equal_estimate_two_ranks(stage, offload):
    _check_stats(run_world(_stats_worker, 2, stage, offload, reuse=True), offload)


# ----------------------------------------------------------------------------- 6. checkpoints

def _states(zo):
    return {k: v.clone() for k, v in zo._engine.states().items()}


def _same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                              b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


def _checkpoint_worker(rank, world, path, stage):
    import zero_ext
    bad = []
    zm, zo = _train_mlp(rank, stage, dict(state_dtype="bf16"), steps=3)
    src = _states(zo)
    if sorted(src) != ["exp_avg", "exp_avg_sq"] or {t.dtype for t in src.values()} != {torch.bfloat16}:
        bad.append(f"the run's states are {[(k, t.dtype) for k, t in src.items()]}, not Adam's two in bf16")
    sd = zo.state_dict()
    if sd["state"][0]["exp_avg"].dtype != torch.float32:
        bad.append(f"state_dict() exp_avg is {sd['state'][0]['exp_avg'].dtype}, not torch's float32")
    zero_ext.save(path, zm, zo)
    # complete state dict, sharded state dict and zero_ext.load, into bf16 states: bit for bit
    for how in ("state_dict", "sharded", "save"):
        zm2, zo2 = _train_mlp(rank, stage, dict(state_dtype="bf16"), steps=0)
        if how == "state_dict":
            zm2.load_state_dict(zm.state_dict())
            zo2.load_state_dict(sd)
        elif how == "sharded":
            zo2.load_state_dict(zo.sharded_state_dict())
        else:
            zero_ext.load(path, zm2, zo2)
        for k, t in src.items():
            if not _same_bits(zo2._engine.states()[k], t):
                bad.append(f"{how}: {k} differs after the round trip")
        del zm2, zo2
    # into fp32 states: exact widening; and back into bf16 from the fp32 run's state (nearest)
    zm4, zo4 = _train_mlp(rank, stage, {}, steps=0)
    zero_ext.load(path, zm4, zo4)
    for k, t in src.items():
        if not torch.equal(zo4._engine.states()[k], t.float()):
            bad.append(f"bf16 checkpoint into fp32 states: {k} is not the exact widening")
    zm5, zo5 = _train_mlp(rank, stage, {}, steps=3)
    wide = _states(zo5)
    zm6, zo6 = _train_mlp(rank, stage, dict(state_dtype="bf16"), steps=0)
    zo6.load_state_dict(zo5.state_dict())
    for k, t in wide.items():
        if not _same_bits(zo6._engine.states()[k], t.bfloat16()):
            bad.append(f"fp32 state into bf16 states: {k} is not rounded to nearest")
    # a sharded state of the other state_dtype: refused, naming the fix
    try:
        zo6.load_state_dict(zo5.sharded_state_dict())
        bad.append("a sharded fp32 state loaded into bf16 states")
    except ValueError as e:
        if "state_dtype" not in str(e):
            bad.append(f"sharded load of the other state_dtype: {e}")
    return bad


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_states_checkpoint_round_trip_one_rank(tmp_path, stage):
    bad = _checkpoint_worker(0, 1, str(tmp_path / "ckpt"), stage)
    assert not bad, "\n".join(bad)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_states_checkpoint_round_trip_two_ranks(tmp_path, stage):
    bad = [b for r in run_world(_checkpoint_worker, 2, str(tmp_path / "ckpt"), stage, reuse=True) for b in r]
    assert not bad, "\n".join(bad)


def _resume_worker(rank, world):
    """3 steps, state_dict(), a fresh run loads it and takes 2 more: the same as 5 straight."""
    straight = _snapshot(*_train_mlp(rank, 2, dict(state_dtype="bf16"), steps=5))
    zm, zo = _train_mlp(rank, 2, dict(state_dtype="bf16"), steps=3)
    msd, osd = {k: v.clone() for k, v in zm.state_dict().items()}, zo.state_dict()
    import zero_ext
    from cases import batch
    model = _mlp()
    zm2, zo2 = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), stage=2,
                                bucket_bytes=65536, first_bucket_bytes=8192, state_dtype="bf16")
    zm2.load_state_dict(msd)
    zo2.load_state_dict(osd)
    for step in (3, 4):
        x, y = batch("mlp_big", rank, step, 0)
        zm2(x, y).backward()
        zo2.step()
        zo2.zero_grad()
    return _differences(straight, _snapshot(zm2, zo2), f"rank {rank}: resumed vs straight")


def test_bf16_states_resume_is_the_straight_run():
    diffs = _resume_worker(0, 1)
    assert not diffs, "\n".join(diffs)


@pytest.mark.dist
def test_bf16_states_resume_is_the_straight_run_two_ranks():
    diffs = [d for r in run_world(_resume_worker, 2, reuse=True) for d in r]
    assert not diffs, "\n".join(diffs)


# ----------------------------------------------------------------------------- 7. bad input

@pytest.mark.parametrize("make, opts, needle", [
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), {}, "amsgrad=False"),
    (lambda ps: torch.optim.Adam(ps, amsgrad=True), {}, "amsgrad=False"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {}, "torch.optim.AdamW or Adam"),
    (lambda ps: torch.optim.RMSprop(ps), {}, "torch.optim.AdamW or Adam"),
    (lambda ps: torch.optim.AdamW(ps), dict(fused="never"), "fused='auto'"),
], ids=["adamw-amsgrad", "adam-amsgrad", "sgd", "rmsprop", "fused-never"])
def test_bf16_states_bad_input_names_the_fix(make, opts, needle):
    import zero_ext
    model = _mlp()
    with pytest.raises(ValueError, match="state_dtype") as err:
        zero_ext.zeroify(model, make(model.parameters()), stage=2, state_dtype="bf16", **opts)
    assert needle in str(err.value), str(err.value)
    assert "state_dtype='fp32'" in str(err.value), str(err.value)


def test_state_dtype_unknown_and_estimate_refusals():
    import zero_ext
    with pytest.raises(ValueError, match="state_dtype must be 'fp32' or 'bf16'.*pass state_dtype="):
        zero_ext.ZeroConfig(state_dtype="fp8")
    assert zero_ext.ZeroConfig(state_dtype=torch.bfloat16).state_dtype == "bf16"
    with pytest.raises(ValueError, match="optimizer='adamw'"):
        zero_ext.estimate_memory(10_000, 2, 2, optimizer="sgd", state_dtype="bf16")
    with pytest.raises(ValueError, match="amsgrad=False"):
        zero_ext.estimate_memory(10_000, 2, 2, optimizer=torch.optim.AdamW(_mlp().parameters(), amsgrad=True),
                                 state_dtype="bf16")


def _bad_worker(rank, world):
    import zero_ext
    model = _mlp()
    zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), amsgrad=True), stage=2, state_dtype="bf16")


@pytest.mark.dist
def test_bf16_states_bad_input_raises_on_every_rank():
    """Refused in zeroify's rank-local checks, so every rank raises before a collective."""
    res = run_world(_bad_worker, 2, expect_errors=True)
    for r in res:
        assert not r["ok"] and "amsgrad=False" in str(r["error"]), res


def test_bf16_states_step_control_is_the_host_path():
    """step_control=True (the step count read by the kernel table, one call per bucket)
    draws the same bits as the host-counted path."""
    a = _snapshot(*_train_mlp(0, 2, dict(state_dtype="bf16", step_control=False)))
    b = _snapshot(*_train_mlp(0, 2, dict(state_dtype="bf16", step_control=True)))
    diffs = _differences(a, b, "step_control True vs False")
    assert not diffs, "\n".join(diffs)


# ----------------------------------------------------------------------------- the Muon recipe

def _muon_worker(rank, world):
    """Muon over the blocks' matrices beside AdamW (bf16 states) over the rest: AdamW's
    pieces fill Muon's tensor-atomic buckets at world > 1 (Note [Cut parameters]). The
    states are bf16, training goes on, and a complete state_dict round-trips bit for bit."""
    import zero_ext

    def build():
        model, data = _gpt()
        mats = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks")]
        rest = [p for p in model.parameters() if all(p is not w for w in mats)]
        zm, opts = zero_ext.zeroify(model, [torch.optim.Muon(mats, lr=1e-2), torch.optim.AdamW(rest, lr=3e-3)],
                                    stage=2, state_dtype="bf16")
        return zm, opts, data

    zm, opts, data = build()
    losses = []
    for step in range(4):
        x, y = data.get_batch("train", 4, 16, torch.Generator().manual_seed(1000 * rank + step))
        loss = zm(x, y)[1]
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(float(loss.detach()))
    bad = []
    st = opts[1]._core._engine.states()
    if {str(t.dtype) for k, t in st.items()} != {"torch.bfloat16"}:
        bad.append(f"states {[(k, t.dtype) for k, t in st.items()]}")
    if not all(l == l for l in losses) or losses[-1] >= losses[0]:
        bad.append(f"losses {losses}")
    sd = opts[1].state_dict()
    zm2, opts2, _ = build()
    opts2[1].load_state_dict(sd)
    st2 = opts2[1]._core._engine.states()
    for k, t in st.items():
        if not _same_bits(st2[k], t):
            bad.append(f"{k} differs after the round trip")
    return bad


def test_bf16_states_beside_muon_one_rank():
    bad = _muon_worker(0, 1)
    assert not bad, "\n".join(bad)


@pytest.mark.dist
def test_bf16_states_beside_muon_two_ranks():
    bad = [b for r in run_world(_muon_worker, 2, reuse=True) for b in r]
    assert not bad, "\n".join(bad)
