"""A DeepSpeed ZeRO training script in the shape of DeepSpeed's own examples:
character-level GPT on tinyshakespeare, the engine from deepspeed.initialize with the
ZeRO config examples/ds_config.json (stage 2, gradient accumulation and clipping in the
config), engine.backward / engine.step, evaluation and a checkpoint at the end.

This file is the "before" of docs/porting.md, "From DeepSpeed". DeepSpeed is not
installed by `make test`, so this script itself does not run there: tests/test_porting.py
applies the guide's diff to it and checks that the zero_ext version trains exactly as
examples/port_from_ddp.py (the same model, data and optimizer under DDP) does.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 examples/port_from_deepspeed.py --out /tmp/ds.json
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import deepspeed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"
CONFIG = Path(__file__).resolve().parent / "ds_config.json"


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
    config = json.loads(CONFIG.read_text())
    model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    accum = model.gradient_accumulation_steps()

    losses = []
    for step in range(args.steps):
        for micro in range(accum):
            _, loss = model(*batch(data, step, micro, rank, world))
            model.backward(loss)           # divides by the accumulation steps; reduces at the boundary
            model.step()                   # clips (gradient_clipping) and steps at the boundary only
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}")

    val = evaluate(model, data, rank, world)
    model.save_checkpoint(str(args.out.with_suffix(".ckpt")))
    state = model.module.state_dict()
    if rank == 0:
        torch.save(state, args.out.with_suffix(".pt"))
        args.out.write_text(json.dumps({"losses": losses, "val": val,
                                        "params": {k: v.sum().item() for k, v in state.items()}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
