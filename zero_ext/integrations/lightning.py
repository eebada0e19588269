"""zero_ext as a PyTorch Lightning strategy (lightning >= 2.0, the `lightning` package).

    import zero_ext.integrations.lightning          # registers "zero_ext_stage0" ... "zero_ext_stage3"
    trainer = L.Trainer(..., strategy=ZeroStrategy(stage=3, param_dtype="bf16"))   # any zeroify option

A DDPStrategy whose fit() hands the LightningModule and its optimizers to zeroify()
(docs/integrations.md). Clipping goes through torch's clip_grad_*_
(Note [torch's clipping utilities] in zero_ext/torch_utils.py); accumulation runs under
no_sync(); "16-mixed" unscales the sharded gradients (Note [GradScaler on sharded gradients]).

Note [Lightning checkpoints]
  trainer.save_checkpoint(path) writes `path` as a zero_ext checkpoint directory: every rank
  calls zero_ext.save, writing its shard, and Lightning's own dict (all but "state_dict" and
  "optimizer_states") rides in `extra` as torch.save()d bytes. So a save is all-or-nothing
  and resumes at another world size or stage.
  - fit(ckpt_path=path) loads it after setup (restore_checkpoint_after_setup): zero_ext.load
    restores weights, optimizer state and steps; Lightning the rest from the dict.
  - validate/test/predict(ckpt_path=path) outside fit read the full weights offline.
  - to_lightning_checkpoint(path, out) writes a plain .ckpt for load_from_checkpoint.
  - Another strategy's plain .ckpt resumes only the weights; its optimizer state is refused.
"""
from __future__ import annotations

import io
import os
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

import zero_ext
from zero_ext.amp import check_scaler
from zero_ext.checkpoint import MANIFEST, consolidate, resolve
from zero_ext.config import make_config

LIGHTNING_KEY = "lightning"   # extra["lightning"]: Lightning's checkpoint dict, torch.save()d to bytes
_HELD_OUT = ("state_dict", "optimizer_states")   # what zero_ext.save itself holds


def is_zero_checkpoint(path) -> bool:
    """Whether `path` is a zero_ext checkpoint directory (or one whose save was interrupted)."""
    return os.path.exists(os.path.join(resolve(path), MANIFEST))


class ZeroStrategy(DDPStrategy):
    """A Lightning strategy training with zero_ext stage `stage`; `config` and `**zero_options`
    go to zeroify(), the launch arguments to DDPStrategy. After fit(), `zero_model` and
    `zero_optimizers` are what zeroify() returned."""

    strategy_name = "zero_ext"

    def __init__(self, stage: int | str = 2, *, config=None, accelerator=None, parallel_devices=None,
                 cluster_environment=None, checkpoint_io=None, precision_plugin=None,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 start_method: str = "popen", **zero_options: Any) -> None:
        make_config(config, stage, dict(zero_options))   # a typo'd option fails here, before any launch
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self.stage = stage
        self.zero_config = config
        self.zero_options = dict(zero_options)
        self.zero_model = None        # the ZeroModel around the LightningModule (set by setup when fitting)
        self.zero_optimizers: list = []

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._check_precision()
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        if self._zeroified():
            self.model = self.zero_model          # e.g. validate() after fit(): the sharded model runs
        else:
            self.model_to_device()
            if fitting:
                self.setup_optimizers(trainer)    # configure_optimizers(): torch optimizers + schedulers
                self._zeroify()
            elif self.world_size > 1 and dist.is_initialized():   # as DDPStrategy outside fit: rank 0's values
                with torch.no_grad():
                    for t in list(self.model.parameters()) + list(self.model.buffers()):
                        dist.broadcast(t, 0)
        self.setup_precision_plugin()

    def _zeroified(self) -> bool:
        return self.zero_model is not None and self.zero_model.module is self.lightning_module

    def _zeroify(self) -> None:
        optimizers = list(self.optimizers)
        if not optimizers:
            raise ValueError(f"zero_ext: ZeroStrategy needs an optimizer to shard, and "
                             f"{type(self.lightning_module).__name__}.configure_optimizers() returned none; return "
                             f"a torch optimizer from it (torch.optim.AdamW(self.parameters()))")
        model, opt = zero_ext.zeroify(self.model, optimizers if len(optimizers) > 1 else optimizers[0],
                                      stage=self.stage, config=self.zero_config, **self.zero_options)
        self.zero_model = model
        self.zero_optimizers = list(opt) if isinstance(opt, list) else [opt]
        self.model = model
        self.optimizers = self.zero_optimizers    # LR schedulers keep working: param_groups are shared

    def _check_precision(self) -> None:
        plugin = self.precision_plugin
        if type(plugin) not in (Precision, MixedPrecision):
            raise ValueError(f"zero_ext: ZeroStrategy trains fp32 parameters and does not support Lightning's "
                             f"{type(plugin).__name__}; use Trainer(precision='32-true', 'bf16-mixed' or "
                             f"'16-mixed') and choose the compute precision with ZeroStrategy(param_dtype='bf16' "
                             f"or 'fp16'), whose loss scaling is zero_ext's own")
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            # Note [GradScaler on sharded gradients] (zero_ext/amp.py)
            check_scaler(make_config(self.zero_config, self.stage, dict(self.zero_options)),
                         f"Lightning's '{plugin.precision}' precision", ValueError)

    def block_backward_sync(self):
        """Accumulation micro-steps (Trainer(accumulate_grad_batches=k)): as DDP's no_sync."""
        if self.model is not None and self.model is self.zero_model:
            return self.zero_model.no_sync()
        return nullcontext()

    def teardown(self) -> None:
        # as DDPStrategy, but keep zero_model and never move it (Note [Moves after zeroify] in zero_ext/changes.py)
        if self._zeroified():
            self.model = self.lightning_module
            if self._layer_sync and self.lightning_module._trainer is not None:
                self.model = self._layer_sync.revert(self.model)
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            self.cluster_environment.teardown()
            return
        super().teardown()

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True              # zero_ext.load needs the zeroified model and optimizer

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False             # zero_ext.load restores the optimizers; Lightning the LR schedulers

    def lightning_module_state_dict(self) -> dict:
        if self._zeroified():
            return {}            # the weights are in zero_ext.save's shards
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer) -> dict:
        return {}                # in zero_ext.save's shards (optimizer.state_dict() is one rank's)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """Every rank: Note [Lightning checkpoints]."""
        if storage_options is not None:
            raise TypeError("zero_ext: ZeroStrategy.save_checkpoint takes no storage_options (zero_ext.save "
                            "writes a local directory)")
        if not self._zeroified():
            raise RuntimeError("zero_ext: ZeroStrategy saves checkpoints of a model it trained (after fit() has "
                               "set it up); outside fit, save the LightningModule's own state_dict")
        filepath = self.broadcast(os.fspath(filepath))
        extra = None
        if self.is_global_zero:
            buf = io.BytesIO()
            torch.save({k: v for k, v in checkpoint.items() if k not in _HELD_OUT}, buf)
            extra = {LIGHTNING_KEY: torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)}
        zero_ext.save(filepath, self.zero_model, self.zero_optimizers, extra=extra)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        path = os.fspath(checkpoint_path)
        if not is_zero_checkpoint(path):
            checkpoint = super().load_checkpoint(path, weights_only=weights_only)
            if self._zeroified() and checkpoint.get("optimizer_states"):
                raise ValueError(
                    f"zero_ext: {path!r} is a plain Lightning checkpoint (another strategy's): ZeroStrategy can load "
                    f"its weights but not its optimizer state. To resume, use a checkpoint that ZeroStrategy saved "
                    f"(a directory); to start from these weights, load them into the LightningModule before fit() "
                    f"(model.load_state_dict(torch.load(path)['state_dict'])) and call fit() without ckpt_path")
            return checkpoint
        if self._zeroified():
            extra = zero_ext.load(path, self.zero_model, self.zero_optimizers)
            return _unpack(extra, path, weights_only)
        full = consolidate(path)                 # not fitting: the full weights, read offline
        checkpoint = _unpack(full["extra"], path, weights_only)
        checkpoint["state_dict"] = full["model"]
        return checkpoint

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if "state_dict" in checkpoint:           # loaded into the fp32 masters when zeroified (changes.py)
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass                                     # zero_ext.load did it (lightning_restore_optimizer is False)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for stage in (0, 1, 2, 3):
            strategy_registry.register(f"zero_ext_stage{stage}", cls, description=f"zero_ext ZeRO stage {stage}",
                                       stage=stage, override=True)


def _unpack(extra, path: str, weights_only: bool | None) -> dict:
    blob = extra.get(LIGHTNING_KEY) if isinstance(extra, dict) else None
    if blob is None:
        raise ValueError(f"zero_ext: {path!r} is a zero_ext checkpoint but not one ZeroStrategy saved (it holds no "
                         f"Lightning state); load it with zero_ext.load(path, model, optimizer) instead")
    return torch.load(io.BytesIO(blob.numpy().tobytes()), map_location="cpu", weights_only=weights_only)


def to_lightning_checkpoint(path, out) -> None:
    """Offline: ZeroStrategy checkpoint `path` as a plain Lightning checkpoint file `out`."""
    full = consolidate(path)
    checkpoint = _unpack(full["extra"], os.fspath(path), weights_only=False)
    checkpoint["state_dict"] = full["model"]
    opt = full["optimizer"]
    checkpoint["optimizer_states"] = opt if isinstance(opt, list) else [opt]
    torch.save(checkpoint, out)


ZeroStrategy.register_strategies(StrategyRegistry)

__all__ = ["ZeroStrategy", "to_lightning_checkpoint", "is_zero_checkpoint"]
