"""The CUDA bf16-state Adam step (zero_ext._C.cuda_adam_step_bf16_states) against the
CPU scalar kernel (adam_step_bf16_states('scalar', ...)), bit for bit.

Both compute the same fp32 operations and draw the stochastic-rounding bits from the
same hash of (seed, offset + i) (Note [Counter-based stochastic rounding] in
csrc/core/zx_sr.h), so param, both bf16 states and the copy-out must be identical:
odd lengths, views offset by one element (the scalar head + float4 body) and mixed
offsets (the all-scalar path), offsets that cross a 2^32 counter block, every variant.
With a device step count the hash uses seed + step (compared with the CPU kernel
called with that seed), also under a CUDA-graph replay.

Skipped without a GPU; on a GPU machine a build with no CUDA kernels fails (tests/cuda_guard.py).
Run: pytest tests/test_cuda_bf16_states.py -v
"""
import pytest
import torch

from cuda_guard import cuda_extension

C = cuda_extension("cuda_adam_step_bf16_states")   # skips without a GPU; fails on one without a CUDA build

DEV = torch.device("cuda")
LENGTHS = [1, 3, 5, 17, 1023, 100003]
LP_DTYPES = [None, torch.bfloat16, torch.float16]
CASES = {
    "adamw": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True,
                  maximize=False, grad_scale=1.0),
    "adam_l2": dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.1, decoupled=False,
                    maximize=False, grad_scale=1.0),
    "maximize_scaled_beta1_03": dict(lr=3e-4, beta1=0.3, beta2=0.95, eps=1e-8, weight_decay=0.0,
                                     decoupled=True, maximize=True, grad_scale=0.25),
}


def args(h, step, seed, offset):
    return (h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], step, h["decoupled"], h["maximize"],
            h["grad_scale"], seed, offset)


def make_state(n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g), (torch.randn(n, generator=g) * 0.01).to(torch.bfloat16),
            (torch.rand(n, generator=g) * 1e-4).to(torch.bfloat16))


def on_gpu(t, offset=0):
    """t copied to the GPU as a view starting `offset` elements into a fresh buffer."""
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=DEV)
    view = buf[offset:]
    view.copy_(t)
    return view


def assert_bits_equal(a, b, what):
    a, b = a.detach().cpu(), b.detach().cpu()
    ia = a.view(torch.int16) if a.element_size() == 2 else a.view(torch.int32)
    ib = b.view(torch.int16) if b.element_size() == 2 else b.view(torch.int32)
    same = ia == ib
    assert bool(same.all()), f"{what}: {int((~same).sum())} of {same.numel()} differ, first at {int((~same).nonzero()[0])}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("lp_dtype", LP_DTYPES, ids=str)
@pytest.mark.parametrize("view_offset", [0, 1])
def test_matches_cpu_kernel(case, n, lp_dtype, view_offset):
    h = CASES[case]
    p, m, v = make_state(n, seed=n)
    cpu = [p.clone(), m.clone(), v.clone()]
    gpu = [on_gpu(t, view_offset) for t in (p, m, v)]
    cpu_lp = torch.zeros(n, dtype=lp_dtype) if lp_dtype else None
    gpu_lp = on_gpu(torch.zeros(n, dtype=lp_dtype), view_offset) if lp_dtype else None
    gen = torch.Generator().manual_seed(n + 1)
    for step, counter0 in enumerate([0, 2**32 - 50, 7], start=1):
        g = torch.randn(n, generator=gen) * 0.1
        C.adam_step_bf16_states("scalar", cpu[0], g, cpu[1], cpu[2], cpu_lp, *args(h, step, 99 + step, counter0))
        C.cuda_adam_step_bf16_states(gpu[0], on_gpu(g, view_offset), gpu[1], gpu[2], gpu_lp,
                                     *args(h, step, 99 + step, counter0))
        torch.cuda.synchronize()
        for a, b, what in zip(gpu, cpu, ("param", "exp_avg", "exp_avg_sq")):
            assert_bits_equal(a, b, f"{case} step {step} {what}")
        if lp_dtype:
            assert_bits_equal(gpu_lp, cpu_lp, f"{case} step {step} param_lp")


@pytest.mark.parametrize("offsets", [(0, 1), (1, 2), (2, 0)])
def test_mixed_alignment_takes_scalar_path(offsets):
    """param/grad and the bf16 states misaligned differently: every element goes alone."""
    n, h = 4099, CASES["adamw"]
    p, m, v = make_state(n, seed=3)
    g = torch.randn(n, generator=torch.Generator().manual_seed(4)) * 0.1
    cpu = [p.clone(), m.clone(), v.clone()]
    C.adam_step_bf16_states("scalar", cpu[0], g, cpu[1], cpu[2], None, *args(h, 1, 5, 0))
    gpu = [on_gpu(p, offsets[0]), on_gpu(m, offsets[1]), on_gpu(v, offsets[0])]
    C.cuda_adam_step_bf16_states(gpu[0], on_gpu(g, offsets[0]), gpu[1], gpu[2], None, *args(h, 1, 5, 0))
    torch.cuda.synchronize()
    for a, b, what in zip(gpu, cpu, ("param", "exp_avg", "exp_avg_sq")):
        assert_bits_equal(a, b, what)


def test_device_step_hashes_with_seed_plus_step_and_replays():
    n, h, seed, offset = 10007, CASES["adamw"], 1234, 2**32 - 5000
    p, m, v = make_state(n, seed=11)
    gs = [torch.randn(n, generator=torch.Generator().manual_seed(20 + k)) * 0.1 for k in range(3)]
    cpu = [p.clone(), m.clone(), v.clone()]
    dev = [on_gpu(t) for t in (p, m, v)]
    step_t = torch.zeros(1, dtype=torch.int64, device=DEV)
    grad_buf = torch.empty(n, device=DEV)
    for step, g in enumerate(gs, start=1):
        C.adam_step_bf16_states("scalar", cpu[0], g, cpu[1], cpu[2], None, *args(h, step, seed + step, offset))
        grad_buf.copy_(g)
        C.cuda_increment_step(step_t)
        C.cuda_adam_step_bf16_states(dev[0], grad_buf, dev[1], dev[2], None, *args(h, 1, seed, offset),
                                     step_tensor=step_t)
    torch.cuda.synchronize()
    # states: the same bits (they do not depend on the bias corrections); param: the
    # device computes the bias corrections with its own pow (within an ulp, as cuda_adam_step)
    assert_bits_equal(dev[1], cpu[1], "exp_avg")
    assert_bits_equal(dev[2], cpu[2], "exp_avg_sq")
    assert torch.allclose(dev[0].cpu(), cpu[0], rtol=2**-22, atol=0)
    graph_state = [on_gpu(t) for t in (p, m, v)]
    step_t.zero_()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        C.cuda_increment_step(step_t)
        C.cuda_adam_step_bf16_states(graph_state[0], grad_buf, graph_state[1], graph_state[2], None,
                                     *args(h, 1, seed, offset), step_tensor=step_t)
    for g in gs:
        grad_buf.copy_(g)
        graph.replay()
    torch.cuda.synchronize()
    for a, b, what in zip(graph_state, dev, ("param", "exp_avg", "exp_avg_sq")):
        assert_bits_equal(a, b, f"graph replay {what}")


def test_rejects_bad_input():
    n, h = 8, CASES["adamw"]
    p, g = torch.zeros(n, device=DEV), torch.zeros(n, device=DEV)
    m, v = torch.zeros(n, dtype=torch.bfloat16, device=DEV), torch.zeros(n, dtype=torch.bfloat16, device=DEV)
    C.cuda_adam_step_bf16_states(p, g, m, v, None, *args(h, 1, 1, 0))
    with pytest.raises(RuntimeError, match="BFloat16|bfloat16"):
        C.cuda_adam_step_bf16_states(p, g, m.float(), v, None, *args(h, 1, 1, 0))
    with pytest.raises(RuntimeError, match="CUDA"):
        C.cuda_adam_step_bf16_states(p, g.cpu(), m, v, None, *args(h, 1, 1, 0))
    with pytest.raises(RuntimeError, match="step"):
        C.cuda_adam_step_bf16_states(p, g, m, v, None, *args(h, 0, 1, 0))
    bad = dict(h, beta1=1.0)
    with pytest.raises(RuntimeError, match="invalid argument"):
        C.cuda_adam_step_bf16_states(p, g, m, v, None, *args(bad, 1, 1, 0))
