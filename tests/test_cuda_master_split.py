"""The split master's CUDA join and split (zero_ext._C.cuda_master_join / cuda_master_split,
csrc/cuda/zx_cuda_master_split.cu) against the CPU kernels (master_join / master_split with
isa='scalar'), bit for bit: rem, the tie bytes (a partial last byte's unused bits 0) and the
joined masters, at lengths that end inside a warp's 32 elements and a tie byte, on views offset
by 0-3 elements (the kernels make no alignment assumption), and joins of edited parameters.
The CPU kernels are held to the formulas of Note [Split master] in
tests/test_master_split_kernels.py.

Skipped without a GPU; on a GPU machine a build with no CUDA kernels fails (tests/cuda_guard.py).
Run: pytest tests/test_cuda_master_split.py -v (make gpu-check: tests_master_split_cuda)
"""
import pytest
import torch

from cuda_guard import cuda_extension

C = cuda_extension("cuda_master_join")   # skips without a GPU; fails on one without a CUDA build

from test_master_split_kernels import edited, masters  # noqa: E402

LENGTHS = [1, 7, 8, 9, 31, 32, 33, 255, 256, 257, 4099, 1000003]


def cpu_split(m, hi):
    rem = torch.empty(m.numel(), dtype=torch.int16)
    ties = torch.full(((m.numel() + 7) // 8,), 0xFF, dtype=torch.uint8)
    C.master_split("scalar", m, hi, rem, ties)
    return rem, ties


def on_device(t, offset):
    """t on the GPU as a contiguous view that starts `offset` elements into its storage."""
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device="cuda")
    view = buf[offset:]
    view.copy_(t)
    return view


@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("n", LENGTHS)
def test_split_and_join_match_the_cpu(n, offset):
    m = masters(n, n)
    hi = m.to(torch.bfloat16)
    rem, ties = cpu_split(m, hi)
    d_m, d_hi = on_device(m, offset), on_device(hi, offset)
    d_rem = on_device(torch.zeros(n, dtype=torch.int16), offset)
    d_ties = on_device(torch.full(((n + 7) // 8,), 0xFF, dtype=torch.uint8), offset)
    C.cuda_master_split(d_m, d_hi, d_rem, d_ties)
    assert torch.equal(d_rem.cpu(), rem)
    assert torch.equal(d_ties.cpu(), ties)
    d_out = on_device(torch.full((n,), float("nan")), offset)
    C.cuda_master_join(d_hi, d_rem, d_ties, d_out)
    assert torch.equal(d_out.cpu().view(torch.int32), m.view(torch.int32))


def test_join_of_an_edited_parameter_matches_the_cpu():
    n = 100003
    hi, rem, ties = edited(n, 5)
    want = torch.empty(n)
    C.master_join("scalar", hi, rem, ties, want)
    got = torch.empty(n, device="cuda")
    C.cuda_master_join(hi.cuda(), rem.cuda(), ties.cuda(), got)
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))


def test_rejects_bad_input():
    hi = torch.zeros(10, dtype=torch.bfloat16, device="cuda")
    rem = torch.zeros(10, dtype=torch.int16, device="cuda")
    with pytest.raises(RuntimeError, match="ties has 1 elements, expected 2"):
        C.cuda_master_join(hi, rem, torch.zeros(1, dtype=torch.uint8, device="cuda"), torch.zeros(10, device="cuda"))
    with pytest.raises(RuntimeError, match="m must be a CUDA tensor|m is on"):
        C.cuda_master_split(torch.zeros(10), hi, rem, torch.zeros(2, dtype=torch.uint8, device="cuda"))
