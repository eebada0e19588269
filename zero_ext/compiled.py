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
  start under compile.
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
