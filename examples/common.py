"""Pieces shared by the classifier examples (train_cnn.py, train_encoder.py) and
train_gpt.py: distributed setup, wrapping for DDP or zero_ext, model-state bytes,
and the end-of-run summary. Kept small so each example still reads top to bottom."""

import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def setup_distributed(threads):
    """Join the torchrun process group (gloo) if there is one. Returns (rank, world_size, threads)."""
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend="gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        assert rank == int(os.environ["RANK"]), "rank from the process group differs from $RANK"
        assert world_size == int(os.environ["WORLD_SIZE"])
    else:
        rank, world_size = 0, 1
    if threads is None:
        threads = 1 if world_size > 1 else torch.get_num_threads()
    torch.set_num_threads(threads)
    return rank, world_size, threads


def wrap_for_data_parallel(model, opt, args):
    """torch DDP (--ddp) or zero_ext.zeroify. Returns (model, opt)."""
    if args.ddp:
        assert dist.is_initialized(), "--ddp needs a process group: run under torchrun (--nproc_per_node=1 is fine)"
        return DistributedDataParallel(model), opt
    import zero_ext
    return zero_ext.zeroify(model, opt, stage=args.stage)      # the one zero_ext line


def model_state_bytes(model, opt, args):
    """Model state this rank holds: zero_ext reports its own; for DDP sum parameters, gradients and optimizer state."""
    if not args.ddp:
        return dict(opt.stats()["model_state_bytes"])
    params = list(model.parameters())
    state = {
        "parameters": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        "master_weights": 0,
        "optimizer_states": sum(t.numel() * t.element_size() for s in opt.state.values()
                                for t in s.values() if torch.is_tensor(t) and t.dim() > 0),
    }
    state["total"] = sum(state.values())
    return state


def summarize(args, system, world_size, num_params, model, opt, losses, accuracies, step_times,
              eval_loss, eval_acc, log, is_master):
    """A classifier run's summary: logged as one "summary:" line, written to --json
    by rank 0, and returned."""
    state = model_state_bytes(model, opt, args)
    state_per_rank = [state["total"]] * world_size
    if dist.is_initialized():
        dist.all_gather_object(state_per_rank, state["total"])
    window = max(1, args.steps // 5)                           # smooth the noisy per-batch losses
    summary = {
        "system": system,
        "stage": None if args.ddp else args.stage,
        "world_size": world_size,
        "num_params": num_params,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "losses": losses,                                      # rank 0's training loss per step
        "initial_loss": statistics.mean(losses[:window]),      # mean of the first steps
        "final_loss": statistics.mean(losses[-window:]),       # mean of the last steps
        "final_train_accuracy": statistics.mean(accuracies[-window:]),
        "eval_loss": eval_loss,
        "eval_accuracy": eval_acc,
        "step_time_ms": 1000 * statistics.median(step_times),
        "model_state_bytes": state,                            # rank 0
        "model_state_bytes_per_rank": state_per_rank,
        "zero_ext_stats": None if args.ddp else opt.stats(),
    }
    log(f"summary: {system} | final loss {summary['final_loss']:.4f} (initial {summary['initial_loss']:.4f}) | "
        f"eval loss {eval_loss:.4f} | eval accuracy {eval_acc:.3f} | "
        f"step {summary['step_time_ms']:.1f} ms | model-state bytes per rank {state_per_rank}")
    if is_master and args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1))
    return summary
