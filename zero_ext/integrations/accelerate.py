"""zero_ext with Hugging Face Accelerate: prepare() in place of accelerator.prepare().

    model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler, stage=2)
    save_model(accelerator, model, "final")   # every rank: zero_ext.save_pretrained

Note [Accelerate around a zeroified model]
  prepare() moves the model to accelerator.device and zeroifies it; Accelerate never sees
  the model (no DDP) and wraps only the optimizer, in an AcceleratedOptimizer, so
  accumulate() skips step and zero_grad on micro-steps. Loaders and schedulers go to
  accelerator.prepare().
  - backward(loss) divides by the accumulation steps; accumulate(model) runs micro-steps
    under the zeroified model's no_sync().
  - clip_grad_norm_ / clip_grad_value_ call torch's, routed to the sharded clipping
    (Note [torch's clipping utilities] in zero_ext/torch_utils.py).
  - save_state / load_state: hooks save the pair with zero_ext.save / load into
    dir/zero_ext, instead of model.safetensors and optimizer.bin.
  - The full model: save_model(), not accelerator.save_model(), which drops tensors
    sharing a storage (stages 0-2's parameters are views of flat buckets).
  - mixed_precision="bf16"/"fp16" run forward under autocast; fp16's GradScaler unscales
    the sharded gradients (Note [GradScaler on sharded gradients] in zero_ext/amp.py) and is
    refused with zero_ext's own loss scaling or step_in_backward.
"""
from __future__ import annotations

import os
from types import MethodType

from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

import zero_ext
from zero_ext.amp import check_scaler
from zero_ext.config import make_config

ZERO_DIR = "zero_ext"    # <save_state dir>/zero_ext (zero_ext_1, ... for further prepared models)


def prepare(accelerator, model: nn.Module, optimizer, *others, stage: int | str = 2, config=None, **zero_options):
    """(the zeroified model, its optimizer in an AcceleratedOptimizer, *accelerator.prepare(*others))."""
    if accelerator.scaler is not None:   # Note [GradScaler on sharded gradients] (zero_ext/amp.py)
        check_scaler(make_config(config, stage, dict(zero_options)), "Accelerator(mixed_precision='fp16')", ValueError)
    if not isinstance(model, nn.Module) or isinstance(model, zero_ext.ZeroModel):
        raise TypeError(f"zero_ext: prepare(accelerator, model, optimizer, ...) takes the plain module first and "
                        f"the plain torch optimizer second, got a {type(model).__name__} as the model; pass the "
                        f"nn.Module itself (not one that prepare() or zeroify() returned)")
    model = model.to(accelerator.device)
    autocast_forward(accelerator, model)
    zmodel, zopt = zero_ext.zeroify(model, optimizer, stage=stage, config=config, **zero_options)
    wrapped = AcceleratedOptimizer(zopt, device_placement=False, scaler=accelerator.scaler)
    _register_checkpoint_hooks(accelerator, zmodel, zopt)
    _unscale_in_clipping(accelerator)
    rest = accelerator.prepare(*others) if others else ()
    if len(others) == 1:
        rest = (rest,)
    return (zmodel, wrapped, *rest)


def save_model(accelerator, model, save_directory, max_shard_size: int | str = "10GB") -> None:
    """accelerator.save_model for a zeroified `model`, on every rank: zero_ext.save_pretrained."""
    zero_ext.save_pretrained(model, save_directory, max_shard_size=max_shard_size)
    accelerator.wait_for_everyone()


def autocast_forward(accelerator, model: nn.Module) -> None:
    """As accelerator.prepare() under mixed_precision "bf16"/"fp16": forward runs under autocast
    and returns fp32 outputs (Accelerate never sees the zeroified model; ZeroTrainer's neither)."""
    if not accelerator.native_amp:
        return
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    autocast = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
    model._original_forward = model.forward
    if hasattr(model.forward, "__func__"):
        model.forward = MethodType(convert_outputs_to_fp32(autocast(model.forward.__func__)), model)
    else:
        model.forward = convert_outputs_to_fp32(autocast(model.forward))


def _unscale_in_clipping(accelerator) -> None:
    """accelerator.unscale_gradients() (run by clip_grad_norm_) unscales only the optimizers
    Accelerate registered: make it unscale prepare()'s too, as under DDP
    (Note [GradScaler on sharded gradients] in zero_ext/amp.py)."""
    if accelerator.scaler is None or getattr(accelerator, "_zero_ext_unscales", False):
        return
    original = accelerator.unscale_gradients

    def unscale_gradients(optimizer=None):
        original(optimizer)
        if optimizer is None:
            for _, zopt in accelerator._zero_ext_pairs:
                accelerator.scaler.unscale_(zopt)

    accelerator.unscale_gradients = unscale_gradients
    accelerator._zero_ext_unscales = True


def _register_checkpoint_hooks(accelerator, zmodel, zopt) -> None:
    """accelerator.save_state / load_state: the zeroified pair through zero_ext.save / load."""
    index = len(getattr(accelerator, "_zero_ext_pairs", []))
    accelerator._zero_ext_pairs = getattr(accelerator, "_zero_ext_pairs", []) + [(zmodel, zopt)]
    name = ZERO_DIR if index == 0 else f"{ZERO_DIR}_{index}"

    def save_hook(models, weights, output_dir):
        zero_ext.save(os.path.join(output_dir, name), zmodel, zopt)

    def load_hook(models, input_dir):
        zero_ext.load(os.path.join(input_dir, name), zmodel, zopt)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


__all__ = ["prepare", "save_model", "ZERO_DIR"]
