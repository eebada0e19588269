"""The other ZeRO implementations train_gpt.py runs as peers of zero_ext, with the same model,
data and torch.optim.AdamW (same hyperparameters and weight-decay groups):

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --zero-redundancy
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --deepspeed 2    # needs `pip install deepspeed`

--zero-redundancy: torch.distributed.optim.ZeroRedundancyOptimizer wrapping AdamW, with DDP
for the gradients (its documented use): DDP all-reduces the full gradients (2Ψ), each rank
steps the parameters it owns (whole parameters, assigned greedily by size) and then
broadcasts them to the others (Ψ in all).

--deepspeed S: DeepSpeed's ZeRO stage S (1 or 2) engine on CPU (DS_ACCELERATOR=cpu, gloo),
fp32, the AdamW above as its client optimizer, gradient clipping from its config. The
engine owns backward (its reduction hooks) and the step, so it has its own train step here.
"""

import inspect
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def state_tensors(optimizer_state):
    """The non-scalar tensors of a torch optimizer's state dict-of-dicts (Adam's moments, not its step)."""
    return [t for s in optimizer_state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]


# --- torch ZeroRedundancyOptimizer -------------------------------------------------------------

def zero_redundancy(model, opt):
    """DDP(model) and a ZeroRedundancyOptimizer over opt's param groups, class and hyperparameters."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    assert dist.is_initialized(), "--zero-redundancy needs a process group: run under torchrun"
    # The same groups and hyperparameters, as constructor arguments (AdamW's defaults also hold
    # internal keys its constructor does not take, e.g. decoupled_weight_decay).
    accepted = set(inspect.signature(type(opt)).parameters) - {"params"}
    groups = [{k: v for k, v in group.items() if k in accepted or k == "params"} for group in opt.param_groups]
    defaults = {k: v for k, v in opt.defaults.items() if k in accepted}
    return DistributedDataParallel(model), ZeroRedundancyOptimizer(groups, optimizer_class=type(opt), **defaults)


def zero_redundancy_state_bytes(model, zero_opt):
    """Model state a ZeroRedundancyOptimizer rank holds: full parameters and gradients (DDP), and the
    AdamW moments of the parameters it owns only (its local optimizer, zero_opt.optim)."""
    params = list(model.parameters())
    state = {
        "parameters": tensor_bytes(params),
        "gradients": tensor_bytes(p.grad for p in params if p.grad is not None),
        "master_weights": 0,
        "optimizer_states": tensor_bytes(state_tensors(zero_opt.optim.state)),
    }
    state["total"] = sum(state.values())
    return state


# --- DeepSpeed ---------------------------------------------------------------------------------

def deepspeed_engine(model, opt, args):
    """DeepSpeed's ZeRO stage args.deepspeed engine over model, with opt as its client optimizer.
    Returns (engine, its ZeRO optimizer)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")             # no GPU here: DeepSpeed's CPU accelerator
    import deepspeed

    assert dist.is_initialized(), "--deepspeed needs a process group: run under torchrun"
    config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": args.grad_clip,                   # 0 disables it, as --grad-clip 0
        "zero_optimization": {"stage": args.deepspeed},
        "zero_allow_untested_optimizer": True,                 # a torch AdamW, not DeepSpeed's own
        "steps_per_print": 10 ** 9,
    }
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine, ds_opt


def deepspeed_train_step(engine, ds_opt, stream, args, lr, grad_bytes=None):
    """train_gpt.train_step for a DeepSpeed engine: the engine divides the loss by its
    gradient_accumulation_steps, reduces gradients in its hooks, and at the accumulation
    boundary clips (its config) and steps. grad_bytes (a list) gets the gradient bytes the
    rank holds just before the step: DeepSpeed frees them after it."""
    for group in ds_opt.param_groups:                          # the client AdamW's groups
        group["lr"] = lr
    loss_sum = 0.0
    for micro in range(args.accum):
        x, y = stream.batch(micro)
        _, loss = engine(x, y)
        engine.backward(loss)
        if grad_bytes is not None and engine.is_gradient_accumulation_boundary():
            grad_bytes.append(deepspeed_grad_bytes(engine, ds_opt))
        engine.step()
        loss_sum += loss.item()
    return loss_sum / args.accum


def deepspeed_grad_bytes(engine, ds_opt):
    """Gradient bytes held after backward: the module's .grad tensors plus ZeRO's reduced partitions."""
    partitions = []
    for value in getattr(ds_opt, "averaged_gradients", {}).values():
        partitions += value if isinstance(value, (list, tuple)) else [value]
    return (tensor_bytes(p.grad for p in engine.module.parameters() if p.grad is not None)
            + tensor_bytes(partitions))


def deepspeed_state_bytes(engine, ds_opt, grad_bytes):
    """Model state a DeepSpeed ZeRO-1/2 rank holds: the module's full fp32 parameters, its fp32
    master partition (a copy even in fp32 training), the AdamW moments of that partition, and the
    gradients measured just before the last step (grad_bytes)."""
    state = {
        "parameters": tensor_bytes(engine.module.parameters()),
        "gradients": grad_bytes,
        "master_weights": tensor_bytes(getattr(ds_opt, "single_partition_of_fp32_groups", [])),
        "optimizer_states": tensor_bytes(state_tensors(ds_opt.optimizer.state)),
    }
    state["total"] = sum(state.values())
    return state
