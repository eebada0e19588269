"""A DDP training script as people write them (nanoGPT's shape): character-level GPT on
tinyshakespeare, gradient accumulation with require_backward_grad_sync, torch's
clip_grad_norm_, and at the end evaluation and a checkpoint on rank 0 alone.

This file is the "before" of docs/porting.md; tests/test_porting.py applies the guide's
diff to it and checks that the zero_ext version trains as this DDP one does.

    torchrun --standalone --nproc_per_node=2 examples/port_from_ddp.py --out /tmp/ddp.json
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"


def batch(data, step, micro, rank, world, rows=4, block=32):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    ix = torch.randint(len(data) - block - 1, (rows,), generator=g)
    x = torch.stack([data[i:i + block] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block] for i in ix])
    return x, y


@torch.no_grad()
def evaluate(model, data, rank, world):
    losses = [model(*batch(data, 10_000 + k, 0, rank, world))[1] for k in range(4)]
    return torch.stack(losses).mean().item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    text = DATA.read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text[:200_000]], dtype=torch.long)

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=len(chars), block_size=32, n_layer=2, n_head=2, n_embd=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    model = DDP(model)

    losses = []
    for step in range(args.steps):
        for micro in range(args.accum):
            model.require_backward_grad_sync = micro == args.accum - 1
            _, loss = model(*batch(data, step, micro, rank, world))
            (loss / args.accum).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} grad norm {float(norm):.4f}")

    if rank == 0:   # the master process alone evaluates and writes the checkpoint
        val = evaluate(model, data, rank, world)
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(state, args.out.with_suffix(".pt"))
        moments = {f"{i}.{k}": v.norm().item() for i, st in state["optimizer"]["state"].items()
                   for k, v in st.items() if v.dim() > 0}
        args.out.write_text(json.dumps({"losses": losses, "val": val, "moments": moments,
                                        "params": {k: v.sum().item() for k, v in state["model"].items()}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
