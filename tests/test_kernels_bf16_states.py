"""Adam with bf16 states and stochastic rounding (zero_ext._C.adam_step_bf16_states)
against a reference written here in torch + numpy, bit for bit.

The reference repeats, independently of the C code:

* the fp32 maths of torch/optim/adam.py _single_tensor_adam, op for op on torch
  tensors (states widened from bf16, a correctly rounded sqrt as in test_kernels.py);
* the counter-based hash of Note [Counter-based stochastic rounding]
  (csrc/core/zx_sr.h) in explicit numpy uint64 arithmetic: every 32-bit product is
  taken in 64 bits and masked;
* the rounding: add 16 random bits to the low half of the fp32 pattern, truncate;
  NaN made quiet, a finite value saturating at the largest finite bf16.

For every ISA this CPU runs (the others are skipped with the reason), on lengths that
are not multiples of the vector width and one longer than a thread's 64K-element
grain, with offsets that cross a 2^32 counter block and wrap 2^64. Also: the result
does not depend on the number of threads or on splitting a range into calls, the
updates are unbiased where round to nearest would lose them, and bad arguments raise.

Run: .venv/bin/python -m pytest -q tests/test_kernels_bf16_states.py
"""
import numpy as np
import pytest
import torch

import zero_ext._C as C

ISAS = ["scalar", "avx2", "avx512"]
LENGTHS = [1, 17, 1000, 70001]   # 70001: more than one 64K-element task
OFFSETS = [0, 2**32 - 700, 2**64 - 40]
STEPS = 3
LR, EPS, BETA2 = 1e-3, 1e-8, 0.999
M32 = np.uint64(0xFFFFFFFF)

VARIANTS = {
    "adamw": dict(decoupled=True, maximize=False, weight_decay=0.01, beta1=0.9, grad_scale=1.0),
    "adam": dict(decoupled=False, maximize=False, weight_decay=0.0, beta1=0.9, grad_scale=1.0),
    "adam_l2_scaled": dict(decoupled=False, maximize=False, weight_decay=0.1, beta1=0.9, grad_scale=0.37),
    "adamw_maximize_beta1_03": dict(decoupled=True, maximize=True, weight_decay=0.1, beta1=0.3,
                                    grad_scale=1.0),
}


@pytest.fixture(params=ISAS)
def isa(request):
    if not C.isa_supported(request.param):
        pytest.skip(f"this CPU (or build) cannot run isa={request.param!r}")
    return request.param


# ---------------------------------------------------------------- the reference

def _mix(x):
    """The 32-bit avalanche step, on uint64 arrays holding 32-bit values."""
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x85EBCA6B)) & M32
    x = x ^ (x >> np.uint64(13))
    x = (x * np.uint64(0xC2B2AE35)) & M32
    return x ^ (x >> np.uint64(16))


def ref_bits(seed, offset, n):
    """The 32 random bits of counters offset .. offset + n - 1 (mod 2^64), as uint64."""
    seed = np.array([seed], dtype=np.uint64)
    s0 = _mix((seed & M32) ^ np.uint64(0x9E3779B9))
    s1 = _mix((seed >> np.uint64(32)) ^ s0 ^ np.uint64(0x7F4A7C15))
    with np.errstate(over="ignore"):
        counters = np.array([offset], dtype=np.uint64) + np.arange(n, dtype=np.uint64)   # wraps
    block_key = _mix((counters >> np.uint64(32)) ^ s1)
    return _mix(_mix((counters & M32) ^ s0) ^ block_key)


def ref_bf16_sr(x, r):
    """float32 tensor x, uint64 array r (< 2^16) -> torch.bfloat16 tensor, stochastically rounded."""
    u = x.contiguous().view(torch.int32).numpy().view(np.uint32).astype(np.uint64)
    a = u & np.uint64(0x7FFFFFFF)
    h = ((u + r) >> np.uint64(16)) & np.uint64(0xFFFF)
    saturate = ((h & np.uint64(0x7FFF)) == np.uint64(0x7F80)) & (a != np.uint64(0x7F800000))
    h = np.where(saturate, h - np.uint64(1), h)
    h = np.where(a > np.uint64(0x7F800000), (u >> np.uint64(16)) | np.uint64(0x40), h)
    return torch.from_numpy(h.astype(np.uint16).view(np.int16)).view(torch.bfloat16)


def ref_step(p, g, m_bf16, v_bf16, v, step, seed, offset):
    """One step of _single_tensor_adam on states widened from bf16; returns
    (param, exp_avg, exp_avg_sq) with the states stochastically rounded."""
    p = p.clone()
    beta1, wd = v["beta1"], v["weight_decay"]
    grad = g * v["grad_scale"]
    if v["maximize"]:
        grad = -grad
    if wd != 0:
        if v["decoupled"]:
            p.mul_(1 - LR * wd)
        else:
            grad = grad.add(p, alpha=wd)
    m = m_bf16.float()
    s = v_bf16.float()
    m.lerp_(grad, 1 - beta1)
    s.mul_(BETA2).addcmul_(grad, grad, value=1 - BETA2)
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2 = 1 - BETA2 ** float(step)
    step_size = LR / bias_correction1
    denom = (s.double().sqrt().float() / bias_correction2 ** 0.5).add_(EPS)
    p.addcdiv_(m, denom, value=-step_size)
    bits = ref_bits(seed, offset, p.numel())
    return p, ref_bf16_sr(m, bits & np.uint64(0xFFFF)), ref_bf16_sr(s, bits >> np.uint64(16))


# ---------------------------------------------------------------- helpers

def _inputs(n, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = (0.01 * torch.randn(n, generator=gen)).to(torch.bfloat16)
    s = (1e-4 * torch.rand(n, generator=gen)).to(torch.bfloat16)
    grads = [0.1 * torch.randn(n, generator=gen) for _ in range(STEPS)]
    return p, m, s, grads


def _ours(isa, p, g, m, s, v, step, seed, offset, param_lp=None):
    C.adam_step_bf16_states(isa, p, g, m, s, param_lp, LR, v["beta1"], BETA2, EPS, v["weight_decay"], step,
                            v["decoupled"], v["maximize"], v["grad_scale"], seed, offset)


def _bits(t):
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t.view(torch.int32)


def assert_bits_equal(ours, ref, what):
    same = _bits(ours) == _bits(ref)
    assert bool(same.all()), (
        f"{what}: {int((~same).sum())} of {same.numel()} elements differ; first at "
        f"{int((~same).nonzero()[0])} (ours {ours[(~same).nonzero()[0]].item()!r}, "
        f"reference {ref[(~same).nonzero()[0]].item()!r})")


# ---------------------------------------------------------------- bit for bit

@pytest.mark.parametrize("offset", OFFSETS, ids=["offset0", "offset_block", "offset_wrap"])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference_bit_for_bit(isa, variant, n, offset):
    v = VARIANTS[variant]
    p0, m0, s0, grads = _inputs(n, seed=n)
    p, m, s = p0.clone(), m0.clone(), s0.clone()
    rp, rm, rs = p0.clone(), m0.clone(), s0.clone()
    lp = torch.empty(n, dtype=torch.bfloat16)
    for step, g in enumerate(grads, start=1):
        seed = 0x5EED0000_00000000 + 1000 * step + n   # a new seed every step
        _ours(isa, p, g, m, s, v, step, seed, offset, param_lp=lp)
        rp, rm, rs = ref_step(rp, g, rm, rs, v, step, seed, offset)
        assert_bits_equal(p, rp, f"{variant} step {step} param")
        assert_bits_equal(m, rm, f"{variant} step {step} exp_avg")
        assert_bits_equal(s, rs, f"{variant} step {step} exp_avg_sq")
        assert_bits_equal(lp, rp.to(torch.bfloat16), f"{variant} step {step} param_lp")
    if n >= 1000:   # the rounding was exercised: it is not round to nearest of the fp32 state
        _, m1, _ = ref_step(p0, grads[0], m0, s0, v, 1, 1, offset)
        _, m2, _ = ref_step(p0, grads[0], m0, s0, v, 1, 2, offset)
        assert not torch.equal(_bits(m1), _bits(m2)), "two seeds rounded 1000+ states the same way"


def test_special_values_match_reference(isa):
    """beta1 = 0 stores the gradient itself as exp_avg: NaN, +-0, the largest finite
    floats (which saturate), subnormals go through the rounding unchanged by Adam."""
    vals = [float("nan"), -float("nan"), 3.4028234663852886e38, -3.4028234663852886e38, 0.0, -0.0,
            1.0, -2.5, 2.0**-140, -(2.0**-133), 1.1754943508222875e-38, 3.3895313892515355e38]
    n = 41
    g = torch.randn(n, generator=torch.Generator().manual_seed(5))
    g[: len(vals)] = torch.tensor(vals)
    v = dict(decoupled=True, maximize=False, weight_decay=0.0, beta1=0.0, grad_scale=1.0)
    p = torch.randn(n, generator=torch.Generator().manual_seed(6))
    m = torch.zeros(n, dtype=torch.bfloat16)
    s = torch.zeros(n, dtype=torch.bfloat16)
    rp, rm, rs = ref_step(p, g, m, s, v, 1, 77, 3)
    _ours(isa, p, g, m, s, v, 1, 77, 3)
    assert_bits_equal(m, rm, "exp_avg of special values")
    assert_bits_equal(s, rs, "exp_avg_sq of special values")
    assert_bits_equal(p, rp, "param")
    finite = torch.isfinite(g)
    assert bool(torch.isfinite(m.float()[finite]).all()), "a finite value was rounded to inf"
    assert bool(torch.isnan(m.float()[~finite]).all())


# ---------------------------------------------------------------- splits and threads

def test_threads_and_splits_do_not_change_the_result(isa):
    n, offset, seed = 200003, 2**32 - 99991, 12345
    v = VARIANTS["adamw"]
    p0, m0, s0, grads = _inputs(n, seed=1)
    results = []
    threads = torch.get_num_threads()
    try:
        for nthreads in sorted({1, max(2, threads)}):
            torch.set_num_threads(nthreads)
            p, m, s = p0.clone(), m0.clone(), s0.clone()
            _ours(isa, p, grads[0], m, s, v, 1, seed, offset)
            results.append((p, m, s))
    finally:
        torch.set_num_threads(threads)
    # the same range as three calls, each with its global offset
    p, m, s = p0.clone(), m0.clone(), s0.clone()
    for lo, hi in [(0, 7), (7, 100000), (100000, n)]:
        _ours(isa, p[lo:hi], grads[0][lo:hi], m[lo:hi], s[lo:hi], v, 1, seed, offset + lo)
    results.append((p, m, s))
    for k, (p, m, s) in enumerate(results[1:], start=1):
        assert_bits_equal(p, results[0][0], f"run {k} param")
        assert_bits_equal(m, results[0][1], f"run {k} exp_avg")
        assert_bits_equal(s, results[0][2], f"run {k} exp_avg_sq")


# ---------------------------------------------------------------- unbiased

def test_updates_below_half_an_ulp_are_kept_on_average(isa):
    """exp_avg = 1 moved by 1/8 of a bf16 ulp (round to nearest keeps 1): the mean of
    the stored states is the exact fp32 state within 4 standard errors."""
    n = 1 << 17
    v = dict(decoupled=True, maximize=False, weight_decay=0.0, beta1=0.5, grad_scale=1.0)
    ulp = 2.0**-7
    g = torch.full((n,), 1.0 + ulp / 4)
    p = torch.zeros(n)
    m = torch.ones(n, dtype=torch.bfloat16)
    s = torch.ones(n, dtype=torch.bfloat16)
    _ours(isa, p, g, m, s, v, 1, 2024, 0)
    exact = 1.0 + ulp / 8                       # lerp(1, 1 + ulp/4, 0.5), exact in fp32
    assert torch.tensor(exact).to(torch.bfloat16).item() == 1.0, "set-up: round to nearest loses it"
    frac = 1 / 8
    se = ulp * (frac * (1 - frac) / n) ** 0.5
    mean = m.double().mean().item()
    assert abs(mean - exact) <= 4 * se, f"mean {mean!r}, exact {exact!r}: {abs(mean - exact) / se:.1f} s.e."
    assert set(m.float().unique().tolist()) == {1.0, 1.0 + ulp}


# ---------------------------------------------------------------- errors

def test_bad_arguments_raise():
    n = 8
    p, g = torch.zeros(n), torch.zeros(n)
    m, s = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    args = (LR, 0.9, BETA2, EPS, 0.0, 1, True, False, 1.0, 1, 0)
    C.adam_step_bf16_states("scalar", p, g, m, s, None, *args)
    with pytest.raises(RuntimeError, match="bfloat16"):
        C.adam_step_bf16_states("scalar", p, g, m.float(), s, None, *args)
    with pytest.raises(RuntimeError, match="bfloat16"):
        C.adam_step_bf16_states("scalar", p, g, m, s.half(), None, *args)
    with pytest.raises(RuntimeError, match="float32"):
        C.adam_step_bf16_states("scalar", p.double(), g, m, s, None, *args)
    with pytest.raises(RuntimeError, match="elements"):
        C.adam_step_bf16_states("scalar", p, g, m[:4], s, None, *args)
    with pytest.raises(RuntimeError, match="contiguous"):
        C.adam_step_bf16_states("scalar", p, g, torch.zeros(2 * n, dtype=torch.bfloat16)[::2], s, None, *args)
    with pytest.raises(RuntimeError, match="unknown isa"):
        C.adam_step_bf16_states("sse9", p, g, m, s, None, *args)
    with pytest.raises(RuntimeError, match="invalid argument"):
        C.adam_step_bf16_states("scalar", p, g, m, s, None, LR, 0.9, BETA2, EPS, 0.0, 0, True, False, 1.0, 1, 0)
    with pytest.raises(RuntimeError, match="invalid argument"):
        C.adam_step_bf16_states("scalar", p, g, m, s, None, LR, 1.0, BETA2, EPS, 0.0, 1, True, False, 1.0, 1, 0)
    with pytest.raises(RuntimeError, match="param_lp"):
        C.adam_step_bf16_states("scalar", p, g, m, s, torch.zeros(n, dtype=torch.int16), *args)
