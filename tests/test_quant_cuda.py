"""Blockwise int8/int4 quantization on the GPU (zero_ext._C.cuda_quantize,
cuda_dequantize, cuda_dequantize_sum) against the CPU scalar reference, bit for bit
(Note [Blockwise quantization] in csrc/core/zx_quant.c; the CUDA kernels use the
same correctly rounded operations): codes, scales, error-feedback residuals and
dequantized fp32/bf16/fp16 values (a NaN matching any NaN), for fp32/bf16/fp16 inputs, lengths that are not
multiples of the block, blocks larger than a thread block, inf/nan and all-zero
blocks, and the fused all-to-all slice sum.

Skipped without a GPU; on a GPU machine a build with no CUDA kernels fails (tests/cuda_guard.py).
Run: pytest tests/test_quant_cuda.py -v
"""
import math

import pytest
import torch

from cuda_guard import cuda_extension

C = cuda_extension("cuda_quantize")   # skips without a GPU; fails on one without a CUDA build

DEV = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def as_bits(t):
    t = t.detach().cpu().contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def same_values(cpu, gpu):
    """Bit for bit, except that a NaN matches any NaN: a NaN's payload is not part of the
    contract. x86 propagates the quiet NaN of the scale (0x7fc00000); the GPU's multiply
    and add return their canonical NaN (0x7fffffff), as seen on an H100."""
    cpu, gpu = cpu.detach().cpu(), gpu.detach().cpu()
    nan = torch.isnan(cpu.float())
    if not torch.equal(nan, torch.isnan(gpu.float())):
        return False
    return torch.equal(as_bits(cpu)[~nan], as_bits(gpu)[~nan])


def inputs(n, block, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    nblocks = -(-n // block)
    mags = torch.pow(10.0, torch.randint(-6, 5, (nblocks,), generator=gen).float())
    mags[0] = 0.0                                     # an all-zero block
    x = ((torch.rand(nblocks * block, generator=gen) * 2 - 1) * mags.repeat_interleave(block))[:n]
    if nblocks > 3:
        x[block + 1] = math.inf                       # an inf block
        x[2 * block] = math.nan                       # a nan block
    return x.to(dtype).contiguous()


def cpu_quantize(bits, block, src, residual=None):
    nbytes, nblocks = C.quant_sizes(bits, block, src.numel())
    q = torch.empty(nbytes, dtype=torch.uint8)
    s = torch.empty(nblocks)
    C.quantize("scalar", bits, block, src, q, s, residual)
    return q, s


def gpu_quantize(bits, block, src, residual=None):
    nbytes, nblocks = C.quant_sizes(bits, block, src.numel())
    q = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device=DEV)
    s = torch.empty(nblocks, device=DEV)
    C.cuda_quantize(bits, block, src.to(DEV), q, s, None if residual is None else residual)
    return q, s


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,block", [(1, 2), (1001, 64), (70_001, 4096), (100_003, 100)])
def test_quantize_dequantize_bit_identical(bits, dtype, n, block):
    src = inputs(n, block, dtype, n + bits)
    q0, s0 = cpu_quantize(bits, block, src)
    q1, s1 = gpu_quantize(bits, block, src)
    torch.cuda.synchronize()
    assert torch.equal(q0, q1.cpu()), "codes differ from the CPU reference"
    assert torch.equal(as_bits(s0), as_bits(s1)), "scales differ from the CPU reference"
    for out_dtype in DTYPES:
        d0 = torch.empty(n, dtype=out_dtype)
        C.dequantize("scalar", bits, block, q0, s0, d0)
        d1 = torch.empty(n, dtype=out_dtype, device=DEV)
        C.cuda_dequantize(bits, block, q1, s1, d1)
        assert same_values(d0, d1), f"dequantized {out_dtype} differs"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_error_feedback_bit_identical(bits, dtype):
    n, block = 50_001, 256
    r0 = torch.zeros(n)
    r1 = torch.zeros(n, device=DEV)
    for step in range(3):
        src = inputs(n, block, dtype, 100 + step)
        q0, s0 = cpu_quantize(bits, block, src, r0)
        q1, s1 = gpu_quantize(bits, block, src, r1)
        assert torch.equal(q0, q1.cpu()) and torch.equal(as_bits(s0), as_bits(s1))
        assert torch.equal(as_bits(r0), as_bits(r1)), f"residuals differ at step {step}"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("accumulate", [False, True])
def test_dequantize_sum_bit_identical(bits, accumulate):
    n, block, nslices = 30_001, 512, 4
    qs, ss = [], []
    for j in range(nslices):
        q, s = cpu_quantize(bits, block, inputs(n, block, torch.float32, 7 + j))
        qs.append(q)
        ss.append(s)
    q, s = torch.cat(qs), torch.cat(ss)
    init = torch.randn(n)
    d0 = init.clone()
    C.dequantize_sum("scalar", bits, block, q, s, nslices, d0, accumulate, 0.25)
    d1 = init.to(DEV)
    C.cuda_dequantize_sum(bits, block, q.to(DEV), s.to(DEV), nslices, d1, accumulate, 0.25)
    assert same_values(d0, d1)
    assert torch.isnan(d1[block:3 * block]).all(), "inf/nan blocks must stay NaN after the sum"
