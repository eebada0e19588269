"""torch.compile and zeroify, in both orders users write, stages 0-3, against compiled DDP.

- compile, then zeroify: `model = torch.compile(model)` and the compiled module wrapped
  (its parameters are the plain module's);
- zeroify, then compile: the returned model compiled (`torch.compile(model)`), the
  engine's hooks running around the compiled forward (graph breaks where they must).
Each trains 3 steps of a small MLP on 2 gloo ranks beside DDP over the same compiled
module: every loss within 1e-5 relative (fp32), and the parameters after the last step.
Inductor's CPU backend, as users get it; its compile cache makes the repeats cheap.
"""
import pytest
import torch

from dist_harness import run_world

pytestmark = pytest.mark.dist

REL = 1e-5


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 4))


def _train(model, opt, rank):
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _own_inductor_cache():
    """Inductor's compile cache, one per ATen CPU capability. torch 2.13's cache does not key
    on it: on an AVX-512 machine, kernels cached by a run under ATEN_CPU_CAPABILITY=avx2 (the
    suite run as on an AVX2-only machine, docs/install.md) made a later run at the native
    capability abort ("malloc(): unaligned tcache chunk detected"), every time, until the
    cache was removed; each capability in a fresh cache passes."""
    import os

    from torch._inductor.runtime.cache_dir_utils import cache_dir
    sub = f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"
    if os.path.basename(cache_dir()) != sub:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir(), sub)


def _compiled(rank, world):
    import zero_ext
    from torch.nn.parallel import DistributedDataParallel as DDP
    _own_inductor_cache()
    torch._dynamo.reset()
    out = {}
    net = _net()
    ddp = DDP(torch.compile(net))
    out["ddp"] = (_train(ddp, torch.optim.AdamW(net.parameters(), lr=1e-2), rank),
                  [p.detach().clone() for p in net.parameters()])
    for stage in (0, 1, 2, 3):
        for order in ("compile_then_wrap", "wrap_then_compile"):
            net = _net()
            opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
            if order == "compile_then_wrap":
                zm, zo = zero_ext.zeroify(torch.compile(net), opt, stage=stage, min_unit_numel=0)
            else:
                zm, zo = zero_ext.zeroify(net, opt, stage=stage, min_unit_numel=0)
                zm = torch.compile(zm)
            losses = _train(zm, zo, rank)
            with zero_ext.gathered_parameters(zm):
                params = [p.detach().clone() for p in net.parameters()]
            out[(stage, order)] = (losses, params)
    return out


def test_compiled_models_train_as_compiled_ddp():
    for rank, out in enumerate(run_world(_compiled, 2, timeout_s=600)):
        ref_losses, ref_params = out["ddp"]
        for key, (losses, params) in out.items():
            if key == "ddp":
                continue
            for k, (a, b) in enumerate(zip(losses, ref_losses)):
                assert abs(a - b) <= REL * abs(b), f"rank {rank} {key}: step {k} loss {a} vs compiled DDP's {b}"
            for a, b in zip(params, ref_params):
                assert (a - b).abs().max() <= REL * b.abs().max() + 1e-7, f"rank {rank} {key}: parameters"
