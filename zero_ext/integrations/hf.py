"""zero_ext in the Hugging Face Trainer: ZeroTrainer, a Trainer subclass (docs/integrations.md).

    args = TrainingArguments(output_dir, max_grad_norm=1.0, gradient_accumulation_steps=4, save_steps=500, ...)
    trainer = ZeroTrainer(model=model, args=args, train_dataset=ds, zero_stage=3)   # + any zeroify option
    trainer.train()                                  # or train(resume_from_checkpoint=True / path)

Note [ZeroTrainer]
  Where the Trainer would let Accelerate wrap the model in DDP, ZeroTrainer zeroifies it
  with the optimizer the Trainer built; Accelerate wraps only that optimizer. Then:
  - max_grad_norm: accelerator.clip_grad_norm_ calls torch's, routed to the sharded clipping
    (Note [torch's clipping utilities] in zero_ext/torch_utils.py); grad_norm is logged
    before clipping, as under DDP.
  - gradient_accumulation_steps: micro-steps run under the zeroified model's no_sync().
  - Checkpoints: checkpoint-N/ holds the model by zero_ext.save_pretrained and, instead of
    optimizer.pt and scheduler.pt, zero_ext/ by zero_ext.save(), which resumes at any world
    size or stage.
  - Precision: zero_ext's param_dtype, or bf16=True / fp16=True (autocast; fp16's GradScaler
    unscales the sharded gradients: Note [GradScaler on sharded gradients] in
    zero_ext/amp.py), not with zero_ext's own loss scaling or step_in_backward.
"""
from __future__ import annotations

import os

import torch
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME

import zero_ext
from zero_ext.amp import check_scaler
from zero_ext.config import make_config
from zero_ext.integrations.accelerate import autocast_forward

ZERO_DIR = "zero_ext"    # checkpoint-N/zero_ext: the zero_ext.save directory


class ZeroTrainer(Trainer):
    """transformers.Trainer with zero_ext stage `zero_stage`; zero_config / zero_options go to
    zeroify(), whose results are `zero_model` and `zero_optimizer` after train()."""

    def __init__(self, *args, zero_stage: int | str = 2, zero_config=None, zero_options: dict | None = None,
                 **kwargs):
        cfg = make_config(zero_config, zero_stage, dict(zero_options or {}))   # a typo'd option fails here
        super().__init__(*args, **kwargs)
        if self.args.fp16:   # Note [GradScaler on sharded gradients]
            check_scaler(cfg, "TrainingArguments(fp16=True)", ValueError)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("zero_ext: ZeroTrainer replaces DeepSpeed/FSDP; drop deepspeed=/fsdp= from "
                             "TrainingArguments")
        self.zero_stage = zero_stage
        self.zero_config = zero_config
        self.zero_options = dict(zero_options or {})
        self.zero_model = self.zero_optimizer = None

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self.zero_model is not None:
            return self.zero_model          # training or evaluation: stage 3 gathers as it runs
        if not training:
            return super()._wrap_model(model, training, dataloader)
        if self.optimizer is None:
            raise RuntimeError("zero_ext: ZeroTrainer found no optimizer to wrap (create_optimizer runs first); "
                               "pass optimizers=(optimizer, scheduler) to ZeroTrainer, or leave them out to have "
                               "the Trainer create them")
        if isinstance(self.optimizer, (zero_ext.ZeroOptimizer, list)):
            raise RuntimeError("zero_ext: the Trainer's optimizer is already a zero_ext optimizer; pass the plain "
                               "torch optimizer (or none) to ZeroTrainer")
        autocast_forward(self.accelerator, self.model)   # bf16=True / fp16=True: as accelerator.prepare(model)
        self.zero_model, self.zero_optimizer = zero_ext.zeroify(self.model, self.optimizer, stage=self.zero_stage,
                                                                config=self.zero_config, **self.zero_options)
        self.optimizer = self.zero_optimizer   # Accelerate wraps this one; the model is not given to Accelerate
        return self.zero_model

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer.save_model, on every rank: zero_ext.save_pretrained, then (main process) the
        processing class and the training arguments."""
        if self.zero_model is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        zero_ext.save_pretrained(self.zero_model, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.zero_model is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        zero_ext.save(os.path.join(output_dir, ZERO_DIR), self.zero_model, self.zero_optimizer,
                      scheduler=self.lr_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or self.zero_model is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, ZERO_DIR)
        if not os.path.isdir(path) and not os.path.isdir(path + ".old"):
            raise ValueError(f"zero_ext: {checkpoint!r} has no {ZERO_DIR}/ directory, so it was not saved by "
                             f"ZeroTrainer and holds no sharded optimizer state to resume from; to start from its "
                             f"weights only, load the model with from_pretrained({checkpoint!r}) and train "
                             f"without resume_from_checkpoint")
        zero_ext.load(path, self.zero_model, self.zero_optimizer, scheduler=self.lr_scheduler)


__all__ = ["ZeroTrainer", "ZERO_DIR"]
