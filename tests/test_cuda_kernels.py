"""CUDA kernels vs the CPU scalar reference and vs torch.optim, on a GPU.

Every CUDA kernel of csrc/cuda is run on the same data as
  - the CPU scalar oracle (zero_ext._C.adam_step('scalar', ...) etc.): the GPU
    kernels repeat its exact sequence of IEEE operations, so fp32 results must be
    bit-identical (Note [Floating point] in csrc/cuda/zx_cuda_common.cuh), and
  - torch.optim's single-tensor implementation on CUDA tensors (foreach=False):
    within a few ulps (torch's CUDA kernels round slightly differently, e.g. they
    divide by a scalar through its reciprocal).
Covered: fp32 and bf16/fp16 copy-out, odd lengths, misaligned views (offset by one
element: the scalar head + float4 body path, and mixed offsets: the all-scalar
path), grad_scale, maximize, Adam (L2) and AdamW, amsgrad, SGD with momentum,
dampening, Nesterov, the device-side step count (and a CUDA-graph replay of it).

Skipped without a GPU; on a GPU machine a build with no CUDA kernels fails (tests/cuda_guard.py).
Run: pytest tests/test_cuda_kernels.py -v
"""
import math

import pytest
import torch

from cuda_guard import cuda_extension

C = cuda_extension("cuda_adam_step")   # skips without a GPU; fails on one without a CUDA build

HAS_CPU_REF = hasattr(C, "adam_step") and hasattr(C, "sgd_step")
needs_cpu_ref = pytest.mark.skipif(not HAS_CPU_REF, reason="zero_ext._C has no CPU adam_step/sgd_step")

DEV = torch.device("cuda")
LENGTHS = [1, 3, 5, 17, 1023, 4097, 100003]
LP_DTYPES = [None, torch.bfloat16, torch.float16]


# ----------------------------------------------------------------------------- helpers

def ulp_distance(a, b):
    """Largest distance in units in the last place between two fp32 tensors (NaN-free)."""
    a = a.detach().float().cpu().contiguous().view(torch.int32).long()
    b = b.detach().float().cpu().contiguous().view(torch.int32).long()
    # Map the sign-magnitude bit patterns onto a monotonic integer line (+0 == -0).
    a = torch.where(a < 0, -(a & 0x7FFFFFFF), a)
    b = torch.where(b < 0, -(b & 0x7FFFFFFF), b)
    return int((a - b).abs().max().item()) if a.numel() else 0


def ulp_of(x):
    """The spacing of fp32 at |x|, elementwise."""
    x = x.detach().float().abs()
    return torch.nextafter(x, torch.full_like(x, math.inf)) - x


def assert_update_close(ours, ref, prev, k, what, lr):
    """ours == ref within k ulps of the step's scale plus k ulps of the result.

    Adam's update is normalized: its size is about lr whatever the gradient, so a rounding
    difference upstream of the normalization (torch's CUDA ops fuse a multiply-add where the
    C reference rounds twice, e.g. in Adam's grad + weight_decay * param, which can cancel)
    shows up on the scale of lr, not of a parameter near zero (seen on an H200: 19 ulps of a
    parameter of 3e-5, 0.01 ulps of lr). A wrong formula is off by far more than this."""
    ours, ref, prev = (t.detach().float() for t in (ours, ref, prev))
    tol = k * (ulp_of(torch.maximum((ref - prev).abs(), torch.full_like(ref, lr))) + ulp_of(ref))
    err = (ours - ref).abs()
    bad = (err > tol).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} elements off by more than {k} ulps of the update, "
                              f"first at {bad[0].item()}: {ours[bad[0]].item()} vs {ref[bad[0]].item()}")


def assert_bits_equal(a, b, what):
    a = a.detach().cpu()
    b = b.detach().cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.dtype in (torch.bfloat16, torch.float16):
        ai, bi = a.view(torch.int16), b.view(torch.int16)
    else:
        ai, bi = a.float().view(torch.int32), b.float().view(torch.int32)
    bad = (ai != bi).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}: {a[tuple(bad[0])]} vs {b[tuple(bad[0])]}"


def on_gpu(t, offset=0, dtype=None):
    """A contiguous CUDA copy of t, as a view starting `offset` elements into its storage."""
    dtype = dtype or t.dtype
    storage = torch.empty(t.numel() + offset, dtype=dtype, device=DEV)
    view = storage[offset:offset + t.numel()]
    view.copy_(t)
    return view


def make_state(n, seed, amsgrad=False):
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=g)
    exp_avg = torch.randn(n, generator=g) * 1e-2
    exp_avg_sq = torch.rand(n, generator=g) * 1e-4
    max_sq = exp_avg_sq + torch.rand(n, generator=g) * 1e-4 if amsgrad else None
    return param, exp_avg, exp_avg_sq, max_sq


def grads(n, steps, seed):
    g = torch.Generator().manual_seed(seed + 1000)
    return [torch.randn(n, generator=g) * 0.1 for _ in range(steps)]


ADAM_CASES = {
    "adamw": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True,
                  amsgrad=False, maximize=False, grad_scale=1.0),
    "adam_l2": dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.1, decoupled=False,
                    amsgrad=False, maximize=False, grad_scale=1.0),
    "amsgrad": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True,
                    amsgrad=True, maximize=False, grad_scale=1.0),
    "maximize_scaled": dict(lr=3e-4, beta1=0.8, beta2=0.95, eps=1e-8, weight_decay=0.0, decoupled=True,
                            amsgrad=False, maximize=True, grad_scale=0.25),
    "small_beta1": dict(lr=1e-3, beta1=0.3, beta2=0.999, eps=1e-8, weight_decay=0.05, decoupled=False,
                        amsgrad=True, maximize=False, grad_scale=1.0 / 3.0),
}


def adam_args(h, step):
    return (h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], step, h["decoupled"],
            h["amsgrad"], h["maximize"], h["grad_scale"])


# ----------------------------------------------------------------------------- Adam

@needs_cpu_ref
@pytest.mark.parametrize("case", list(ADAM_CASES))
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("lp_dtype", LP_DTYPES, ids=str)
@pytest.mark.parametrize("offset", [0, 1])
def test_adam_matches_cpu_reference(case, n, lp_dtype, offset):
    h = ADAM_CASES[case]
    p, m, v, vmax = make_state(n, seed=n, amsgrad=h["amsgrad"])
    cpu = [t.clone() if t is not None else None for t in (p, m, v, vmax)]
    gpu = [on_gpu(t, offset) if t is not None else None for t in (p, m, v, vmax)]
    cpu_lp = torch.empty(n, dtype=lp_dtype) if lp_dtype else None
    gpu_lp = on_gpu(torch.zeros(n, dtype=lp_dtype), offset) if lp_dtype else None
    for step, g in enumerate(grads(n, 3, seed=n), start=1):
        C.adam_step("scalar", cpu[0], g, cpu[1], cpu[2], cpu[3], cpu_lp, *adam_args(h, step))
        C.cuda_adam_step(gpu[0], on_gpu(g, offset), gpu[1], gpu[2], gpu[3], gpu_lp, *adam_args(h, step))
    torch.cuda.synchronize()
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), gpu, cpu):
        if b is not None:
            assert_bits_equal(a, b, name)
    if lp_dtype:
        assert_bits_equal(gpu_lp, cpu_lp, "param_lp vs CPU")
        assert_bits_equal(gpu_lp, gpu[0].to(lp_dtype), "param_lp vs param.to()")


@pytest.mark.parametrize("offsets", [(0, 1, 0, 0), (1, 0, 1, 1), (2, 3, 1, 0)], ids=str)
def test_adam_mixed_alignment_takes_scalar_path(offsets):
    """Arrays misaligned by different amounts: all-scalar path, same numbers as aligned."""
    n = 4099
    h = ADAM_CASES["adamw"]
    p, m, v, _ = make_state(n, seed=7)
    g = grads(n, 1, seed=7)[0]
    ref = [on_gpu(t) for t in (p, m, v)]
    C.cuda_adam_step(ref[0], on_gpu(g), ref[1], ref[2], None, None, *adam_args(h, 1))
    mixed = [on_gpu(t, o) for t, o in zip((p, m, v), (offsets[0], offsets[2], offsets[3]))]
    lp = on_gpu(torch.zeros(n, dtype=torch.bfloat16), offsets[1])
    C.cuda_adam_step(mixed[0], on_gpu(g, offsets[1]), mixed[1], mixed[2], None, lp, *adam_args(h, 1))
    torch.cuda.synchronize()
    for a, b in zip(mixed, ref):
        assert_bits_equal(a, b, "mixed vs aligned")
    assert_bits_equal(lp, ref[0].to(torch.bfloat16), "param_lp")


@pytest.mark.parametrize("case", list(ADAM_CASES))
@pytest.mark.parametrize("n", [5, 4097])
def test_adam_matches_torch_optim(case, n):
    h = ADAM_CASES[case]
    p, _, _, _ = make_state(n, seed=3)
    zeros = torch.zeros(n)
    ours = [on_gpu(p), on_gpu(zeros), on_gpu(zeros), on_gpu(zeros) if h["amsgrad"] else None]
    ref = torch.nn.Parameter(p.clone().to(DEV))
    cls = torch.optim.AdamW if h["decoupled"] else torch.optim.Adam
    opt = cls([ref], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
              weight_decay=h["weight_decay"], amsgrad=h["amsgrad"], maximize=h["maximize"],
              foreach=False, fused=False)
    for step, g in enumerate(grads(n, 5, seed=3), start=1):
        g = g.to(DEV)
        ref.grad = g * torch.tensor(h["grad_scale"], dtype=torch.float32)  # same rounding as the kernel
        prev = ref.detach().clone()
        opt.step()
        C.cuda_adam_step(ours[0], g, ours[1], ours[2], ours[3], None, *adam_args(h, step))
        torch.cuda.synchronize()
        st = opt.state[ref]
        # Adam's L2 term g + wd * p can cancel: torch's CUDA ops fuse it, the C reference
        # rounds twice, so the moments are judged on the scale of |g| + wd * |p|.
        operand = g.abs() * h["grad_scale"] + h["weight_decay"] * prev.abs() if not h["decoupled"] else None
        for name, mine, theirs, sq in (("exp_avg", ours[1], st["exp_avg"], False),
                                       ("exp_avg_sq", ours[2], st["exp_avg_sq"], True)):
            if operand is None:
                assert ulp_distance(mine, theirs) <= 4, f"{name} after step {step}"
            else:
                scale = torch.maximum(theirs.abs(), operand ** 2 if sq else operand)
                err = (mine - theirs).abs()
                assert (err <= 4 * ulp_of(scale)).all(), f"{name} after step {step}: {(err / ulp_of(scale)).max()} ulps"
        assert_update_close(ours[0], ref, prev, 4, f"param after step {step}", h["lr"])


@pytest.mark.parametrize("lp_dtype", LP_DTYPES, ids=str)
def test_adam_device_step_and_graph_replay(lp_dtype):
    """step_tensor read on the device == host step; a captured step replays like eager ones."""
    n = 10007
    h = ADAM_CASES["amsgrad"]
    p, m, v, vmax = make_state(n, seed=11, amsgrad=True)
    gs = grads(n, 3, seed=11)
    host = [on_gpu(t) for t in (p, m, v, vmax)]
    dev = [on_gpu(t) for t in (p, m, v, vmax)]
    lp_host = torch.zeros(n, dtype=lp_dtype, device=DEV) if lp_dtype else None
    lp_dev = torch.zeros(n, dtype=lp_dtype, device=DEV) if lp_dtype else None
    step_t = torch.zeros(1, dtype=torch.int64, device=DEV)
    grad_buf = torch.empty(n, device=DEV)
    for step, g in enumerate(gs, start=1):
        C.cuda_adam_step(host[0], g.to(DEV), host[1], host[2], host[3], lp_host, *adam_args(h, step))
        grad_buf.copy_(g)
        C.cuda_increment_step(step_t)
        C.cuda_adam_step(dev[0], grad_buf, dev[1], dev[2], dev[3], lp_dev, *adam_args(h, 1), step_tensor=step_t)
    torch.cuda.synchronize()
    assert step_t.item() == 3
    for a, b in zip(dev, host):
        assert ulp_distance(a, b) <= 1
    # The same three steps, captured once and replayed.
    graph_state = [on_gpu(t) for t in (p, m, v, vmax)]
    graph_lp = torch.zeros(n, dtype=lp_dtype, device=DEV) if lp_dtype else None
    step_t.zero_()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the binding launches on the current (capture) stream
        C.cuda_increment_step(step_t)
        C.cuda_adam_step(graph_state[0], grad_buf, graph_state[1], graph_state[2], graph_state[3],
                         graph_lp, *adam_args(h, 1), step_tensor=step_t)
    torch.cuda.synchronize()
    # Capture does not run the kernels: state and step are untouched.
    assert step_t.item() == 0
    for g in gs:
        grad_buf.copy_(g)
        graph.replay()
    torch.cuda.synchronize()
    assert step_t.item() == 3
    for a, b in zip(graph_state, dev):
        assert_bits_equal(a, b, "graph replay vs eager")
    if lp_dtype:
        assert_bits_equal(graph_lp, lp_dev, "graph replay param_lp")


def test_adam_rejects_bad_input():
    n = 16
    t = lambda: torch.zeros(n, device=DEV)  # noqa: E731
    h = ADAM_CASES["amsgrad"]
    with pytest.raises(RuntimeError, match="max_exp_avg_sq"):
        C.cuda_adam_step(t(), t(), t(), t(), None, None, *adam_args(h, 1))
    h = ADAM_CASES["adamw"]
    with pytest.raises(RuntimeError, match="contiguous"):
        C.cuda_adam_step(torch.zeros(2 * n, device=DEV)[::2], t(), t(), t(), None, None, *adam_args(h, 1))
    with pytest.raises(RuntimeError, match="elements"):
        C.cuda_adam_step(t(), torch.zeros(n + 1, device=DEV), t(), t(), None, None, *adam_args(h, 1))
    with pytest.raises(RuntimeError, match="CUDA"):
        C.cuda_adam_step(t(), torch.zeros(n), t(), t(), None, None, *adam_args(h, 1))
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        C.cuda_adam_step(t(), t(), t(), t(), None, t(), *adam_args(h, 1))
    with pytest.raises(RuntimeError, match="step"):
        C.cuda_adam_step(t(), t(), t(), t(), None, None, *adam_args(h, 0))


# ----------------------------------------------------------------------------- SGD

SGD_CASES = {
    "plain": dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
                  grad_scale=1.0),
    "momentum_wd": dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-4, nesterov=False,
                        maximize=False, grad_scale=1.0),
    "nesterov": dict(lr=0.01, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, maximize=False,
                     grad_scale=0.5),
    "maximize": dict(lr=0.02, momentum=0.5, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=True,
                     grad_scale=1.0 / 3.0),
}


def sgd_args(h, first_step):
    return (h["lr"], h["momentum"], h["dampening"], h["weight_decay"], h["nesterov"], h["maximize"],
            first_step, h["grad_scale"])


@needs_cpu_ref
@pytest.mark.parametrize("case", list(SGD_CASES))
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("lp_dtype", LP_DTYPES, ids=str)
@pytest.mark.parametrize("offset", [0, 1])
def test_sgd_matches_cpu_reference(case, n, lp_dtype, offset):
    h = SGD_CASES[case]
    p, _, _, _ = make_state(n, seed=n + 5)
    has_buf = h["momentum"] != 0
    cpu_p, cpu_buf = p.clone(), torch.zeros(n) if has_buf else None
    gpu_p = on_gpu(p, offset)
    gpu_buf = on_gpu(torch.zeros(n), offset) if has_buf else None
    cpu_lp = torch.empty(n, dtype=lp_dtype) if lp_dtype else None
    gpu_lp = on_gpu(torch.zeros(n, dtype=lp_dtype), offset) if lp_dtype else None
    for k, g in enumerate(grads(n, 3, seed=n + 5)):
        C.sgd_step("scalar", cpu_p, g, cpu_buf, cpu_lp, *sgd_args(h, k == 0))
        C.cuda_sgd_step(gpu_p, on_gpu(g, offset), gpu_buf, gpu_lp, *sgd_args(h, k == 0))
    torch.cuda.synchronize()
    assert_bits_equal(gpu_p, cpu_p, "param")
    if has_buf:
        assert_bits_equal(gpu_buf, cpu_buf, "momentum_buf")
    if lp_dtype:
        assert_bits_equal(gpu_lp, cpu_lp, "param_lp vs CPU")


@pytest.mark.parametrize("case", list(SGD_CASES))
@pytest.mark.parametrize("n", [5, 4097])
def test_sgd_matches_torch_optim(case, n):
    h = SGD_CASES[case]
    p, _, _, _ = make_state(n, seed=9)
    ours_p = on_gpu(p)
    ours_buf = on_gpu(torch.zeros(n)) if h["momentum"] != 0 else None
    ref = torch.nn.Parameter(p.clone().to(DEV))
    opt = torch.optim.SGD([ref], lr=h["lr"], momentum=h["momentum"], dampening=h["dampening"],
                          weight_decay=h["weight_decay"], nesterov=h["nesterov"], maximize=h["maximize"],
                          foreach=False)
    for k, g in enumerate(grads(n, 5, seed=9)):
        g = g.to(DEV)
        ref.grad = g * torch.tensor(h["grad_scale"], dtype=torch.float32)
        opt.step()
        C.cuda_sgd_step(ours_p, g, ours_buf, None, *sgd_args(h, k == 0))
        torch.cuda.synchronize()
        assert ulp_distance(ours_p, ref.detach()) <= 2, f"param after step {k + 1}"
        if ours_buf is not None:
            assert ulp_distance(ours_buf, opt.state[ref]["momentum_buffer"]) <= 2


# ----------------------------------------------------------------------------- norm, scale

@pytest.mark.parametrize("n", LENGTHS + [3_000_001])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("scale", [1.0, 0.125, 1e-3])
def test_grad_sumsq(n, offset, scale):
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3.0
    bad = 0
    if n > 8:
        g[1] = math.inf
        g[n // 2] = -math.inf
        g[n - 1] = math.nan
        bad = 3
    finite = g[torch.isfinite(g)].double() * scale
    want = float((finite * finite).sum())
    sumsq, nonfinite = C.cuda_grad_sumsq(on_gpu(g, offset), scale)
    assert nonfinite == bad
    assert sumsq == pytest.approx(want, rel=2e-6)
    if HAS_CPU_REF and hasattr(C, "grad_sumsq"):
        cpu_sumsq, cpu_nonfinite = C.grad_sumsq("scalar", g, scale)
        assert cpu_nonfinite == nonfinite
        assert sumsq == pytest.approx(cpu_sumsq, rel=2e-6)


def test_grad_sumsq_into_accumulates():
    out2 = torch.zeros(2, device=DEV)
    a = torch.full((1000,), 2.0, device=DEV)
    b = torch.tensor([1.0, math.nan, 3.0], device=DEV)
    C.cuda_grad_sumsq_into(a, 0.5, out2)
    C.cuda_grad_sumsq_into(b, 0.5, out2)
    assert out2.tolist() == [1000.0 + 0.25 + 2.25, 1.0]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("offset", [0, 1])
def test_scale(n, offset):
    x = torch.randn(n)
    y = on_gpu(x, offset)
    C.cuda_scale(y, 0.1)
    assert_bits_equal(y, x.to(DEV) * torch.tensor(0.1, dtype=torch.float32), "scale")


# ----------------------------------------------------------------------------- pack

@pytest.mark.parametrize("slice_n", [1, 3, 4, 1023, 4096, 10001])
@pytest.mark.parametrize("nslices", [1, 2, 4, 7])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("offset", [0, 1])
def test_sum_slices(slice_n, nslices, accumulate, offset):
    src = torch.randn(nslices * slice_n, generator=torch.Generator().manual_seed(slice_n + nslices))
    dst0 = torch.randn(slice_n)
    scale = 1.0 / 3.0
    # Oracle: the same rounded adds, one torch op at a time, slices in increasing order.
    s = src[:slice_n].clone()
    for j in range(1, nslices):
        s = s + src[j * slice_n:(j + 1) * slice_n]
    t = torch.tensor(scale, dtype=torch.float32) * s
    want = dst0 + t if accumulate else t
    dst = on_gpu(dst0, offset)
    C.cuda_sum_slices(on_gpu(src, offset), dst, nslices, accumulate, scale)
    assert_bits_equal(dst, want, "sum_slices")


def test_sum_slices_in_place_on_slice0():
    slice_n, nslices = 1001, 4
    src_cpu = torch.randn(nslices * slice_n)
    want = src_cpu.view(nslices, slice_n)[0].clone()
    for j in range(1, nslices):
        want = want + src_cpu[j * slice_n:(j + 1) * slice_n]
    src = src_cpu.to(DEV)
    C.cuda_sum_slices(src, src[:slice_n], nslices, False, 1.0)
    assert_bits_equal(src[:slice_n], want, "in place")


def special_values():
    vals = torch.tensor([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, 1e30, -1e30, math.inf, -math.inf,
                         1e-40, -1e-40, 5.96e-8, 2.98e-8, 3.0e-8, 6.1e-5, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -9])
    rnd = torch.randn(4093, generator=torch.Generator().manual_seed(5)) * 100
    # bit patterns exactly halfway between two bf16 values (ties to even)
    ties = (torch.randint(0, 2 ** 15, (64,), generator=torch.Generator().manual_seed(6), dtype=torch.int32)
            << 16 | 0x8000).view(torch.float32)
    return torch.cat([vals, rnd, ties[torch.isfinite(ties)]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_cast_from_f32(dtype, offset):
    x = special_values()
    dst = on_gpu(torch.zeros(x.numel(), dtype=dtype), offset)
    C.cuda_cast_from_f32(on_gpu(x, offset), dst)
    assert_bits_equal(dst, x.to(DEV).to(dtype), f"cast to {dtype}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cast_from_f32_nan_stays_nan(dtype):
    x = torch.tensor([math.nan, -math.nan, 1.0, math.nan, 2.0, 3.0, 4.0])
    dst = torch.zeros(x.numel(), dtype=dtype, device=DEV)
    C.cuda_cast_from_f32(x.to(DEV), dst)
    assert torch.isnan(dst.float().cpu()).tolist() == torch.isnan(x).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("offset", [0, 1])
def test_cast_to_f32(dtype, offset):
    x = special_values().to(dtype)
    dst = on_gpu(torch.zeros(x.numel()), offset)
    C.cuda_cast_to_f32(on_gpu(x, offset), dst)
    assert_bits_equal(dst, x.to(DEV).float(), f"cast from {dtype}")
