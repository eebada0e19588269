"""What torch.compile traces of a zeroified model (Note [Compiled wrapper]).

Note [Compiled wrapper]
  `torch.compile(model, fullgraph=True)` must trace the user's module whole, while the
  wrapper's own work (ZeroModel.forward) calls the C++ engine, which dynamo cannot trace.
  As DDP's, that work runs around the module's forward: dynamo skips the wrapper's frame,
  whose work turns the frame hook off (pause) and back on (resume) to call the module
  from a frame of zero_ext's own, one code object per model (module_caller): that frame
  is captured, the module compiled under it as one graph. In eager it costs a lookup.
  The gradient-ready hooks run in autograd's engine after the compiled backward, as
  compiled DDP's: they break no graph. Limits: a function compiled around the model
  (`torch.compile(train_step)`) inlines the skipped frame, a graph break; stages 1-2's
  per-module parameter waits (zero_ext/param_waits.py) wait for everything at the start.

Note [Stage 3 compiled whole]
  Stage 3's unit hooks (model.py's _UnitHooks) run inside the user's module, so under
  compile they are traced. By default (compile_units="per_unit") they call the engine and
  break the graph at each unit, keeping stage 3's memory. With compile_units="whole" they
  return at once while `compiled` is set (traced to nothing). Before the compiled call the
  wrapper gathers every unit; the engine releases each as its last gradient is staged, as
  in eager, and a forward no backward follows releases every unit after it. The cost: the
  whole model gathered during a step (stage 2's parameter memory), gathers not overlapped,
  and a rank reading alone is not served. The next step: Note [Stage 3 collectives in the graph].

Note [Stage 3 collectives in the graph]
  Stage 3 with its memory under compile (issue 54): a prototype, off unless UNITS_IN_GRAPH
  (zero_ext/unit_ops.py; tests/test_compile_fullgraph.py). Compiled, each unit's module runs
  unit_ops._unit_forward: zero_ext::unit_gather returns a flat copy of the unit at its first
  use, the module reads its parameters as views of it, a selective checkpoint makes the
  gather must-recompute (backward gathers again), and its autograd formula
  zero_ext::unit_reduce (an ordered effect) hands the gradient to the engine. Each gather
  starts the engine's async gather of the next unit(s), which overlaps this unit's compute;
  a UnitSchedule of its own learns the graph's order (Note [Stage 3 unit sequence]). Data
  orders unit_gather, and every rank compiles the same graph, so the collectives match.
  Measured, GPT at 2 ranks: no break, DDP's losses, 1.02x eager's gathered bytes
  (bench_units_in_graph.py); a step 1.42x compiled DDP's, 1.16x eager's (bench_compile.py).
  Not yet: C++ operators, gathering into the flat, sharded frozen parameters, a unit called twice.
"""
from __future__ import annotations

import itertools
import types


def skip_frame(fn: types.FunctionType) -> None:
    """Mark fn's frame to be run, not traced, by dynamo, without importing torch._dynamo (2 s);
    nothing where this torch lacks the hook (the wrapper then breaks the graph)."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))


def pause():
    """Turn torch.compile's frame hook off; returns the hook to resume, None in eager."""
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
    """A function calling module(*args, **kwargs) from a code object of its own, one per model so
    that dynamo caches each model's graphs apart."""
    def call(module, args: tuple, kwargs: dict):
        return module(*args, **kwargs)
    name = f"call_{next(_models)}"
    return types.FunctionType(call.__code__.replace(co_name=name, co_qualname=name), globals(), name)


_models = itertools.count()
# Note [Stage 3 collectives in the graph]: the prototype (zero_ext/unit_ops.py), off by default
UNITS_IN_GRAPH = False


try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _get, set_eval_frame as _set
except ImportError:
    _get = _set = None
