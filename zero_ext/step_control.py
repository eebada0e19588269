"""The fused step's control scalars (clip factor, inf/nan verdict, loss scale, step counts)
kept in the gradients' memory (Note [Step control], csrc/core/zx_step_control.h): a step
never waits for the device. On CPU tensors the same C rules run on the host.
"""
from __future__ import annotations

import torch

from . import _C


class StepControl:
    def __init__(self, engine, n_groups: int, scaler, device: torch.device):
        cuda = device.type == "cuda"
        self._engine = engine
        self._clip = _C.cuda_clip_control if cuda else _C.clip_control
        self._step = _C.cuda_step_control if cuda else _C.step_control
        self.ctl = torch.zeros(_C.CTL_SIZE, dtype=torch.float64, device=device)
        self.ctl[_C.CTL_CLIP] = 1.0
        self.out2 = torch.zeros(2, dtype=torch.float32, device=device)
        self.norm = torch.zeros(1, dtype=torch.float32, device=device)
        self.steps = torch.zeros(n_groups, dtype=torch.int64, device=device)
        self.scaler = scaler.to_bytes().to(device) if scaler is not None else None
        self.scale = torch.tensor(scaler.scale if scaler is not None else 1.0, dtype=torch.float32, device=device)
        self._found_known = False
        self._clip_at = None        # the gradients' generation a pending clip factor was computed from

    def _drop_stale(self) -> None:
        """Drop a pending clip factor and verdict once their gradients changed."""
        if self._clip_at is not None and self._clip_at != self._engine.grad_generation:
            self.ctl[_C.CTL_CLIP] = 1.0
            self.ctl[_C.CTL_FOUND] = 0.0
            self._found_known = False
        self._clip_at = self._engine.grad_generation

    def clip(self, max_norm: float) -> torch.Tensor:
        """The global 2-norm of the averaged unscaled gradients, on the device."""
        self._drop_stale()
        self._engine.grad_sumsq_into(self.out2)
        self._clip(self.ctl, self.out2, self._engine.grad_divisor(), self.scaler, float(max_norm), self.norm)
        self._found_known = True
        return self.norm[0].clone()

    def clip_by(self, coef: float, found: bool) -> None:
        """A clip factor and verdict the host computed (the inf-norm path)."""
        self._drop_stale()
        if coef < 1.0:
            self.ctl[_C.CTL_CLIP:_C.CTL_CLIP + 1].mul_(coef)
        self.ctl[_C.CTL_FOUND] = 1.0 if found else 0.0
        self._found_known = True

    def before_step(self) -> None:
        """The multiplier, skip verdict, loss-scale update and step counts, in device memory."""
        self._drop_stale()
        self._clip_at = None
        out2 = None
        if self.scaler is not None and not self._found_known:
            self._engine.grad_sumsq_into(self.out2)   # the inf/nan scan (and its all-reduce)
            out2 = self.out2
        self._found_known = False
        self._step(self.ctl, out2, self._engine.grad_divisor(), self.scaler, self.scale, self.steps)

    def host_scaler(self, like):
        """The device scaler's state as a LossScaler (a device-to-host copy)."""
        return like.from_bytes(self.scaler.cpu()) if self.scaler is not None else None

    def load_scaler(self, scaler) -> None:
        if self.scaler is not None:
            self.scaler.copy_(scaler.to_bytes())
            self.scale.fill_(scaler.scale)

    def host_steps(self) -> list[int]:
        return self.steps.tolist()

    def load_steps(self, steps) -> None:
        self.steps.copy_(torch.tensor(list(steps), dtype=torch.int64))
