"""Optimizer offload (offload="cpu") with CUDA parameters, on one GPU: the copy stream,
the pinned rings and the worker thread for real (Note [Optimizer offload] in
csrc/engine/offload.h). Skipped cleanly without a CUDA device or a CUDA build.

  - stages 1-3, fp32 and bf16 (+ bf16 reduce), 1 rank: losses and parameters after 10
    steps against the same run without offload on the GPU. The gradients are the same
    bits (the same device computes them); the steps differ only in where the Adam kernel
    runs (the host's C kernel vs the device's), so the parameters agree to rounding
    (relative 1e-5 after 10 steps; bf16 parameters to one bf16 ulp);
  - 2 ranks sharing the GPU over cuda:gloo, stage 2 and 3, against the same two ranks
    without offload: both ranks end with the same parameters, within 1e-5 of the device
    step's, and the loss falls (each rank's stream repeats two batches: uniform random
    tokens never seen twice stay at ln(vocab), whatever the optimizer does);
  - memory: the device holds no master, no optimizer state and (stages 2-3) no gradient
    shard: torch.cuda.memory_allocated() after a step is below the run without offload by
    at least the bytes stats()["offload"] says moved to the host (master + states + gradients).
Run: pytest tests/test_offload_cuda.py -v (make gpu-check runs it as tests_offload).
"""
import pytest
import torch

from cuda_guard import cuda_extension

_C = cuda_extension("cuda_adam_step")   # skips without a GPU; fails on one without a CUDA build

import zero_ext  # noqa: E402
from cases import TINY_GPT  # noqa: E402
from dist_harness import run_world  # noqa: E402

STEPS = 10


def _train(device, stage, offload, steps=STEPS, rank=0, batches=None, **opts):
    """batches=None: a fresh batch every step; batches=k: each rank cycles through k."""
    from gpt import GPT, GPTConfig
    torch.manual_seed(1)
    model = GPT(GPTConfig(**TINY_GPT)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    zm, zo = zero_ext.zeroify(model, opt, stage=stage, offload=offload, bucket_bytes=65536,
                              first_bucket_bytes=8192, **opts)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + (step if batches is None else step % batches))
        idx = torch.randint(0, TINY_GPT["vocab_size"], (4, TINY_GPT["block_size"] + 1), generator=g).to(device)
        loss = zm(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(zm.parameters(), 1.0)
        zo.step()
        zo.zero_grad()
        losses.append(float(loss.detach()))
    with zero_ext.gathered_parameters(model):   # stage 3: whole only inside
        params = [p.detach().float().cpu() for p in model.parameters()]
    assert all(p.numel() > 0 for p in params)
    return losses, params, zo.stats(), (zm, zo)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("pdt", ["fp32", "bf16"])
def test_offload_on_cuda_matches_the_device_step(stage, pdt):
    opts = dict(param_dtype=pdt, reduce_dtype=pdt)
    ref = _train("cuda", stage, None, **opts)
    off = _train("cuda", stage, "cpu", **opts)
    assert off[2]["offload"]["down_copies"] > 0 and off[2]["offload"]["up_copies"] > 0, off[2]["offload"]
    # the master, the states and the gradient shard live in host memory (the master was once
    # made on the device: ShardView::on_shard asked the Offload before it existed)
    engine = off[3][1]._engine
    held = engine.param_shards() + engine.grad_shards() + list(engine.states().values())
    assert held and all(t.device.type == "cpu" for t in held), sorted({str(t.device) for t in held})
    tol = 1e-5 if pdt == "fp32" else 2 ** -7
    for i, (a, b) in enumerate(zip(ref[1], off[1])):
        rel = ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item()
        assert rel <= tol, f"parameter {i}: relative difference {rel:.3g} > {tol}"
    for a, b in zip(ref[0], off[0]):
        assert abs(a - b) <= 1e-2 * abs(a), (ref[0], off[0])


def _with_and_without_offload(rank, world, stage):
    torch.cuda.set_device(0)
    ref = _train("cuda", stage, None, rank=rank, batches=2)
    off = _train("cuda", stage, "cpu", rank=rank, batches=2)
    return ref[:2], off[:2]


@pytest.mark.dist
@pytest.mark.parametrize("stage", [2, 3])
def test_offload_two_ranks_on_one_gpu(stage):
    """2 ranks over cuda:gloo (NCCL's shape): both ranks end with the same parameters, those
    of the same run without offload to rounding (the host's Adam kernel against the
    device's), and the loss falls."""
    out = run_world(_with_and_without_offload, 2, stage, backend="cuda:gloo", timeout_s=300)
    (_, p0), (l0, p0_off) = out[0]
    (_, p1), (_, p1_off) = out[1]
    assert all(torch.equal(a, b) for a, b in zip(p0_off, p1_off)), "ranks disagree on the parameters"
    assert all(torch.equal(a, b) for a, b in zip(p0, p1)), "ranks disagree without offload"
    for i, (a, b) in enumerate(zip(p0, p0_off)):
        rel = ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item()
        assert rel <= 1e-5, f"parameter {i}: offload differs from the device step by {rel:.3g}"
    assert l0[-1] < l0[0] - 0.05, l0


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_frees_device_memory(stage):
    def held(offload):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        losses, params, stats, objs = _train("cuda", stage, offload, steps=2, param_dtype="bf16",
                                             reduce_dtype="bf16")
        torch.cuda.synchronize()
        now = torch.cuda.memory_allocated() - before
        del objs
        return now, stats
    base, _ = held(None)
    off, stats = held("cpu")
    moved = stats["offload"]["master_weights"] + stats["offload"]["optimizer_states"] + stats["offload"]["gradients"]
    assert base - off >= 0.9 * moved - stats["offload"]["pinned_ring"], (base, off, stats["offload"])
