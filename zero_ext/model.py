"""ZeroModel: the module wrapper that zeroify() returns (DDP's surface)."""
from __future__ import annotations

import contextlib

import torch
from torch import nn


class ZeroModel(nn.Module):
    """Wraps the user's module: `.module`, `no_sync()`, `state_dict()` with the
    unwrapped module's keys. Gradient hooks live on the parameters; this class
    only waits for gathered parameters and broadcasts buffers before forward."""

    def __init__(self, module: nn.Module, engine, config, buffers: list):
        super().__init__()
        self.module = module
        self._engine = engine
        self._config = config
        self._buffers_to_sync = buffers
        self._callback_queued = False

    def forward(self, *args, **kwargs):
        self._engine.wait_params()
        if self._config.broadcast_buffers and self._buffers_to_sync and self._engine.world_size > 1:
            self._engine.broadcast_tensors(self._buffers_to_sync, 0)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (stages 0-1) for the backward passes run
        inside; the first backward outside reduces them all. Stage 2 still reduces
        every backward into the gradient shard (its memory saving), so no_sync
        only defers nothing there but remains correct."""
        old = self._engine.require_sync()
        self._engine.set_require_sync(False)
        try:
            yield
        finally:
            self._engine.set_require_sync(old)

    def state_dict(self, *args, **kwargs):
        self._engine.wait_params()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise ValueError("zero_ext: load_state_dict(assign=True) would detach parameters from the "
                             "sharded buckets; use assign=False")
        self._engine.wait_params()
        return self.module.load_state_dict(state_dict, strict=strict)

    # Autograd hook plumbing (kept here so the closure holds no optimizer).
    def _grad_hook(self, index: int):
        engine = self._engine

        def hook(param: torch.Tensor) -> None:
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            engine.mark_ready(index)

        return hook

    def _end_backward(self) -> None:
        self._callback_queued = False
        self._engine.finalize_backward()
