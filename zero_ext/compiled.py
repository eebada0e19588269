"""What torch.compile traces of a zeroified model (Note [Compiled wrapper]).

Note [Compiled wrapper]
  `torch.compile(model, fullgraph=True)` on what zeroify returned must trace the
  user's module whole, while the wrapper's own work (ZeroModel.forward: hiding the
  sharded gradients, the sequence mark, waiting for gathered parameters, the buffers'
  broadcast, the input cast, the gradient hooks on the outputs) calls the C++ engine,
  which dynamo cannot trace. That work runs before and after the module's forward,
  as DDP's does around a compiled module: dynamo is told to skip the wrapper's frame,
  which turns torch.compile's frame hook off for its own work (so the Python helpers
  it calls are not captured either) and back on to call the module from a frame of
  zero_ext's own, one code object per model: that frame is captured and the user's
  module compiled under it as one graph. In eager, where there is no hook, forward
  costs a lookup of it (tens of ns) and calls the module as before. The gradient-ready hooks (AccumulateGrad post hooks)
  run in autograd's engine after the compiled backward, as compiled DDP's do: they are
  not part of any frame dynamo traces, so they break no graph.
  Limits: a function compiled around the model (`torch.compile(train_step)` calling
  model(x)) inlines the wrapper's frame, and a skipped frame inlined is a graph break
  there; compile the model. Stages 1-2's per-module parameter waits
  (overlap_param_gather, zero_ext/param_waits.py) wait for everything at the forward's
  start under compile. Stage 3: Note [Stage 3 compiled whole].

Note [Stage 3 compiled whole]
  Stage 3's unit hooks (model.py's _UnitHooks) run inside the user's module, so under
  compile they are traced; each returns at once while `compiled` is set (dynamo guards
  on the flag and traces them to nothing; eager pays one attribute read). The wrapper
  sets it around the compiled call and, before it, gathers every unit (so the graph
  reads whole parameters, as in eager, and its autograd node records their shapes);
  the engine releases each unit as its last gradient is staged, as in eager, and a
  forward no backward follows releases every unit after it. What this costs: during
  a compiled step the whole model is gathered at once (stage 2's parameter memory,
  sharded gradients and optimizer states kept), the gathers do not overlap the
  forward, and a rank reading alone is not served under compile. The next step is
  Note [Stage 3 collectives in the graph].

Note [Stage 3 collectives in the graph]
  The design for stage 3 with its memory under compile (issue 54; not built yet):
  - unit_gather(engine, unit, anchor) -> flat: a custom operator (TORCH_LIBRARY in a
    csrc/*_binding.cpp, a fake kernel giving flat's shape and dtype: the unit's padded
    numel in param_dtype) returning a fresh whole copy of the unit; `anchor` is a
    0-element leaf per unit that requires grad, so autograd has an edge to call back.
  - Its autograd formula is unit_reduce(engine, unit, grad_flat) -> anchor's gradient:
    the engine takes the unit's gradient whole (staging and reducing its buckets as
    mark_ready does) and returns an empty tensor, so the node stays live in the
    compiled backward graph; the reduce-scatter is then a node of that graph.
  - The module reads views of flat: under compile the traced unit pre-hook returns
    them as the unit's parameters (functional_call-style), so a unit's reads depend on
    its gather by data, and inductor may schedule the gather early (prefetch) but
    never after its first use; every rank compiles the same graph, so collectives keep
    one order on every rank.
  - Memory: flat is an activation; tagged must-recompute (selective activation
    checkpointing) it is gathered again in backward instead of being saved, which is
    stage 3's release after forward. Both ops are ordered (effect tokens,
    torch._higher_order_ops.effects) so that no rank reorders its collectives.
"""
from __future__ import annotations

import types


def skip_frame(fn: types.FunctionType) -> bool:
    """Mark fn's frame to be run, not traced, by dynamo (the frames it calls are traced
    as usual): what torch._dynamo's skip does, without importing torch._dynamo (2 s).
    False where this torch lacks the hook (then the wrapper breaks the graph, as before)."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return False
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))
    return True


def pause():
    """Turn torch.compile's frame hook off (the wrapper's own work calls Python functions
    that dynamo would otherwise capture as frames of their own); returns the hook to
    resume, None when there is none (eager)."""
    if _get is None:
        return None
    hook = _get()
    if hook is None or hook is False:   # eager, or run-only (compiles nothing new)
        return None
    _set(None)
    return hook


def resume(hook) -> None:
    _set(hook)


def module_caller():
    """A function calling module(*args, **kwargs) from a code object of its own: the
    frame dynamo captures under the skipped wrapper (torch.nn's frames, a Sequential's,
    are never captured). One code object per model, so each model's graphs are cached
    apart (dynamo's recompile limit counts per code object)."""
    def call(module, args: tuple, kwargs: dict):
        return module(*args, **kwargs)
    return types.FunctionType(call.__code__.replace(), globals(), "zero_ext_call_module")


try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _get, set_eval_frame as _set
except ImportError:
    _get = _set = None
