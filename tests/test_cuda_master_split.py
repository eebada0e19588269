"""The split master's CUDA join and split (zero_ext._C.cuda_master_join / cuda_master_split,
csrc/cuda/zx_cuda_master_split.cu) against the CPU kernels (master_join / master_split with
isa='scalar'), bit for bit: rem, the tie bytes (a partial last byte's unused bits 0) and the
joined masters, at lengths that end inside a warp's 32 elements and a tie byte, on views offset
by 0-3 elements (the kernels make no alignment assumption), and joins of edited parameters.
The fused Adam step of the split master (cuda_adam_step_split, Note [Fused split-master step])
against the join, cuda_adam_step into hi and split it replaces: hi, rem, ties and the states, bit
for bit (on the GPU: a NaN made from the infinities has other bits on an x86 CPU),
with stepped runs that start and end inside a tie byte.
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


ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=3, decoupled=True,
            amsgrad=False, maximize=False, grad_scale=1.0)


def unfused(hi, rem, ties, lead, grad, m, v, vmax, hp):
    """Join, cuda_adam_step over [lead, lead + n) writing hi, split: the three kernels the fused
    one replaces (each held to the CPU by the tests above and tests/test_cuda_kernels.py)."""
    hi, rem, ties, grad, m, v = (t.cuda() for t in (hi, rem, ties, grad, m, v))
    vmax = vmax.cuda() if vmax is not None else None
    master = torch.empty(hi.numel(), device="cuda")
    C.cuda_master_join(hi, rem, ties, master)
    n = grad.numel()
    C.cuda_adam_step(master[lead:lead + n], grad, m, v, vmax, hi[lead:lead + n], **hp)
    C.cuda_master_split(master, hi, rem, ties)
    return [t.cpu() if t is not None else None for t in (hi, rem, ties, m, v, vmax)]


# (total, lead, n): runs that start and end inside a tie byte and a warp, and a long one
RUNS = [(1, 0, 1), (8, 0, 8), (33, 5, 27), (257, 3, 250), (4099, 0, 4099), (1000003, 7, 999990)]


@pytest.mark.parametrize("total,lead,n", RUNS)
@pytest.mark.parametrize("variant", ["adamw", "adam_l2_amsgrad", "lr0_keeps_ties", "step_tensor"])
def test_fused_adam_step_matches_join_step_split(total, lead, n, variant):
    hp = dict(ADAM)
    if variant == "adam_l2_amsgrad":
        hp.update(decoupled=False, weight_decay=0.01, amsgrad=True, grad_scale=0.5)
    if variant == "lr0_keeps_ties":   # the masters do not move: ties and specials go back as they came
        hp.update(lr=0.0)
    if variant == "adamw":
        hp.update(weight_decay=0.1)
    g = torch.Generator().manual_seed(total + lead)
    master = masters(total, total + 1)
    hi = master.to(torch.bfloat16)
    rem, ties = cpu_split(master, hi)
    grad = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 0.01
    v = torch.rand(n, generator=g) * 1e-4
    vmax = v * 1.5 if hp["amsgrad"] else None
    want = unfused(hi, rem, ties, lead, grad, m, v, vmax, hp)
    d = [t.cuda() if t is not None else None for t in (hi, rem, ties, grad, m, v, vmax)]
    kw = {}
    if variant == "step_tensor":   # the step count read on the device (CUDA graphs)
        kw["step_tensor"] = torch.tensor([hp["step"]], device="cuda")
        hp = dict(hp, step=0)
    C.cuda_adam_step_split(*d, **hp, lead=lead, **kw)
    for name, w, got in zip(["hi", "rem", "ties", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
                            want, [d[0], d[1], d[2], d[4], d[5], d[6]]):
        if w is None:
            continue
        assert torch.equal(got.cpu().view(torch.uint8), w.view(torch.uint8)), name


def test_rejects_bad_input():
    hi = torch.zeros(10, dtype=torch.bfloat16, device="cuda")
    rem = torch.zeros(10, dtype=torch.int16, device="cuda")
    with pytest.raises(RuntimeError, match="ties has 1 elements, expected 2"):
        C.cuda_master_join(hi, rem, torch.zeros(1, dtype=torch.uint8, device="cuda"), torch.zeros(10, device="cuda"))
    with pytest.raises(RuntimeError, match="m must be a CUDA tensor|m is on"):
        C.cuda_master_split(torch.zeros(10), hi, rem, torch.zeros(2, dtype=torch.uint8, device="cuda"))
    with pytest.raises(RuntimeError, match="must end less than 8 elements before hi does"):
        z = torch.zeros(1, device="cuda")
        C.cuda_adam_step_split(hi, rem, torch.zeros(2, dtype=torch.uint8, device="cuda"), z, z, z, None,
                               **ADAM, lead=0)
