"""A rank's peak during a training step, predicted: estimate_memory(..., loss_fn=...).

The peak comes at the loss, where the activations peak: the model state is there, stage 3's
root and last unit are gathered, and stages 2-3 hold no gradient shard or ring yet
(zero_grad(set_to_none=True) released them; the first reduce brings them back, when
activations are already being freed). The activations are measured by running loss_fn and
backward once on a copy of the model made of fake tensors (nothing is allocated): the most
bytes of tensors alive at once that are not parameters, with each parameter's gradient
dropped as it lands (the engine stages and frees it).
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


def activation_peak(model: torch.nn.Module, loss_fn) -> int:
    """Most bytes one forward (loss_fn(model) -> loss) and its backward hold beyond the
    parameters, measured on a copy of the model made of fake tensors on the CPU (nothing is
    allocated; the CPU's kernels are chosen, e.g. flash attention's, as on a real run)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False) as fake:
        def faked(t):
            f = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            return torch.nn.Parameter(f, t.requires_grad) if isinstance(t, torch.nn.Parameter) else f
        memo = {id(t): faked(t) for t in list(model.parameters()) + list(model.buffers())}
        copy_ = copy.deepcopy(model, memo)   # the tensors replaced by fake ones: nothing is copied
        params = list(copy_.parameters())
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        with _LiveBytes(params) as live:
            loss = loss_fn(copy_)
            loss.backward()
            del loss
    return live.peak


def peak_bytes(est: dict, prefetch_depth: int, activations: int, on_cpu: bool) -> dict:
    """The peak from an estimate_memory result and the activations' peak: what is held at the loss."""
    msb, buf, stage = est["model_state_bytes"], est["buffer_bytes"], est["stage"]
    state = msb["parameters"] + msb["master_weights"] + msb["optimizer_states"]
    gradients = msb["gradients"] if stage <= 1 else 0   # stages 0-1 keep their gradient buckets
    gathered = buf.get("gathered_root", 0) + (buf.get("gathered_unit", 0) if prefetch_depth > 0 else 0)
    host = est["offload"].get("total", 0) if on_cpu else 0   # offload="cpu" on a CPU run: the same memory
    out = {"model_state": state + gradients + est["frozen_parameter_bytes"], "gathered": gathered,
           "activations": activations, "offload_host": host}
    out["total"] = sum(out.values())
    return out
