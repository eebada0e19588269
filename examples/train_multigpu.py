"""zero_ext on every GPU of one machine or several: one process per GPU, NCCL, bf16 compute.

    torchrun --standalone --nproc_per_node=8 examples/train_multigpu.py --checkpoint ckpt/multigpu

Run from the repository root. ZX_BACKEND=gloo runs it on CPU processes, ZX_BACKEND=cuda:gloo
runs several ranks on one GPU (tests/test_readme_launch.py does both).
"""
import argparse
import os

import torch
import torch.distributed as dist

import zero_ext
from gpt import GPT, CharDataset, GPTConfig                  # examples/gpt.py

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--checkpoint", default=None, help="save here every 50 steps; resume from it if it exists")
args = parser.parse_args()

backend = os.environ.get("ZX_BACKEND", "nccl")
dist.init_process_group(backend)                             # rank, world size, master: from torchrun
rank, world = dist.get_rank(), dist.get_world_size()
if backend == "gloo":
    device = torch.device("cpu")
else:
    local_rank = int(os.environ["LOCAL_RANK"])               # this process's index on its node
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())

data = CharDataset("examples/data/tinyshakespeare.txt")
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=64, n_layer=4, n_head=4, n_embd=128)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
dtype = "bf16" if device.type == "cuda" else "fp32"          # bf16 matmuls are slow on most CPUs
model, opt = zero_ext.zeroify(model, opt, stage=2, param_dtype=dtype)

start = 0
if args.checkpoint and os.path.exists(args.checkpoint):
    start = zero_ext.load(args.checkpoint, model, opt)["step"]   # saved at any world size and stage
    if rank == 0:
        print(f"resumed from {args.checkpoint} at step {start}, world size {world}")
gen = torch.Generator().manual_seed(1000 * rank + start)      # each rank draws its own batches
for step in range(start, args.steps):
    x, y = (t.to(device) for t in data.get_batch("train", 16, 64, gen))
    _, loss = model(x, y)
    loss.backward()
    opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    if args.checkpoint and (step + 1) % 50 == 0:
        zero_ext.save(args.checkpoint, model, opt, extra={"step": step + 1})
    if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
        print(f"step {step} loss {loss.item():.3f} world size {world} {device.type}")
dist.destroy_process_group()
