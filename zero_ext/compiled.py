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
  costs a lookup of it (tens of ns) and calls the module as before. The gradient-ready
  hooks (AccumulateGrad post hooks) run in autograd's engine after the compiled
  backward, as compiled DDP's do: no frame dynamo traces holds them, so they break no
  graph (torch 2.13: the counters show none, and the gradients are reduced).
  Limits: a function compiled around the model (`torch.compile(train_step)` calling
  model(x)) inlines the wrapper's frame, and a skipped frame inlined is a graph break
  there; compile the model. Stages 1-2's per-module parameter waits
  (overlap_param_gather, zero_ext/param_waits.py) wait for everything at the forward's
  start under compile. Stage 3: Note [Stage 3 compiled whole].

Note [Stage 3 compiled whole]
  Stage 3's unit hooks (model.py's _UnitHooks) run inside the user's module, so under
  compile they are traced. By default (compile_units="per_unit") they call the engine
  and break the graph at each unit, keeping stage 3's memory. With compile_units="whole"
  each returns at once while `compiled` is set (dynamo guards on the flag and traces
  them to nothing; eager pays one attribute read). The wrapper
  sets it around the compiled call and, before it, gathers every unit (so the graph
  reads whole parameters, as in eager, and its autograd node records their shapes);
  the engine releases each unit as its last gradient is staged, as in eager, and a
  forward no backward follows releases every unit after it. What this costs: during
  a compiled step the whole model is gathered at once (stage 2's parameter memory,
  sharded gradients and optimizer states kept), the gathers do not overlap the
  forward, and a rank reading alone is not served under compile. The next step is
  Note [Stage 3 collectives in the graph].

Note [Stage 3 collectives in the graph]
  Stage 3 with its memory under compile (issue 54): a Python prototype, off by default
  (UNITS_IN_GRAPH; zero_ext/unit_ops.py; tests/test_compile_fullgraph.py). While compiled, each
  unit's module runs unit_ops._unit_forward: zero_ext::unit_gather(model, unit, anchor, after)
  returns a flat copy of the unit at its first use (`after`: the unit's input), the module reads
  its parameters as views of it, a selective checkpoint tags the gather must-recompute (backward
  gathers again; the flat is not saved), and its autograd formula zero_ext::unit_reduce (an
  ordered effect) hands the gradient to the engine. Prefetch, in both passes: each gather, its unit copied out,
  starts the engine's async gather of the next (source.units: small ones together), which the next
  gather waits for: it overlaps this unit's compute. A UnitSchedule of its own learns the graph's order
  (Note [Stage 3 unit sequence]); not overlapped: each forward's first gather and backward's first.
  unit_gather is no effect (torch 2.13's partitioner cannot recompute one): data orders it, and
  every rank compiles the same graph, so runs the same collectives in the same order. Measured,
  GPT 6x384 at 2 ranks: no break, DDP's losses, 1.02x eager's gathered bytes at most (flats and
  engine: bench_units_in_graph.py); time in unit_gather halved, a step 1.42x compiled DDP's,
  1.16x eager's against 1.45x, 1.19x unprefetched (bench_compile.py, 2 shared cores). Not yet:
  C++ operators, gathering into the flat, sharded frozen parameters, a unit called twice.
"""
from __future__ import annotations

import itertools
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
    apart (dynamo's recompile limit counts per code object, what it learns of changing
    sizes per code name)."""
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
