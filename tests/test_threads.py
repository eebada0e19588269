"""The extension's parallel loops run on torch's intra-op threads.

Without OpenMP at build time, ATen's inline at::parallel_for runs every loop on
the calling thread (setup.py, Note [Intra-op threads]); nothing but a probe can
tell, since the results are the same. So:

* zero_ext._C.parallel_threads_seen(n) runs the kernels' own loop helper and
  counts the distinct threads that ran a task: exactly 1 with
  torch.set_num_threads(1), exactly 2 with 2 threads (it fails on a serial build);
* the kernels' and the engine's results (gradient norm, fused step) do not depend
  on the thread count (bit for bit).

Run: .venv/bin/python -m pytest -q tests/test_threads.py
"""
import pytest
import torch

import zero_ext._C as C

GRAIN = 1 << 16  # kParallelGrainNumel, csrc/parallel.h


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("n", [1, 2])
def test_loop_runs_on_torch_threads(threads, n):
    threads(n)
    assert torch.get_num_threads() == n
    # 8 tasks' worth of elements: every thread gets one
    seen = [C.parallel_threads_seen(8 * GRAIN) for _ in range(3)]
    assert seen == [n] * 3, (f"with torch.set_num_threads({n}) the kernels' parallel loop ran on {seen} "
                             f"threads; was the extension built without -fopenmp? (setup.py)")
    # a loop shorter than one task stays on the calling thread
    assert C.parallel_threads_seen(GRAIN) == 1


def test_results_do_not_depend_on_threads(threads):
    n = 5 * GRAIN + 123
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=g) for _ in range(2)] + [torch.rand(n, generator=g)]
    grad = torch.randn(n, generator=g)
    out = {}
    for t in (1, 2):
        threads(t)
        p, m, v = (x.clone() for x in init)
        lp = torch.empty(n, dtype=torch.bfloat16)
        for step in (1, 2):
            C.adam_step("auto", p, grad, m, v, None, lp, 1e-3, 0.9, 0.999, 1e-8, 0.01, step, True, False,
                        False, 1.0)
        out[t] = (p, m, v, lp, C.grad_sumsq("auto", grad, 0.5))
    for a, b in zip(out[1][:4], out[2][:4]):
        assert torch.equal(a, b)
    assert out[1][4] == out[2][4]


def test_engine_results_do_not_depend_on_threads(threads):
    """The engine's loops (gradient norm, fused AdamW step) over a shard of several
    64K-element tasks: the same bits with 1 and 2 threads, and torch's norm. The
    gradients come from one thread in both runs: torch's own matmul gives other bits
    with another thread count (seen on an AVX-512 machine), which is not ours to test."""
    import zero_ext

    torch.manual_seed(1)
    base = torch.nn.Linear(1000, 333)
    x = torch.randn(8, 1000)
    out = {}
    for t in (1, 2):
        threads(1)
        model = torch.nn.Linear(1000, 333)
        model.load_state_dict(base.state_dict())
        zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=1)
        zm(x).square().sum().backward()
        threads(t)
        norm = float(zo.clip_grad_norm_(1.0))
        zo.step()
        out[t] = (norm, [p.detach().clone() for p in model.parameters()])
    threads(1)
    ref_model = torch.nn.Linear(1000, 333)
    ref_model.load_state_dict(base.state_dict())
    ref_model(x).square().sum().backward()
    ref = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ref_model.parameters()]).double()))
    assert out[1][0] == out[2][0], f"gradient norm with 1 thread {out[1][0]!r}, with 2 {out[2][0]!r}"
    assert abs(out[1][0] - ref) <= 1e-6 * ref, (out[1][0], ref)
    for a, b in zip(out[1][1], out[2][1]):
        assert torch.equal(a, b)
