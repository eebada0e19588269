"""zero_ext with Hugging Face Accelerate: prepare() in place of accelerator.prepare()
(the guide: docs/integrations.md).

    accelerator = Accelerator(gradient_accumulation_steps=4)    # torchrun / accelerate launch
    model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler, stage=2)
    ...                                       # the usual accumulate / backward / clip / step loop
    accelerator.save_state("ckpt")            # every rank; accelerator.load_state("ckpt") to resume
    save_model(accelerator, model, "final")   # every rank: zero_ext.save_pretrained

Note [Accelerate around a zeroified model]
  prepare() moves the model to accelerator.device and zeroifies it with the optimizer.
  Accelerate never sees the model, so it cannot wrap it in DDP. The optimizer comes back
  in Accelerate's AcceleratedOptimizer, so accumulate() skips the step and zero_grad on
  micro-steps. Everything else (loaders, schedulers) goes to accelerator.prepare().
  - backward(loss) divides by the accumulation steps; accumulate(model) runs the
    micro-steps under the zeroified model's no_sync().
  - clip_grad_norm_ and clip_grad_value_ call torch's, which `import zero_ext` routes to
    the sharded clipping (Note [torch's clipping utilities] in zero_ext/torch_utils.py).
  - save_state / load_state (every rank): hooks prepare() registers save the model and
    optimizer with zero_ext.save / zero_ext.load into dir/zero_ext. Accelerate saves the
    rest as usual, but no model.safetensors or optimizer.bin for the zeroified pair.
  - The full model: save_model() below, zero_ext.save_pretrained streamed from the
    shards. Not accelerator.save_model(): in stages 0-2 every parameter is a view of a
    flat bucket, and it drops tensors sharing a storage.
  - Precision: mixed_precision="bf16"/"fp16" run forward under autocast. With "fp16",
    Accelerate's GradScaler unscales the sharded gradients (Note [GradScaler on sharded
    gradients] in zero_ext/amp.py); it is refused with zero_ext's own loss scaling
    (param_dtype="fp16") or step_in_backward.
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
    """(model, optimizer, *others) ready for training: the zeroified model, its optimizer
    wrapped in an AcceleratedOptimizer, and accelerator.prepare(*others) in order."""
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
    """As accelerator.save_model for the zeroified `model` (every rank calls it):
    zero_ext.save_pretrained, which streams the weights out of the shards (rank 0 writes
    save_directory/model.safetensors, or shards with an index past max_shard_size, and a
    Hugging Face model's config)."""
    zero_ext.save_pretrained(model, save_directory, max_shard_size=max_shard_size)
    accelerator.wait_for_everyone()


def autocast_forward(accelerator, model: nn.Module) -> None:
    """What accelerator.prepare() does to a model under mixed_precision "bf16"/"fp16" before
    wrapping it in DDP: its forward runs under autocast and returns fp32 outputs (the model
    zeroify() wraps is not given to Accelerate, so nothing else would; ZeroTrainer too)."""
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
    """accelerator.clip_grad_norm_ first unscales (GradScaler.unscale_) the optimizers that
    accelerator.prepare() registered; a zeroified one is not registered (its checkpoint is
    zero_ext.save's, not optimizer.bin), so unscale_gradients() also unscales those prepare()
    made, as it would under DDP (Note [GradScaler on sharded gradients] in zero_ext/amp.py)."""
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
