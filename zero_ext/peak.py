"""A rank's peak during a training step, predicted: estimate_memory(..., loss_fn=...).

The peak comes at the loss: the model state, stage 3's root and last unit gathered, no
gradients yet. The activations are measured by running loss_fn and backward once on a copy
of the model made of fake tensors (nothing is allocated).
"""
from __future__ import annotations

import copy
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _LiveBytes(TorchDispatchMode):
    """The bytes of the storages the dispatched ops return, while a tensor holds them."""

    def __init__(self, params):
        super().__init__()
        self.skip = {p.untyped_storage()._cdata for p in params}
        self.alive: dict = {}   # storage -> [bytes, tensors holding it]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._hold(t)
        return out

    def _hold(self, t: torch.Tensor) -> None:
        key = t.untyped_storage()._cdata
        if key in self.skip:
            return
        entry = self.alive.get(key)
        if entry is None:
            entry = self.alive[key] = [t.untyped_storage().nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key) -> None:
        entry = self.alive[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.alive[key]


def activation_peak(model, loss_fn, param_dtype: torch.dtype = torch.float32, grad_bytes: int = 0,
                    first_grad: int = 0) -> int:
    """Most bytes one forward (loss_fn(model) -> loss) and its backward hold beyond the parameters
    (in param_dtype), on fake CPU tensors. A gradient is freed as it lands (grad_bytes 0) or kept
    at grad_bytes per element (stages 0-1's buckets: Note [Bucket gradient lifetime] in
    csrc/engine/shard_view.cpp), with first_grad bytes (their ring) from the first one on."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False):
        def faked(t):
            if not isinstance(t, torch.nn.Parameter):
                return torch.empty(t.shape, dtype=t.dtype, device="cpu")
            dtype = param_dtype if t.is_floating_point() else t.dtype
            return torch.nn.Parameter(torch.empty(t.shape, dtype=dtype, device="cpu"), t.requires_grad)
        memo = {id(t): faked(t) for t in list(model.parameters()) + list(model.buffers())}
        copy_ = copy.deepcopy(model, memo)   # the tensors replaced by fake ones: nothing is copied
        params, kept = list(copy_.parameters()), set()
        live = _LiveBytes(params)

        def landed(p):   # a tied weight lands twice, is kept once
            p.grad = None
            if grad_bytes and id(p) not in kept:
                live.now += p.numel() * grad_bytes + (0 if kept else first_grad)
                live.peak = max(live.peak, live.now)
                kept.add(id(p))
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(landed)
        with live:
            loss = loss_fn(copy_)
            loss.backward()
            del loss
    return live.peak


def peak_bytes(est: dict, prefetch_depth: int, activations: int, on_cpu: bool, grads_kept: bool = False) -> dict:
    """What is held at the loss, from estimate_memory's result and the activations' peak
    (grads_kept: stages 0-1 hold their gradient buckets)."""
    msb, buf, stage = est["model_state_bytes"], est["buffer_bytes"], est["stage"]
    state = msb["parameters"] + msb["master_weights"] + msb["optimizer_states"]
    gradients = msb["gradients"] if stage <= 1 and grads_kept else 0   # else released (in activations: backward)
    gathered = buf.get("gathered_root", 0) + (buf.get("gathered_unit", 0) if prefetch_depth > 0 else 0)
    out = {"model_state": state + gradients + est["frozen_parameter_bytes"], "gathered": gathered,
           "activations": activations}
    out["total"] = sum(out.values())
    # offload="cpu": host memory, the device's peak on a GPU; the same process memory on a CPU run
    out["offload_host"] = est["offload"].get("total", 0)
    if on_cpu:
        out["total"] += out["offload_host"]
    return out
