"""The smallest use of zero_ext: fit y = X w + noise with a linear model; zeroify is one line.

    python examples/linear_regression.py
    torchrun --standalone --nproc_per_node=2 examples/linear_regression.py
"""
import os

import torch
import torch.distributed as dist
import zero_ext

if "WORLD_SIZE" in os.environ:                       # under torchrun: one gloo process group
    dist.init_process_group("gloo")
rank = dist.get_rank() if dist.is_initialized() else 0

torch.manual_seed(0)                                 # the same true weights and initial model on every rank
true_w = torch.randn(16, 1)
model = torch.nn.Linear(16, 1, bias=False)
opt = torch.optim.Adam(model.parameters(), lr=0.05)
model, opt = zero_ext.zeroify(model, opt, stage=2)   # <- the one zero_ext line

generator = torch.Generator().manual_seed(1 + rank)  # every rank draws its own data
for step in range(200):
    x = torch.randn(64, 16, generator=generator)
    y = x @ true_w + 0.01 * torch.randn(64, 1, generator=generator)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step == 0:
        initial_loss = loss.item()
    if rank == 0 and step % 50 == 0:
        print(f"step {step:3d} | loss {loss.item():.6f}", flush=True)

weight_error = (model.module.weight.detach().t() - true_w).abs().max().item()
if rank == 0:
    print(f"summary: initial loss {initial_loss:.6f} | final loss {loss.item():.6f} | "
          f"max weight error {weight_error:.6f} | model-state bytes per rank {opt.stats()['model_state_bytes']['total']}")
if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
