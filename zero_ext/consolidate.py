"""Offline conversion of a zero_ext checkpoint to one plain torch.save file, in one
process without a process group: `python -m zero_ext.consolidate CKPT OUT`.
OUT holds {"model": the module's state_dict, "optimizer": a state dict that a plain
torch optimizer of the wrapped class loads (built over model.parameters() with the
same param groups), "extra", "scheduler", "loss_scaler"}:

    full = torch.load(OUT)
    model.load_state_dict(full["model"])
    torch.optim.AdamW(model.parameters()).load_state_dict(full["optimizer"])

The checkpoint is verified first (manifest, file sizes, CRC32); OUT is written under a
temporary name and renamed into place.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from .checkpoint import CheckpointError, consolidate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero_ext.consolidate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="checkpoint directory written by zero_ext.save")
    parser.add_argument("out", help="the torch.save file to write")
    args = parser.parse_args(argv)
    try:
        full = consolidate(args.checkpoint)
    except CheckpointError as e:
        print(e, file=sys.stderr)
        return 1
    tmp = args.out + ".tmp"
    torch.save(full, tmp)
    os.replace(tmp, args.out)
    n = sum(t.numel() for t in full["model"].values())
    print(f"wrote {args.out}: {len(full['model'])} model tensors ({n:,} elements), "
          f"optimizer state for {len(full['optimizer']['state'])} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
