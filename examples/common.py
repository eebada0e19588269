"""Pieces shared by the classifier examples (train_cnn.py, train_encoder.py) and
train_gpt.py: distributed setup, wrapping for DDP or zero_ext, model-state bytes,
and the end-of-run summary. Kept small so each example still reads top to bottom."""

import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

try:
    from tqdm import tqdm          # optional: progress bar on rank 0
except ImportError:
    tqdm = None


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


def add_precision_argument(parser):
    """--dtype fp32/bf16/fp16: zero_ext's param_dtype; DDP runs bf16 under torch.autocast."""
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="compute precision: zero_ext param_dtype (fp32 master weights in the shard, fp32 "
                             "gradient reduction; fp16 adds dynamic loss scaling); --ddp: torch.autocast (bf16)")


def check_precision(parser, args):
    if args.dtype == "fp16" and args.ddp:
        parser.error("--dtype fp16 is for zero_ext (it scales the loss itself); use --dtype bf16 with --ddp")


def wrap_for_data_parallel(model, opt, args):
    """torch DDP (--ddp) or zero_ext.zeroify. Returns (model, opt)."""
    if args.ddp:
        assert dist.is_initialized(), "--ddp needs a process group: run under torchrun (--nproc_per_node=1 is fine)"
        return DistributedDataParallel(model), opt
    import zero_ext
    return zero_ext.zeroify(model, opt, stage=args.stage, param_dtype=args.dtype)   # the one zero_ext line


def autocast(args):
    """The forward's precision context: DDP + bf16 runs under torch.autocast; zero_ext
    needs none (its parameters already are bf16/fp16 and it casts float inputs)."""
    if args.ddp and args.dtype == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def backward(loss, opt):
    """loss.backward(), through zero_ext's loss scale when it has one (fp16)."""
    (opt.scale_loss(loss) if hasattr(opt, "scale_loss") else loss).backward()


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


@torch.no_grad()
def evaluate(model, get_batch, args):
    """(loss, accuracy) on args.eval_size held-out examples, the same on every rank and run."""
    model.eval()                                               # e.g. BatchNorm uses its running statistics
    generator = torch.Generator().manual_seed(args.seed + 999_999)
    x, y = get_batch(args.eval_size, generator)
    with autocast(args):
        logits = model(x).float()
    model.train()
    return F.cross_entropy(logits, y).item(), (logits.argmax(dim=1) == y).float().mean().item()


def train_classifier(model, opt, get_batch, args, unit):
    """The classifier examples' run: wrap (DDP or zeroify), train args.steps steps of
    cross-entropy on get_batch(n, generator) -> (x, y) with progress on rank 0,
    evaluate, summarize. `unit` names one example in the log ("images"). Returns the
    summary dict on every rank."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    is_master = rank == 0

    def log(message):
        if is_master:
            print(message, flush=True)

    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model, opt = wrap_for_data_parallel(model, opt, args)
    system = "ddp" if args.ddp else f"stage {args.stage}"
    log(f"{system} | world size {world_size} | {torch.get_num_threads()} thread(s) per rank | "
        f"{num_params:,} parameters | {args.batch_size * world_size} {unit} per step | torch {torch.__version__}")

    generator = torch.Generator().manual_seed(args.seed + 1000 * rank)   # this rank's own batches
    steps = range(args.steps)
    if is_master and tqdm is not None:
        steps = tqdm(steps, desc=system, mininterval=1.0)
    losses, accuracies, step_times = [], [], []
    for step in steps:
        x, y = get_batch(args.batch_size, generator)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast(args):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        backward(loss, opt)                                    # gradients are reduced during backward
        if args.grad_clip > 0:
            if args.ddp:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            else:
                opt.clip_grad_norm_(args.grad_clip)            # the global norm over all shards
        opt.step()
        step_times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        accuracies.append((logits.argmax(dim=1) == y).float().mean().item())
        if is_master and tqdm is not None:
            steps.set_postfix(loss=f"{losses[-1]:.4f}", acc=f"{accuracies[-1]:.2f}", refresh=False)
        elif step % args.log_every == 0 or step == args.steps - 1:
            log(f"step {step:5d} | loss {losses[-1]:.4f} | acc {accuracies[-1]:.2f} | "
                f"{1000 * step_times[-1]:7.1f} ms")

    eval_loss, eval_acc = evaluate(model, get_batch, args)
    return summarize(args, system, world_size, num_params, model, opt, losses, accuracies, step_times,
                     eval_loss, eval_acc, log, is_master)


def leave_together():
    """Ranks leave together (after rank 0's JSON), then the process group goes. The
    barrier holds no Python tensors, so no gloo worker thread is still releasing one
    while the interpreter shuts down (that aborts the process if the process group is
    still alive then, as it is while zero_ext's engine holds it)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
