"""ZeroModel: the module wrapper that zeroify() returns (DDP's surface), and the
stage-3 unit hooks that gather parameters around each unit's forward and backward."""
from __future__ import annotations

import collections
import contextlib
import functools
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from . import compiled, offload
from ._C import PHASE_BACKWARD, PHASE_FORWARD, PHASE_FORWARD_NOGRAD, PHASE_MODEL_STATE, UNIT_NEED_BASE, UnitSchedule
from .alone import source


def cast_buffers(model: nn.Module, low: torch.dtype, which) -> None:
    """Cast floating-point buffers to a low param_dtype. which: True (all), False (none) or "auto":
    only the normalization layers' running statistics, which their kernels need in it."""
    norm = nn.modules.batchnorm._NormBase
    with torch.no_grad():
        for m in model.modules():
            if which is False or (which == "auto" and not isinstance(m, norm)):
                continue
            for name, b in m._buffers.items():
                if b is not None and b.is_floating_point():
                    m._buffers[name] = b.to(low)


def forward_phase() -> int:
    """A forward with autograd, or one without (evaluation, generation): a phase of its own."""
    return PHASE_FORWARD if torch.is_grad_enabled() else PHASE_FORWARD_NOGRAD


def _hide_sharded_grads(ref, grad):
    wrapper = ref()
    if wrapper is not None:
        wrapper._engine.hide_sharded_grads()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _backward_follows(out) -> bool:
    return torch.is_grad_enabled() and any(
        t.requires_grad for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))


class ZeroModel(nn.Module):
    """Wraps the user's module as DDP does (`.module`, `no_sync()`, the module's state_dict keys);
    waits for gathered parameters, broadcasts buffers and (stage 3) drives units."""

    def __init__(self, module: nn.Module, engine, config, buffers: list, unit_modules: list,
                 root_holders: list):
        super().__init__()
        self.module = module
        self._engine = engine
        self._config = config
        self._buffers_to_sync = buffers
        self._callback_queued = False
        self.pinned = collections.Counter()   # stage 3: units gathered_parameters() holds whole
        self._units = _UnitHooks(self, unit_modules, root_holders) if config.stage == 3 else None
        self.compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.param_dtype)   # or None
        self._param_waits = self.guard = self._optimizer = None   # attach(); guard: the ModelGuard (changes.py)
        self.weights_report = None  # zeroify(weights=...): what was read (zero_ext.WeightsReport)
        self._call_module = compiled.module_caller()   # Note [Compiled wrapper]: the frame dynamo captures

    def attach(self, guard, optimizer, param_waits=None) -> None:
        """zeroify's last step: what was built after this wrapper."""
        self.guard, self._optimizer, self._param_waits = guard, weakref.ref(optimizer), param_waits

    def owns_parameter(self, p: torch.Tensor) -> bool:
        """Whether p is a parameter in this model's buckets (not a copy of one)."""
        return self.guard is not None and self.guard.owns(p)

    # What the package's other modules read (tests/test_privates.py), read-only.
    engine = property(lambda self: self._engine, doc="the C++ engine, shared with the ZeroOptimizer")
    stage = property(lambda self: self._config.stage, doc="the ZeRO stage, 0 to 3")
    units = property(lambda self: self._units, doc="stage 3: the unit hooks (_UnitHooks), else None")
    param_waits = property(lambda self: self._param_waits, doc="overlap_param_gather's ParamWaits, or None")
    optimizer = property(lambda self: self._optimizer() if self._optimizer is not None else None,
                         doc="the ZeroOptimizer, while it lives (attach()), else None")

    def forward(self, *args, **kwargs):
        hook = compiled.pause()   # Note [Compiled wrapper]: None in eager
        try:
            return self._forward(hook, args, kwargs)
        finally:
            if hook is not None:
                compiled.resume(hook)

    compiled.skip_frame(forward)   # Note [Compiled wrapper] (zero_ext/compiled.py)

    def _forward(self, hook, args, kwargs):
        self._engine.hide_sharded_grads()   # Note [Sharded gradients]: autograd accumulates into plain ones
        # Note [Reading alone] (csrc/engine/away.h): a forward that communicates is settled first
        broadcast = self._config.broadcast_buffers and self._buffers_to_sync and self._engine.world_size > 1
        away = self._engine.sequence_mark(forward_phase(), servable=self._units is not None or bool(broadcast))
        if self._units is not None:
            self._units.marked = True
        waits = self._param_waits
        if waits is not None:
            waits.before_forward(hook is not None)   # Note [Gathers waited per module] (zero_ext/param_waits.py)
        else:
            self._engine.flush_params()   # (Note [Cut parameters] in csrc/engine/fill.cpp)
        if broadcast:
            source(away).buffers(self._engine, self._buffers_to_sync)
        if self.compute_dtype is not None:
            # as FSDP's MixedPrecision(cast_forward_inputs=True)
            args, kwargs = torch.utils._pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t, (args, kwargs))
        units = self._units if self._config.compile_units == "whole" else None   # per unit: traced hooks
        if hook is None:
            out = self.module(*args, **kwargs)
        else:   # traced (Note [Compiled wrapper]); stage 3 per unit: its hooks break the graph, as in eager
            in_graph = units is not None and compiled.UNITS_IN_GRAPH
            if units is not None:
                units.compiled_begin(gather=not in_graph)
            compiled.resume(hook)
            out = None
            try:   # in graph: Note [Stage 3 collectives in the graph]
                out = (units.ops_call if in_graph else self._call_module)(self.module, args, kwargs)
            finally:
                compiled.pause()
                if units is not None:   # (out None: raised, no backward follows)
                    units.compiled_end(out)
        if waits is not None:
            waits.after_forward()
        if torch.is_grad_enabled():   # a second backward of this forward (retain_graph) starts here
            ref = weakref.ref(self)   # Note [No cycles through C++]
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(_hide_sharded_grads, ref))
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's Module.zero_grad, the sharded gradients included."""
        self._engine.zero_grad(set_to_none)
        super().zero_grad(set_to_none)

    @contextlib.contextmanager
    def no_sync(self):
        """As DDP's; stages 2-3 hold a full-size gradient meanwhile (Note [Local accumulation] in
        csrc/engine/reducer.cpp)."""
        old = self._engine.require_sync()
        self._engine.set_require_sync(False)
        try:
            yield
        finally:
            self._engine.set_require_sync(old)

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's attribute: False is no_sync() until set back to True."""
        return bool(self._engine.require_sync())

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._engine.set_require_sync(bool(value))

    def state_dict(self, *args, **kwargs):
        self._engine.flush_params()
        if self._units is not None:
            return self._units.full_state_dict(*args, **kwargs)
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's load_state_dict on the plain module, into the fp32 masters (zero_ext/changes.py)."""
        if assign:
            raise ValueError("zero_ext: load_state_dict(assign=True) would detach parameters from the "
                             "sharded buckets; pass assign=False (the default): the values are copied into the "
                             "fp32 master weights")
        return self.module.load_state_dict(state_dict, strict=strict)

    # Note [No cycles through C++]
    #   The engine holds the parameters in C++ and the hooks live on them. A hook holding the
    #   wrapper strongly would make a cycle Python's GC cannot see, keeping the engine and its
    #   process group alive past destroy_process_group(). Hooks hold a weak reference instead.
    def grad_hook(self, index: int):
        ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            wrapper = ref()
            if wrapper is not None:
                wrapper.begin_backward()
                wrapper._engine.mark_ready(index)

        return hook

    def begin_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self._engine.sequence_mark(PHASE_BACKWARD)
            if self._config.step_in_backward:   # Note [Step in backward] (csrc/engine/backward_step.cpp)
                opt = self.optimizer
                if opt is not None:
                    opt.arm_backward_step()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._callback_queued = False
        self._engine.finalize_backward()


class _UnitHooks:
    """Stage 3: gather each unit before its forward and backward, release it after (Note [Stage 3
    parameter lifetime] in csrc/engine/units.cpp), prefetch what `schedule` predicts (Note
    [Stage 3 unit sequence] in csrc/engine/unit_schedule.h)."""

    def __init__(self, wrapper: ZeroModel, unit_modules: list, root_holders: list):
        self.wrapper = wrapper
        self.engine = wrapper._engine
        self.numel = [self.engine.unit_numel(u) for u in range(self.engine.num_units)]
        self.schedule = UnitSchedule(self.numel, wrapper._config.prefetch_depth, wrapper._config.coalesce_numel)
        self.in_root = False                            # inside the root module's forward
        self.marked = False                             # the wrapper marked this forward already
        self.kept: set = set()                          # units kept while reading alone (_keeping)
        self.keep_fits = None                           # whether the whole model may be kept
        self.compiled = False                           # a compiled forward runs (Note [Stage 3 compiled whole])
        self.ops = self.ops_call = None                 # Note [Stage 3 collectives in the graph]: call_in_graph
        self.modules = unit_modules                     # index 0 the model (Units reads them)
        # the root's hooks run however the model is entered (the wrapper, model.module, generate())
        unit_modules[0].register_forward_pre_hook(self._root_pre_forward)
        unit_modules[0].register_forward_hook(self._root_post_forward)
        # modules holding root-unit parameters (a tied embedding) may be called alone: model.wte(idx)
        for m in root_holders:
            m.register_forward_pre_hook(self._holder_pre_forward)
            m.register_forward_hook(self._holder_post_forward)
        for k, m in enumerate(unit_modules[1:], 1):
            m.register_forward_pre_hook(functools.partial(self._pre_forward, k), with_kwargs=True)
            m.register_forward_hook(functools.partial(self._post_forward, k), with_kwargs=True)

    def _source(self, away: bool | None = None):
        """Where this hook's units come from (zero_ext/alone/source.py); away: its mark's answer."""
        return source(self.engine.sequence_away if away is None else away)

    def _prefetch(self, k: int, src) -> None:
        """Gather the units expected after k (Note [Coalesced unit gathers], csrc/engine/units.cpp)."""
        together, launch = self.schedule.ahead(self.engine, k, _in_backward())
        src.units(self.wrapper.optimizer, launch, together)

    def _release(self, k: int, keep: bool = False) -> None:
        """Release unit k unless gathered_parameters() holds it or a rank reading alone keeps it."""
        if self.wrapper.pinned[k] or k in self.kept:
            return
        if self._keeping(self._source()):
            self.kept.add(k)
            return
        self.engine.release_unit(k, keep)

    def _keeping(self, src) -> bool:
        """A rank reading alone without autograd keeps its units gathered (what it fetched cannot
        change until it is back), if the whole model takes at most a quarter of the free memory."""
        if not src.reads_alone or torch.is_grad_enabled():
            return False
        if self.keep_fits is None:
            need = sum(self.numel) * (2 if self.wrapper.compute_dtype is not None else 4)
            dev = self.wrapper.optimizer.comm.device
            have = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else offload.available_host_bytes()
            self.keep_fits = have is not None and 4 * need <= have
        return self.keep_fits

    def _drop_kept(self) -> None:
        """Release the units kept while reading alone."""
        kept, self.kept = self.kept, set()
        for k in sorted(kept):
            self._release(k)

    def _need(self, k: int) -> None:
        """Unit k is needed now: record it, gather it, prefetch what follows. A unit that
        gathered_parameters() holds needs no collective, so one rank may evaluate alone in it."""
        if self.wrapper.pinned[k]:
            return
        self.schedule.need(k, _in_backward())
        src = self._source(self.engine.sequence_mark(UNIT_NEED_BASE + k))
        if not self.engine.unit_gathered(k) and not src.unit(self.wrapper.optimizer, k):
            self.schedule.out_of_order += 1
        self._prefetch(k, src)

    def compiled_begin(self, gather: bool = True) -> None:
        """Before the graph (Note [Stage 3 compiled whole]): every unit gathered (unless the graph
        gathers them), the unit hooks inert."""
        self.compiled, self.marked = True, False
        self.schedule.stop_recording()
        if self.kept:
            self._drop_kept()
        src, opt = self._source(), self.wrapper.optimizer
        missing = [k for k in range(self.engine.num_units if gather else 0) if not self.engine.unit_requested(k)]
        src.units(opt, missing, len(missing) > 1)   # one collective (Note [Coalesced unit gathers]), each waited for
        for k in range(self.engine.num_units if gather else 0):
            src.unit(opt, k)
        if not gather and self.ops is None:   # Note [Stage 3 collectives in the graph]: the prototype
            from .unit_ops import Units
            self.ops, self.ops_call = Units(self.wrapper, self.modules), compiled.module_caller()
        if not gather:
            self.ops.install(True)

    def compiled_end(self, out) -> None:
        """After the graph: without a backward to come, every unit is released now."""
        self.compiled, follows = False, _backward_follows(out)
        if self.ops is not None:
            self.ops.install(False, follows)
        if not follows:
            for k in range(self.engine.num_units):
                self._release(k)

    def _root_pre_forward(self, module, args):
        if self.compiled or _in_backward():   # Note [Stage 3 compiled whole] (zero_ext/compiled.py)
            return
        self.schedule.begin_pass(torch.is_grad_enabled())   # the previous pass is complete
        self.engine.hide_sharded_grads()   # entered as model.module(...) too
        if not self.marked:                # Note [Reading alone]: settled before its gathers
            self.engine.sequence_mark(forward_phase(), servable=True)
        self.marked = False
        src = self._source()
        if self.kept and not self._keeping(src):
            self._drop_kept()
        self.in_root = True
        src.unit(self.wrapper.optimizer, 0)
        self._prefetch(0, src)

    def _root_post_forward(self, module, args, out):
        if self.compiled or _in_backward():
            return
        self.in_root = False
        backward_follows = _backward_follows(out)
        self.schedule.end_forward(torch.is_grad_enabled(), backward_follows)
        if not backward_follows:
            for k in range(self.engine.num_units):
                self._release(k)

    def _holder_pre_forward(self, module, args):
        if self.compiled:
            return
        if not self.engine.unit_gathered(0):
            self.schedule.fetches += 1
            self.schedule.out_of_order += 1
            self._source().unit(self.wrapper.optimizer, 0)

    def _holder_post_forward(self, module, args, output):
        if self.compiled:
            return
        if not self.in_root and not _in_backward() and not torch.is_grad_enabled():
            self._release(0)

    def _pre_forward(self, k, module, args, kwargs):
        if self.compiled:
            return
        self._need(k)
        if torch.is_grad_enabled() and not _in_backward() and self.engine.unit_has_frozen(k):
            # Note [Stage 3 frozen parameters] (csrc/engine/frozen.cpp): kept until its inputs' gradients
            inputs = [t for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.requires_grad]
            if inputs:
                ref = weakref.ref(self.wrapper)      # Note [No cycles through C++]

                def release(grads):
                    wrapper = ref()
                    if wrapper is not None:
                        wrapper._engine.release_frozen(k)

                torch.autograd.graph.register_multi_grad_hook(inputs, release, mode="all")

    def _post_forward(self, k, module, args, kwargs, output):
        if self.compiled:
            return
        if torch.is_grad_enabled():
            outs = [output] if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
            # an input handed back unchanged (T5's position bias) says nothing of this unit's backward
            inputs = [id(t) for t in (args if not kwargs and all(isinstance(a, torch.Tensor) for a in args)
                                      else tree_flatten((args, kwargs))[0])]
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in inputs:
                    t.register_hook(functools.partial(self._pre_backward, k))
        if _in_backward():                # recomputation keeps it for its backward
            return
        if not self.schedule.kept_after_forward(k):   # keep: node_size keeps a node-local part
            self._release(k, torch.is_grad_enabled())

    def _pre_backward(self, k, grad):
        self.wrapper.begin_backward()
        self._need(k)
        return None

    def full_state_dict(self, *args, **kwargs):
        """The plain module's state_dict, gathered one unit at a time (clones, a tied weight once).
        Collective, or served to a rank calling it alone (Note [Reading alone] in csrc/engine/away.h)."""
        src = self._source(self.engine.sequence_mark(PHASE_MODEL_STATE, servable=True))
        low = self.wrapper.compute_dtype is not None
        src.fits(sum(s.numel() for s in self.wrapper.guard.shapes) * (2 if low else 4), "model.state_dict()")
        out, clones = {}, {}
        for k in range(self.engine.num_units):
            was = self.engine.unit_gathered(k)
            src.unit(self.wrapper.optimizer, k)
            for name, t in self.wrapper.module.state_dict(*args, keep_vars=True, **kwargs).items():
                if name not in out and t.untyped_storage().nbytes() > 0:
                    if id(t) not in clones:
                        clones[id(t)] = t.detach().clone()
                    out[name] = clones[id(t)]
            if not was:
                self._release(k)
        sd = self.wrapper.module.state_dict(*args, keep_vars=True, **kwargs)
        return {name: out[name] for name in sd}
