"""ZeroModel: the module wrapper that zeroify() returns (DDP's surface), and the
stage-3 unit hooks that gather parameters around each unit's forward and backward."""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten


def cast_buffers(model: nn.Module, low: torch.dtype, which) -> None:
    """With a low param_dtype: which floating-point buffers compute in it too.
    which=True: all; False: none; "auto": only the running statistics of torch's
    normalization layers (BatchNorm, InstanceNorm), whose kernels need them in their
    weight's dtype. Others (RoPE's inv_freq, ...) keep their precision."""
    norm = nn.modules.batchnorm._NormBase
    with torch.no_grad():
        for m in model.modules():
            if which is False or (which == "auto" and not isinstance(m, norm)):
                continue
            for name, b in m._buffers.items():
                if b is not None and b.is_floating_point():
                    m._buffers[name] = b.to(low)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class ZeroModel(nn.Module):
    """Wraps the user's module: `.module`, `no_sync()`, `state_dict()` with the
    unwrapped module's keys. Gradient hooks live on the parameters; this class
    waits for gathered parameters, broadcasts buffers and (stage 3) drives units."""

    def __init__(self, module: nn.Module, engine, config, buffers: list, unit_modules: list,
                 root_holders: list):
        super().__init__()
        self.module = module
        self._engine = engine
        self._config = config
        self._buffers_to_sync = buffers
        self._callback_queued = False
        self._units = _UnitHooks(self, unit_modules, root_holders) if config.stage == 3 else None
        self._compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.param_dtype)

    def forward(self, *args, **kwargs):
        self._engine.wait_params()
        if self._config.broadcast_buffers and self._buffers_to_sync and self._engine.world_size > 1:
            self._engine.broadcast_tensors(self._buffers_to_sync, 0)
        if self._compute_dtype is not None:
            # As FSDP's MixedPrecision(cast_forward_inputs=True): floating-point inputs
            # are cast to the parameters' dtype; integer ones (token ids) are left alone.
            args, kwargs = torch.utils._pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(self._compute_dtype) if t.is_floating_point() else t, (args, kwargs))
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (stages 0-1) for the backward passes run
        inside; the first backward outside reduces them all. Stages 2-3 still reduce
        every backward into the gradient shard (their memory saving), so no_sync
        defers nothing there but remains correct."""
        old = self._engine.require_sync()
        self._engine.set_require_sync(False)
        try:
            yield
        finally:
            self._engine.set_require_sync(old)

    def state_dict(self, *args, **kwargs):
        self._engine.wait_params()
        if self._units is not None:
            return self._units.full_state_dict(*args, **kwargs)
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise ValueError("zero_ext: load_state_dict(assign=True) would detach parameters from the "
                             "sharded buckets; use assign=False")
        if self._units is not None:
            raise NotImplementedError("zero_ext: loading a full state_dict into a stage-3 model is not "
                                      "supported yet; load it into the plain model before zeroify()")
        self._engine.wait_params()
        return self.module.load_state_dict(state_dict, strict=strict)

    # Autograd hook plumbing. Note [No cycles through C++]: the engine holds the
    # parameters in C++, and the hooks live on the parameters, so a hook that
    # held the wrapper (or the engine) strongly would form a cycle Python's GC
    # cannot see, keeping the engine and its process group alive past
    # destroy_process_group(). Hooks hold a weak reference instead.
    def _grad_hook(self, index: int):
        ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            wrapper = ref()
            if wrapper is not None:
                wrapper._begin_backward()
                wrapper._engine.mark_ready(index)

        return hook

    def _begin_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._callback_queued = False
        self._engine.finalize_backward()


class _UnitHooks:
    """Stage 3: gather each unit before its forward and backward, release it after
    (Note [Stage 3 parameter lifetime] in csrc/engine/gatherer.cpp), and prefetch the next
    units. The forward's unit sequence starts as registration order and is learned
    (repeats included) from the first forward; backward follows the reverse of the
    current forward's recorded sequence. A forward that runs units in another
    order (eval, generation, a branch) still prefetches from the predicted
    sequence, resynchronizing on the unit it meets, and counts the fetches it did
    not foresee in stats()["out_of_order_fetches"]."""

    def __init__(self, wrapper: ZeroModel, unit_modules: list, root_holders: list):
        self.wrapper = wrapper
        self.engine = wrapper._engine
        self.depth = wrapper._config.prefetch_depth
        self.order = list(range(1, len(unit_modules)))   # predicted forward sequence
        self.learned = False
        self.cursor = 0                                 # next expected position in self.order
        self.recorded: list[int] = []                   # this forward's sequence
        self.back_cursor = 0                            # position in reversed(self.recorded)
        self.out_of_order = 0
        self.fetches = 0
        self.in_root = False                            # inside the root module's forward
        # The root's hooks run whichever way the model is entered: the wrapper,
        # model.module(...) or a method such as generate() that calls it.
        unit_modules[0].register_forward_pre_hook(self._root_pre_forward)
        unit_modules[0].register_forward_hook(self._root_post_forward)
        # Modules holding root-unit parameters (e.g. a tied embedding) may also be
        # called on their own (model.wte(idx)): they gather the root unit too.
        for m in root_holders:
            m.register_forward_pre_hook(self._holder_pre_forward)
            m.register_forward_hook(self._holder_post_forward)
        for k, m in enumerate(unit_modules):
            if k == 0:
                continue
            m.register_forward_pre_hook(functools.partial(self._pre_forward, k))
            m.register_forward_hook(functools.partial(self._post_forward, k))

    # -- prediction and prefetch
    @staticmethod
    def _advance(seq: list, cursor: int, k: int) -> int:
        """The cursor after meeting unit k: past its next occurrence in seq."""
        for i in range(cursor, len(seq)):
            if seq[i] == k:
                return i + 1
        return cursor

    def _upcoming(self, seq: list, cursor: int, k: int) -> list:
        out = []
        for u in seq[cursor:]:
            if len(out) >= self.depth:
                break
            if u != k and u not in out:
                out.append(u)
        return out

    def _fetch(self, k: int, upcoming: list) -> None:
        """Make unit k whole; count it if it was not foreseen; prefetch `upcoming`."""
        self.fetches += 1
        foreseen = self.engine.unit_gathered(k) or self.engine.gather_unit(k, False)
        self.engine.gather_unit(k, True)
        if not foreseen:
            self.out_of_order += 1
        for u in upcoming:
            self.engine.gather_unit(u, False)

    # -- root module
    def _root_pre_forward(self, module, args):
        if _in_backward():
            return
        self.recorded = []
        self.cursor = 0
        self.in_root = True
        self.engine.gather_unit(0, True)
        for u in self._upcoming(self.order, 0, 0):
            self.engine.gather_unit(u, False)

    def _root_post_forward(self, module, args, out):
        if _in_backward():
            return
        self.in_root = False
        if not self.learned and self.recorded:
            self.order = list(self.recorded)
            self.learned = True
        backward_follows = torch.is_grad_enabled() and any(
            t.requires_grad for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        if backward_follows:
            # backward starts with the last units of this forward: fetch them now
            self.back_cursor = 0
            for u in self._upcoming(list(reversed(self.recorded)), 0, 0):
                self.engine.gather_unit(u, False)
        else:
            for k in range(self.engine.num_units):   # no backward follows: free everything
                self.engine.release_unit(k)

    # -- module hooks
    def _holder_pre_forward(self, module, args):
        if not self.engine.unit_gathered(0):
            self._fetch(0, [])

    def _holder_post_forward(self, module, args, output):
        if not self.in_root and not _in_backward() and not torch.is_grad_enabled():
            self.engine.release_unit(0)

    def _pre_forward(self, k, module, args):
        if _in_backward():                # recomputation (checkpointing): already gathered
            self._fetch(k, [])
            return
        self.recorded.append(k)
        self.cursor = self._advance(self.order, self.cursor, k)
        self._fetch(k, self._upcoming(self.order, self.cursor, k))

    def _post_forward(self, k, module, args, output):
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, k))
        if _in_backward():                # recomputation keeps it for its backward
            return
        if k in self._upcoming(self.order, self.cursor, -1):       # needed again at once
            return
        if torch.is_grad_enabled() and self.learned and self.cursor >= len(self.order):
            return                        # the last unit of forward is the first of backward
        self.engine.release_unit(k)

    def _pre_backward(self, k, grad):
        self.wrapper._begin_backward()
        seq = list(reversed(self.recorded))
        self.back_cursor = self._advance(seq, self.back_cursor, k)
        if not self.engine.unit_gathered(k):
            self._fetch(k, [])
        for u in self._upcoming(seq, self.back_cursor, k):
            self.engine.gather_unit(u, False)
        return None

    def full_state_dict(self, *args, **kwargs):
        """The plain module's state_dict, gathered one unit at a time (clones)."""
        out = {}
        for k in range(self.engine.num_units):
            self.engine.gather_unit(k, True)
            for name, t in self.wrapper.module.state_dict(*args, keep_vars=True, **kwargs).items():
                if name not in out and t.untyped_storage().nbytes() > 0:
                    out[name] = t.detach().clone()
            self.engine.release_unit(k)
        sd = self.wrapper.module.state_dict(keep_vars=True)
        return {name: out[name] for name in sd}
