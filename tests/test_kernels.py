"""CPU optimizer kernels (zero_ext._C.adam_step, sgd_step, ...) against torch.

For every ISA this machine supports (scalar, avx2, avx512; the others are skipped
with the reason), on random data of lengths that are not multiples of the SIMD
width, including one longer than a thread's 64K-element grain:

* Adam / AdamW / SGD run 5 steps next to torch.optim (foreach=False) on the same
  tensors and stay within 4 ulps (SGD: bit-identical);
* Adam is bit-identical to torch's own single-tensor op sequence once torch's
  sqrt (not correctly rounded on CPU, +-1 ulp) is replaced by a correctly
  rounded one — i.e. we follow torch's arithmetic order exactly;
* bf16 / fp16 copy-out equals param.to(dtype) of our fp32 result;
* grad_sumsq equals a double-precision sum of squares within 1e-12 and counts
  inf/nan; sum_slices equals a sequential torch sum; casts round-trip.

Run: .venv/bin/python -m pytest -q tests/test_kernels.py
"""
import math

import pytest
import torch

import zero_ext._C as C

ISAS = ["scalar", "avx2", "avx512"]
LENGTHS = [1, 7, 17, 33, 1000, 70001]  # 70001: more than one 64K-element task
STEPS = 5
MAX_ULP = 4


@pytest.fixture(params=ISAS)
def isa(request):
    if not C.isa_supported(request.param):
        pytest.skip(f"this CPU (or build) cannot run isa={request.param!r}")
    return request.param


def _ordered(x):
    """float32 bits as int64 on a line that is monotone in the value."""
    i = x.view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(2**31) - i, i)


def ulp_distance(a, b, floor=0.0):
    """Element-wise distance in ulps. Ulps are counted at max(|a|, |b|, floor):
    a value that ends near zero keeps the absolute rounding error of the larger
    steps that brought it there, so `floor` is the scale of one step."""
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
    d = (_ordered(a) - _ordered(b)).abs()
    if floor > 0:
        mag = torch.maximum(torch.maximum(a.abs(), b.abs()), torch.tensor(floor))
        ulp = torch.nextafter(mag, torch.tensor(math.inf)) - mag
        d = torch.minimum(d, ((a - b).abs().double() / ulp.double()).ceil().to(torch.int64))
    return d


def assert_close_ulp(ours, ref, what, floor=0.0, max_ulp=MAX_ULP):
    d = ulp_distance(ours, ref, floor)
    worst = int(d.max()) if d.numel() else 0
    assert worst <= max_ulp, (
        f"{what}: {int((d > max_ulp).sum())} of {d.numel()} elements further than {max_ulp} ulps "
        f"(worst {worst} at index {int(d.argmax())}: ours {ours.flatten()[d.argmax()].item()!r}, "
        f"torch {ref.flatten()[d.argmax()].item()!r})")


def assert_bits_equal(ours, ref, what):
    same = ours.view(torch.int32) == ref.view(torch.int32)
    assert bool(same.all()), (
        f"{what}: {int((~same).sum())} of {same.numel()} elements differ; first at "
        f"{int((~same).nonzero()[0])}")


# ---------------------------------------------------------------- Adam / AdamW

ADAM_VARIANTS = {
    "adamw": dict(decoupled=True, amsgrad=False, maximize=False, weight_decay=0.01),
    "adam": dict(decoupled=False, amsgrad=False, maximize=False, weight_decay=0.0),
    "adam_l2": dict(decoupled=False, amsgrad=False, maximize=False, weight_decay=0.1),
    "adamw_amsgrad": dict(decoupled=True, amsgrad=True, maximize=False, weight_decay=0.1),
    "adam_amsgrad_maximize_l2": dict(decoupled=False, amsgrad=True, maximize=True, weight_decay=0.1),
    "adamw_maximize_beta1_03": dict(decoupled=True, amsgrad=False, maximize=True, weight_decay=0.1,
                                    beta1=0.3),
}
LR, EPS, BETA2 = 1e-3, 1e-8, 0.999


def _grads(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for _ in range(STEPS)]


def _run_ours_adam(isa, p0, grads, v, param_lp=None, grad_scale=1.0):
    p = p0.clone()
    m, s = torch.zeros_like(p), torch.zeros_like(p)
    s_max = torch.zeros_like(p) if v["amsgrad"] else None
    for step, g in enumerate(grads, start=1):
        C.adam_step(isa, p, g, m, s, s_max, param_lp, LR, v.get("beta1", 0.9), BETA2, EPS,
                    v["weight_decay"], step, v["decoupled"], v["amsgrad"], v["maximize"], grad_scale)
    return p, m, s, s_max


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("variant", list(ADAM_VARIANTS))
def test_adam_matches_torch_optim(isa, variant, n):
    v = ADAM_VARIANTS[variant]
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(n))
    grads = _grads(n, seed=n + 1)
    p, m, s, s_max = _run_ours_adam(isa, p0, grads, v)

    q = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if v["decoupled"] else torch.optim.Adam
    opt = cls([q], lr=LR, betas=(v.get("beta1", 0.9), BETA2), eps=EPS,
              weight_decay=v["weight_decay"], amsgrad=v["amsgrad"], maximize=v["maximize"],
              foreach=False)
    for g in grads:
        q.grad = g.clone()
        opt.step()
    st = opt.state[q]
    assert_close_ulp(p, q.detach(), f"{variant} param", floor=LR)
    assert_close_ulp(m, st["exp_avg"], f"{variant} exp_avg", floor=LR)
    assert_close_ulp(s, st["exp_avg_sq"], f"{variant} exp_avg_sq", floor=LR * LR)
    if v["amsgrad"]:
        assert_close_ulp(s_max, st["max_exp_avg_sq"], f"{variant} max_exp_avg_sq", floor=LR * LR)


def _torch_adam_replica(p0, grads, v):
    """torch/optim/adam.py _single_tensor_adam (non-capturable), op for op, with a
    correctly rounded sqrt (torch's fp32 CPU sqrt may be 1 ulp off)."""
    p = p0.clone()
    m, s, s_max = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    beta1, wd = v.get("beta1", 0.9), v["weight_decay"]
    for step, g in enumerate(grads, start=1):
        grad = -g if v["maximize"] else g
        if wd != 0:
            if v["decoupled"]:
                p.mul_(1 - LR * wd)
            else:
                grad = grad.add(p, alpha=wd)
        m.lerp_(grad, 1 - beta1)
        s.mul_(BETA2).addcmul_(grad, grad, value=1 - BETA2)
        step_f = float(step)
        bias_correction1 = 1 - beta1**step_f
        bias_correction2 = 1 - BETA2**step_f
        step_size = LR / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        src = s
        if v["amsgrad"]:
            torch.maximum(s_max, s, out=s_max)
            src = s_max
        denom = (src.double().sqrt().float() / bias_correction2_sqrt).add_(EPS)
        p.addcdiv_(m, denom, value=-step_size)
    return p, m, s, s_max


@pytest.mark.parametrize("variant", list(ADAM_VARIANTS))
def test_adam_bit_exact_vs_torch_op_sequence(isa, variant):
    v = ADAM_VARIANTS[variant]
    n = 4099
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(7))
    grads = _grads(n, seed=8)
    p, m, s, s_max = _run_ours_adam(isa, p0, grads, v)
    rp, rm, rs, rs_max = _torch_adam_replica(p0, grads, v)
    assert_bits_equal(p, rp, f"{variant} param")
    assert_bits_equal(m, rm, f"{variant} exp_avg")
    assert_bits_equal(s, rs, f"{variant} exp_avg_sq")
    if v["amsgrad"]:
        assert_bits_equal(s_max, rs_max, f"{variant} max_exp_avg_sq")


def test_adam_grad_scale_is_a_pre_multiplied_gradient(isa):
    v = ADAM_VARIANTS["adamw"]
    n = 1001
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(3))
    grads = _grads(n, seed=4)
    a = _run_ours_adam(isa, p0, grads, v, grad_scale=0.37)
    b = _run_ours_adam(isa, p0, [g * 0.37 for g in grads], v)
    for x, y, what in zip(a[:3], b[:3], ("param", "exp_avg", "exp_avg_sq")):
        assert_bits_equal(x, y, what)


# ---------------------------------------------------------------- SGD

SGD_VARIANTS = {
    "plain": dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False),
    "wd_maximize": dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.1, maximize=True),
    "momentum": dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False),
    "momentum_dampening_wd": dict(momentum=0.9, dampening=0.2, nesterov=False, weight_decay=0.1,
                                  maximize=False),
    "nesterov": dict(momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.0, maximize=False),
    "nesterov_wd_maximize": dict(momentum=0.8, dampening=0.0, nesterov=True, weight_decay=0.1,
                                 maximize=True),
}
SGD_LR = 0.05


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("variant", list(SGD_VARIANTS))
def test_sgd_matches_torch_optim(isa, variant, n):
    v = SGD_VARIANTS[variant]
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(n))
    grads = _grads(n, seed=n + 2)
    p = p0.clone()
    buf = torch.empty_like(p) if v["momentum"] else None  # garbage: first_step overwrites it
    for step, g in enumerate(grads, start=1):
        C.sgd_step(isa, p, g, buf, None, SGD_LR, v["momentum"], v["dampening"], v["weight_decay"],
                   v["nesterov"], v["maximize"], step == 1, 1.0)
    q = torch.nn.Parameter(p0.clone())
    opt = torch.optim.SGD([q], lr=SGD_LR, momentum=v["momentum"], dampening=v["dampening"],
                          weight_decay=v["weight_decay"], nesterov=v["nesterov"],
                          maximize=v["maximize"], foreach=False)
    for g in grads:
        q.grad = g.clone()
        opt.step()
    assert_close_ulp(p, q.detach(), f"{variant} param", floor=SGD_LR)
    # SGD is bit-for-bit (no sqrt, same fused multiply-adds as ATen)
    assert_bits_equal(p, q.detach(), f"{variant} param")
    if v["momentum"]:
        assert_bits_equal(buf, opt.state[q]["momentum_buffer"], f"{variant} momentum_buffer")


# ---------------------------------------------------------------- copy-out

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [17, 4097, 70001])
def test_copy_out_equals_torch_cast(isa, dtype, n):
    gen = torch.Generator().manual_seed(11)
    p = torch.randn(n, generator=gen) * 3
    p[: min(n, 8)] = torch.tensor([0.0, -0.0, 1e-40, 65504.0, 65520.0, 1e5, -3e38, 1.00390625])[: min(n, 8)]
    m, s = torch.zeros_like(p), torch.zeros_like(p)
    lp = torch.empty(n, dtype=dtype)
    for step in range(1, 3):
        g = torch.randn(n, generator=gen)
        C.adam_step(isa, p, g, m, s, None, lp, LR, 0.9, BETA2, EPS, 0.01, step, True, False, False, 1.0)
        assert torch.equal(lp.view(torch.int16), p.to(dtype).view(torch.int16)), f"adam {dtype} copy-out"
    buf = torch.zeros_like(p)
    for step in range(1, 3):
        g = torch.randn(n, generator=gen)
        C.sgd_step(isa, p, g, buf, lp, SGD_LR, 0.9, 0.0, 0.0, True, False, step == 1, 1.0)
        assert torch.equal(lp.view(torch.int16), p.to(dtype).view(torch.int16)), f"sgd {dtype} copy-out"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_casts_round_trip(isa, dtype):
    gen = torch.Generator().manual_seed(5)
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e-45, -1e-40, 1.1754942e-38,
                            3.4028235e38, -3.4028235e38, 65504.0, 65519.99, 65520.0, 2.0**-24,
                            2.0**-25, 1.5 * 2.0**-25, 6.1e-5, 1.00390625, 1.01171875])
    x = torch.cat([special, torch.randn(5000, generator=gen) * 100,
                   torch.randint(-(2**31), 2**31 - 1, (5000,), generator=gen,
                                 dtype=torch.int32).view(torch.float32)])
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)  # NaN bits are checked below
    lo = torch.empty(x.numel(), dtype=dtype)
    C.cast_from_f32(isa, x, lo)
    assert torch.equal(lo.view(torch.int16), x.to(dtype).view(torch.int16))
    back = torch.empty_like(x)
    C.cast_to_f32(isa, lo, back)
    assert torch.equal(back.view(torch.int32), lo.float().view(torch.int32))
    # NaN stays NaN
    nan = torch.full((33,), math.nan)
    lo = torch.empty(33, dtype=dtype)
    C.cast_from_f32(isa, nan, lo)
    assert bool(torch.isnan(lo.float()).all())
    # fp32 -> fp32 is a copy
    y = torch.empty_like(x)
    C.cast_from_f32(isa, x, y)
    assert torch.equal(x, y)


# ---------------------------------------------------------------- scans and reductions

@pytest.mark.parametrize("n", [0, 1, 15, 1000, 200003])
@pytest.mark.parametrize("inject", [False, True])
def test_grad_sumsq(isa, n, inject):
    gen = torch.Generator().manual_seed(n)
    g = torch.randn(n, generator=gen) * 10
    if inject and n:
        idx = torch.randint(0, n, (n // 7 + 1,), generator=gen)
        g[idx[0::3]] = math.inf
        g[idx[1::3]] = -math.inf
        g[idx[2::3]] = math.nan
    scale = 0.37
    sumsq, nonfinite = C.grad_sumsq(isa, g, scale)
    finite = torch.isfinite(g)
    scale_f32 = torch.tensor(scale, dtype=torch.float32).item()  # the kernel's scale is a float
    want = ((g[finite].double() * scale_f32) ** 2).sum().item()
    assert nonfinite == int((~finite).sum())
    assert abs(sumsq - want) <= 1e-12 * want, (sumsq, want)


@pytest.mark.parametrize("nslices", [1, 2, 3, 4])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("n", [1, 17, 1000, 70001])
def test_sum_slices(isa, nslices, accumulate, n):
    gen = torch.Generator().manual_seed(nslices * 1000 + n)
    src = torch.randn(nslices * n, generator=gen)
    dst = torch.randn(n, generator=gen)
    scale = 0.25
    rows = src.view(nslices, n)
    s = rows[0].clone()
    for j in range(1, nslices):
        s = s + rows[j]  # the documented order: slices in increasing j
    want = (dst + scale * s) if accumulate else scale * s
    assert torch.allclose(want, (dst if accumulate else 0) + scale * rows.sum(0), rtol=1e-5, atol=1e-6)
    C.sum_slices(isa, src, nslices, dst, accumulate, scale)
    assert_bits_equal(dst, want, "sum_slices")


def test_sum_slices_in_place_into_slice_0(isa):
    src = torch.randn(3 * 100, generator=torch.Generator().manual_seed(1))
    want = src.view(3, 100).sum(0)
    dst = src[:100]
    C.sum_slices(isa, src, 3, dst, False, 1.0)
    assert torch.allclose(dst, want, rtol=1e-6, atol=1e-6)


def test_scale(isa):
    x = torch.randn(70001, generator=torch.Generator().manual_seed(2))
    want = x * 0.3
    C.scale(isa, x, 0.3)
    assert_bits_equal(x, want, "scale")


# ---------------------------------------------------------------- argument checks

def test_bad_arguments_raise():
    n = 16
    p, g, m, s = (torch.zeros(n) for _ in range(4))
    args = (0.001, 0.9, 0.999, 1e-8, 0.0, 1, True, False, False, 1.0)
    with pytest.raises(RuntimeError, match="unknown isa"):
        C.adam_step("sse9", p, g, m, s, None, None, *args)
    with pytest.raises(RuntimeError, match="float32"):
        C.adam_step("scalar", p.double(), g, m, s, None, None, *args)
    with pytest.raises(RuntimeError, match="elements"):
        C.adam_step("scalar", p, g[:8], m, s, None, None, *args)
    with pytest.raises(RuntimeError, match="contiguous"):
        C.adam_step("scalar", torch.zeros(2 * n)[::2], g, m, s, None, None, *args)
    with pytest.raises(RuntimeError, match="max_exp_avg_sq"):
        C.adam_step("scalar", p, g, m, s, None, None, 0.001, 0.9, 0.999, 1e-8, 0.0, 1, True, True,
                    False, 1.0)
    with pytest.raises(RuntimeError, match="bfloat16 or torch.float16"):
        C.adam_step("scalar", p, g, m, s, None, torch.zeros(n, dtype=torch.int16), *args)
    with pytest.raises(RuntimeError, match="invalid argument"):
        C.adam_step("scalar", p, g, m, s, None, None, 0.001, 1.0, 0.999, 1e-8, 0.0, 1, True, False,
                    False, 1.0)
    with pytest.raises(RuntimeError, match="momentum_buf"):
        C.sgd_step("scalar", p, g, None, None, 0.1, 0.9, 0.0, 0.0, False, False, True, 1.0)
    with pytest.raises(RuntimeError, match="nesterov"):
        C.sgd_step("scalar", p, g, m, None, 0.1, 0.9, 0.5, 0.0, True, False, True, 1.0)
    with pytest.raises(RuntimeError, match="elements"):
        C.sum_slices("scalar", torch.zeros(3 * n), 2, p, False, 1.0)
    with pytest.raises(RuntimeError, match="overlap"):
        C.sum_slices("scalar", p, 1, p, True, 1.0)
    for name in ISAS:
        if not C.isa_supported(name):
            with pytest.raises(RuntimeError, match="cannot run"):
                C.adam_step(name, p, g, m, s, None, None, *args)
    assert C.best_isa() in ISAS and C.isa_supported(C.best_isa())


def test_isa_cap_from_the_environment(monkeypatch):
    """ZX_ISA caps the ISAs this CPU is said to run (Note [ISA cap] in csrc/core/zx_cpu.c), so
    the suite can run as on an AVX2-only machine; it never adds one the CPU lacks. The core
    reads it on every call, so setting it here is seen at once."""
    def answer():
        return C.best_isa(), [C.isa_supported(i) for i in ISAS]

    monkeypatch.delenv("ZX_ISA", raising=False)    # the CPU's own answer (the suite may run under a cap)
    _, native = answer()
    assert native[0]
    for cap, allowed in (("scalar", 1), ("avx2", 2), ("avx512", 3), ("", 3), ("sse", 3)):
        monkeypatch.setenv("ZX_ISA", cap)
        best, supported = answer()
        want = [s and k < allowed for k, s in enumerate(native)]
        assert supported == want, (cap, supported, native)
        assert best == ISAS[max(k for k, s in enumerate(want) if s)], (cap, best)
        if not want[-1]:
            with pytest.raises(RuntimeError, match="cannot run"):
                C.grad_sumsq("avx512", torch.ones(8), 1.0)
