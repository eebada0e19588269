"""An FSDP2 training script as people write them: character-level GPT on tinyshakespeare,
each block and then the root wrapped with torch.distributed.fsdp.fully_shard under a
MixedPrecisionPolicy (bf16 compute, fp32 gradient reduction), gradient accumulation with
set_requires_gradient_sync, torch's clip_grad_norm_, evaluation, and a sharded
checkpoint through torch.distributed.checkpoint (DCP) plus a full state dict at the end.

This file is the "before" of docs/porting.md, "From FSDP2"; tests/test_porting.py applies
the guide's diff to it and checks that the zero_ext version trains as this one does.
It runs on CPU processes over gloo (as the test does) and on GPUs over NCCL.

    torchrun --standalone --nproc_per_node=2 examples/port_from_fsdp2.py --out /tmp/fsdp2.json
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"


def batch(data, step, micro, rank, world, device, rows=4, block=32):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    ix = torch.randint(len(data) - block - 1, (rows,), generator=g)
    x = torch.stack([data[i:i + block] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block] for i in ix])
    return x.to(device), y.to(device)


@torch.no_grad()
def evaluate(model, data, rank, world, device):
    losses = [model(*batch(data, 10_000 + k, 0, rank, world, device))[1].float() for k in range(4)]
    return torch.stack(losses).mean().item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    torch.set_num_threads(1)
    text = DATA.read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text[:200_000]], dtype=torch.long)

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=len(chars), block_size=32, n_layer=2, n_head=2, n_embd=64)).to(device)
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    losses = []
    for step in range(args.steps):
        for micro in range(args.accum):
            model.set_requires_gradient_sync(micro == args.accum - 1)
            _, loss = model(*batch(data, step, micro, rank, world, device))
            (loss / args.accum).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} grad norm {float(norm):.4f}")

    val = evaluate(model, data, rank, world, device)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(args.out.with_suffix(".ckpt")))
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(state, args.out.with_suffix(".pt"))
        args.out.write_text(json.dumps({"losses": losses, "val": val,
                                        "params": {k: v.float().sum().item() for k, v in state.items()}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
