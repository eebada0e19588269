"""The split master's join and split kernels (Note [Split master], csrc/core/zx_master_split.c)
through their bindings, zero_ext._C.master_join / master_split, for every ISA this CPU runs,
against the note's formulas written here in torch integer arithmetic:

    d = bits(m) - (bits(hi) << 16)   rem = (int16) d   tie = d == 0x8000
    bits(master) = (bits(hi) << 16) + (tie ? 0x8000 : rem)   (a zero hi never takes a negative rem)

  - split then join gives every master back bit for bit, ties (m halfway between two bf16
    numbers, both directions) included; lengths that end inside a tie byte write 0 to its
    unused bits;
  - join of an edited hi (a parameter changed through p.data) keeps the old remainder, and a
    zero hi with a negative remainder joins to zero, not NaN;
  - bad input raises, naming the argument;
  - the fused Adam step of the split master (adam_step_split, Note [Fused split-master step])
    equals join, adam_step writing hi, split, bit for bit, for runs that start and end inside
    tie bytes and vectors, with AdamW, Adam + L2 + amsgrad, and lr = 0 (ties kept).
tests/test_cuda_master_split.py holds the CUDA kernels to these CPU ones.
Run: pytest tests/test_master_split_kernels.py -v
"""
import pytest
import torch

from zero_ext import _C

ISAS = [isa for isa in ("scalar", "avx2", "avx512") if _C.isa_supported(isa)]
LENGTHS = [1, 7, 8, 9, 31, 32, 33, 255, 1000, 4099]


def masters(n, seed):
    """fp32 masters with ties in both directions, zeros of both signs, subnormals and infinities."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    bits = m.view(torch.int32)
    k = torch.randint(0, 8, (n,), generator=g)
    bits[k == 0] = (bits[k == 0] & ~0xFFFF) | 0x8000                  # halfway: a tie
    bits[k == 1] = (bits[k == 1] & ~0x1FFFF) | 0x18000                 # halfway, odd hi: rounds up
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, float("inf"), -float("inf")])
    m[: min(n, 6)] = special[: min(n, 6)]
    return m


def u32(t):
    return t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def reference_split(m, hi):
    d = (u32(m) - ((hi.view(torch.int16).to(torch.int64) & 0xFFFF) << 16)) & 0xFFFFFFFF
    rem = (((d & 0xFFFF) ^ 0x8000) - 0x8000).to(torch.int16)
    return rem, pack(d == 0x8000)


def reference_join(hi, rem, ties):
    h = hi.view(torch.int16).to(torch.int64) & 0xFFFF
    d = torch.where(unpack(ties, hi.numel()), torch.tensor(0x8000), rem.to(torch.int64))
    d = torch.where(((h & 0x7FFF) == 0) & (d < 0), torch.tensor(0), d)
    b = ((h << 16) + d) & 0xFFFFFFFF
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def pack(bits):
    n = bits.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.int64)
    padded[:n] = bits.to(torch.int64)
    return (padded.view(-1, 8) << torch.arange(8)).sum(1).to(torch.uint8)


def unpack(ties, n):
    return ((ties.to(torch.int64).unsqueeze(1) >> torch.arange(8)) & 1).flatten()[:n].bool()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", LENGTHS)
def test_split_then_join_is_the_master(isa, n):
    m = masters(n, n)
    hi = m.to(torch.bfloat16)
    rem = torch.empty(n, dtype=torch.int16)
    ties = torch.full(((n + 7) // 8,), 0xFF, dtype=torch.uint8)   # unused bits must come back 0
    _C.master_split(isa, m, hi, rem, ties)
    want_rem, want_ties = reference_split(m, hi)
    assert torch.equal(rem, want_rem)
    assert torch.equal(ties, want_ties)
    out = torch.empty(n, dtype=torch.float32)
    _C.master_join(isa, hi, rem, ties, out)
    assert torch.equal(out.view(torch.int32), m.view(torch.int32)), "join(split(m)) is not m bit for bit"
    assert torch.equal(out.view(torch.int32), reference_join(hi, rem, ties).view(torch.int32))


def test_the_masters_hold_ties_in_both_directions():
    """The case the tie bit exists for: d = +0x8000 (kept by the bit) and d = -0x8000 (in rem)."""
    m = masters(4099, 1)
    hi = m.to(torch.bfloat16)
    d = (u32(m) - ((hi.view(torch.int16).to(torch.int64) & 0xFFFF) << 16)) & 0xFFFFFFFF
    assert int((d == 0x8000).sum()) > 100 and int((d == 0xFFFF8000).sum()) > 100


def edited(n, seed):
    """(hi, rem, ties) of parameters edited behind the split: any remainder and tie bits
    under a hi that did not come from them, zeros of both signs among the hi."""
    g = torch.Generator().manual_seed(seed)
    hi = (torch.randn(n, generator=g) * 10).to(torch.bfloat16)
    hi[::7] = 0.0
    hi[1::7] = -0.0
    rem = torch.randint(-2**15, 2**15, (n,), generator=g, dtype=torch.int16)
    ties = torch.randint(0, 256, ((n + 7) // 8,), generator=g, dtype=torch.uint8)
    return hi, rem, ties


@pytest.mark.parametrize("isa", ISAS)
def test_join_of_an_edited_parameter(isa):
    n = 1000
    hi, rem, ties = edited(n, 3)
    out = torch.empty(n, dtype=torch.float32)
    _C.master_join(isa, hi, rem, ties, out)
    assert torch.equal(out.view(torch.int32), reference_join(hi, rem, ties).view(torch.int32))
    assert not bool(out.isnan().any()), "a zero parameter with a negative remainder joined to NaN"


def test_bad_input_names_the_argument():
    hi = torch.zeros(10, dtype=torch.bfloat16)
    rem = torch.zeros(10, dtype=torch.int16)
    out = torch.zeros(10)
    with pytest.raises(RuntimeError, match="ties has 1 elements, expected 2"):
        _C.master_join("scalar", hi, rem, torch.zeros(1, dtype=torch.uint8), out)
    with pytest.raises(RuntimeError, match="rem must be torch.int16"):
        _C.master_split("scalar", out, hi, torch.zeros(10, dtype=torch.int32), torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="hi must be torch.bfloat16"):
        _C.master_join("scalar", hi.float(), rem, torch.zeros(2, dtype=torch.uint8), out)


ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3, decoupled=True,
            amsgrad=False, maximize=False, grad_scale=1.0)
# (total, lead, n): whole vectors only, runs starting and ending inside a tie byte, a lead past the
# first byte, a long run (both vector widths and the byte-by-byte ends)
RUNS = [(8, 0, 8), (17, 9, 8), (33, 5, 27), (257, 3, 250), (1000, 0, 993), (40003, 7, 39990)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("total,lead,n", RUNS)
@pytest.mark.parametrize("variant", ["adamw", "adam_l2_amsgrad", "lr0"])
def test_fused_adam_step_matches_join_step_split(isa, total, lead, n, variant):
    hp = dict(ADAM)
    if variant == "adam_l2_amsgrad":
        hp.update(decoupled=False, weight_decay=0.01, amsgrad=True, grad_scale=0.5)
    if variant == "lr0":
        hp.update(lr=0.0, weight_decay=0.0)
    g = torch.Generator().manual_seed(total + lead)
    master = masters(total, total + 1)
    hi = master.to(torch.bfloat16)
    rem = torch.empty(total, dtype=torch.int16)
    ties = torch.empty((total + 7) // 8, dtype=torch.uint8)
    _C.master_split("scalar", master, hi, rem, ties)
    grad = torch.randn(n, generator=g)
    m, v = torch.randn(n, generator=g) * 0.01, torch.rand(n, generator=g) * 1e-4
    vmax = v * 1.5 if hp["amsgrad"] else None
    want = [t.clone() if t is not None else None for t in (hi, rem, ties, m, v, vmax)]
    before = (hi.clone(), rem.clone(), ties.clone())   # lr0
    joined = torch.empty(total)
    _C.master_join("scalar", want[0], want[1], want[2], joined)
    _C.adam_step("scalar", joined[lead:lead + n], grad, want[3], want[4], want[5], want[0][lead:lead + n], **hp)
    _C.master_split("scalar", joined, want[0], want[1], want[2])
    _C.adam_step_split(isa, hi, rem, ties, grad, m, v, vmax, **hp, lead=lead)
    for name, w, got in zip(["hi", "rem", "ties", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"], want,
                            [hi, rem, ties, m, v, vmax]):
        if w is not None:
            assert torch.equal(got.view(torch.uint8), w.view(torch.uint8)), name
    if variant == "lr0":   # the masters do not move (-0 may become +0): every tie bit is kept
        assert torch.equal(ties, before[2])
        assert total < 100 or int(ties.sum()) > 0, "masters() made no tie"


def test_fused_adam_step_bad_input():
    hi = torch.zeros(16, dtype=torch.bfloat16)
    rem = torch.zeros(16, dtype=torch.int16)
    ties = torch.zeros(2, dtype=torch.uint8)
    z = torch.zeros(8)
    with pytest.raises(RuntimeError, match="must end less than 8 elements before hi does"):
        _C.adam_step_split("scalar", hi, rem, ties, z, z, z, None, **ADAM, lead=0)
    with pytest.raises(RuntimeError, match="exp_avg has 7 elements, expected 8"):
        _C.adam_step_split("scalar", hi, rem, ties, z, z[:7], z, None, **ADAM, lead=8)
