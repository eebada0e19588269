"""Blockwise int8/int4 quantization kernels (zero_ext._C.quantize, dequantize,
dequantize_sum) against a torch reference written from the spec.

The spec (Note [Blockwise quantization] in csrc/core/zx_quant.c): per block of
block_numel elements, amax = max |x|; scale = amax / qmax (qmax 127 or 7), one ulp
higher when scale * qmax < amax; 0 for an all-zero block; NaN (and codes 0) for a
block with an inf/NaN; code = round_half_even(x / scale); dequantized =
code * scale. For every ISA this machine supports (others skipped with the reason),
fp32/bf16/fp16 inputs and outputs, lengths that are not multiples of the block,
one longer than a thread's 64K-element grain:

* codes, scales and dequantized values equal the reference bit for bit; every
  dequantized element is within half a step of its block of the input;
* int4 codes are packed two per byte, low nibble first, padding codes are 0;
* an inf/nan block dequantizes to NaN (the fp16 overflow scan sees it) and its
  neighbours are untouched;
* error feedback: the new residual is (x + residual) - dequantized, exactly;
* dequantize_sum equals the sequential fp32 sum of the dequantized slices times
  the scale (plus dst when accumulating);
* bad formats and mismatched buffers raise with a message naming the fix.

Run: .venv/bin/python -m pytest -q tests/test_quant_kernels.py
"""
import math

import pytest
import torch

import zero_ext._C as C

ISAS = ["scalar", "avx2", "avx512"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=ISAS)
def isa(request):
    if not C.isa_supported(request.param):
        pytest.skip(f"this CPU (or build) cannot run isa={request.param!r}")
    return request.param


def qmax_of(bits):
    return 127.0 if bits == 8 else 7.0


def ref_quantize(x, bits, block):
    """(codes int8 (nblocks, block), scales fp32 (nblocks,)) of fp32 x, from the spec."""
    n = x.numel()
    nblocks = -(-n // block)
    xp = torch.zeros(nblocks * block, dtype=torch.float32)
    xp[:n] = x
    xp = xp.view(nblocks, block)
    qmax = torch.tensor(qmax_of(bits), dtype=torch.float32)
    amax = xp.abs().amax(dim=1)
    finite = torch.isfinite(xp).all(dim=1)
    scale = amax / qmax
    low = scale * qmax < amax
    scale = torch.where(low, torch.nextafter(scale, torch.tensor(math.inf)), scale)
    safe = torch.where(finite & (amax > 0), scale, torch.ones_like(scale))
    codes = torch.round(xp / safe[:, None])
    codes = torch.where((finite & (amax > 0))[:, None], codes, torch.zeros_like(codes))
    scale = torch.where(finite, scale, torch.full_like(scale, math.nan))
    return codes.to(torch.int8), scale


def unpack(q, bits, nblocks, block):
    if bits == 8:
        return q.view(torch.int8).view(nblocks, block)
    lo = (q & 0x0F).to(torch.int16)
    hi = (q >> 4).to(torch.int16)
    v = torch.stack([lo, hi], dim=1).reshape(-1)
    v = torch.where(v >= 8, v - 16, v)
    return v.to(torch.int8).view(nblocks, block)


def run_quantize(isa, bits, block, src, residual=None):
    nbytes, nblocks = C.quant_sizes(bits, block, src.numel())
    q = torch.full((nbytes,), 0xA5, dtype=torch.uint8)
    scales = torch.empty(nblocks, dtype=torch.float32)
    C.quantize(isa, bits, block, src, q, scales, residual)
    return q, scales


def bits_equal(a, b):
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def random_blocks(n, block, gen):
    """Values of a different magnitude in each block; some all-zero blocks."""
    nblocks = -(-n // block)
    mags = torch.pow(10.0, torch.randint(-6, 5, (nblocks,), generator=gen).float())
    mags[torch.randint(0, nblocks, (max(1, nblocks // 7),), generator=gen)] = 0.0
    x = (torch.rand(nblocks * block, generator=gen) * 2 - 1) * mags.repeat_interleave(block)
    return x[:n].contiguous()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,block", [(1, 2), (1001, 64), (4097, 4096), (200_003, 100), (131_075, 2048)])
def test_quantize_matches_spec(isa, bits, dtype, n, block):
    gen = torch.Generator().manual_seed(n + block + bits)
    src = random_blocks(n, block, gen).to(dtype)
    x = src.float()
    q, scales = run_quantize(isa, bits, block, src)
    nblocks = scales.numel()
    codes_ref, scales_ref = ref_quantize(x, bits, block)
    assert bits_equal(scales, scales_ref), "scales differ from the spec"
    codes = unpack(q, bits, nblocks, block)
    assert torch.equal(codes, codes_ref), "codes differ from the spec (padding must be 0)"
    assert int(codes.abs().max()) <= qmax_of(bits)
    deq_ref = (codes_ref.float() * scales_ref[:, None]).reshape(-1)[:n]
    for out_dtype in DTYPES:
        out = torch.empty(n, dtype=out_dtype)
        C.dequantize(isa, bits, block, q, scales, out)
        assert torch.equal(out.view(torch.int16 if out_dtype != torch.float32 else torch.int32),
                           deq_ref.to(out_dtype).view(torch.int16 if out_dtype != torch.float32
                                                       else torch.int32)), out_dtype
    # error <= half a step of the block (+ fp32 rounding of x / scale and code * scale)
    step = scales.repeat_interleave(block)[:n].double()
    err = (x.double() - deq_ref.double()).abs()
    bound = 0.5 * step * (1 + 2**-20) + x.double().abs() * 2**-23 + 1e-45
    assert bool((err <= bound).all()), f"worst error {float((err - bound).max())} over the bound"


@pytest.mark.parametrize("bits", [8, 4])
def test_isas_bit_identical(isa, bits):
    gen = torch.Generator().manual_seed(7)
    for dtype in DTYPES:
        src = random_blocks(70_001, 256, gen).to(dtype)
        q0, s0 = run_quantize("scalar", bits, 256, src)
        q1, s1 = run_quantize(isa, bits, 256, src)
        assert torch.equal(q0, q1) and bits_equal(s0, s1), (isa, dtype)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_nan_blocks(isa, bits, dtype):
    block = 16
    x = torch.linspace(-1, 1, 5 * block)
    x[block + 3] = math.inf
    x[2 * block + 7] = math.nan
    x[4 * block + 1] = -math.inf
    src = x.to(dtype)
    q, scales = run_quantize(isa, bits, block, src)
    assert torch.isnan(scales[[1, 2, 4]]).all() and torch.isfinite(scales[[0, 3]]).all()
    out = torch.empty(5 * block, dtype=dtype)
    C.dequantize(isa, bits, block, q, scales, out)
    bad = torch.zeros(5, dtype=torch.bool)
    bad[[1, 2, 4]] = True
    bad = bad.repeat_interleave(block)
    assert torch.isnan(out[bad]).all() and torch.isfinite(out[~bad]).all()
    # the fp16 overflow scan (grad_sumsq) sees every element of those blocks
    _, nonfinite = C.grad_sumsq(isa, out.float(), 1.0)
    assert nonfinite == 3 * block


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_error_feedback(isa, bits, dtype):
    gen = torch.Generator().manual_seed(3)
    n, block = 5000, 128
    residual = torch.zeros(n)
    total_sent = torch.zeros(n, dtype=torch.float64)
    total_true = torch.zeros(n, dtype=torch.float64)
    for _ in range(4):
        src = random_blocks(n, block, gen).to(dtype)
        sent = src.float() + residual
        q, scales = run_quantize(isa, bits, block, src, residual)
        deq = torch.empty(n)
        C.dequantize(isa, bits, block, q, scales, deq)
        assert bits_equal(residual, sent - deq)
        total_sent += deq.double()
        total_true += src.double()
    # what was sent over the steps plus what is still owed equals what was given
    assert torch.allclose(total_sent + residual.double(), total_true, rtol=0, atol=1e-3)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("accumulate", [False, True])
def test_dequantize_sum(isa, bits, accumulate):
    gen = torch.Generator().manual_seed(11)
    n, block, nslices = 70_003, 512, 4
    qs, ss, deqs = [], [], []
    for _ in range(nslices):
        src = random_blocks(n, block, gen)
        q, s = run_quantize(isa, bits, block, src)
        d = torch.empty(n)
        C.dequantize(isa, bits, block, q, s, d)
        qs.append(q)
        ss.append(s)
        deqs.append(d)
    init = torch.randn(n, generator=gen)
    want = deqs[0].clone()
    for d in deqs[1:]:
        want = want + d
    want = torch.tensor(0.25) * want
    if accumulate:
        want = init + want
    dst = init.clone()
    C.dequantize_sum(isa, bits, block, torch.cat(qs), torch.cat(ss), nslices, dst, accumulate, 0.25)
    assert bits_equal(dst, want)


def test_bad_arguments():
    src = torch.randn(10)
    q = torch.empty(10, dtype=torch.uint8)
    s = torch.empty(5)
    with pytest.raises(RuntimeError, match="bits must be 8 or 4"):
        C.quantize("scalar", 3, 2, src, q, s)
    with pytest.raises(RuntimeError, match="positive even number for bits=4"):
        C.quantize("scalar", 4, 3, src, q, s)
    with pytest.raises(RuntimeError, match="q has 10 elements, expected 5"):
        C.quantize("scalar", 4, 2, src, q, s)
    with pytest.raises(RuntimeError, match="scales must be torch.float32"):
        C.quantize("scalar", 8, 2, src, q, s.double())
    with pytest.raises(RuntimeError, match="src must be torch.bfloat16 or torch.float16"):
        C.quantize("scalar", 8, 2, src.double(), q, s)
    with pytest.raises(RuntimeError, match="residual has 3 elements"):
        C.quantize("scalar", 8, 2, src, q, s, torch.zeros(3))
    with pytest.raises(RuntimeError, match="nslices must be >= 1"):
        C.dequantize_sum("scalar", 8, 2, q, s, 0, torch.zeros(10), False, 1.0)
