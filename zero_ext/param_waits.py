"""Stages 1-2 with overlap_param_gather: each module waits for its own parameters' gathers.

Note [Gathers waited per module]
  After the step, stages 1-2 all-gather every bucket. With overlap_param_gather=True the
  engine launches the gathers last bucket first (the last holds the first layers), and a
  forward pre-hook on every module owning parameters waits only for their buckets
  (Engine::wait_param_buckets): later layers' gathers run while earlier ones compute, as
  FSDP2's per-module all-gathers. A parameter read without calling its module (a tied
  head) would see a gather in flight, so the first forward waits for everything and
  records which modules' hooks ran; the buckets of the others are waited for when each
  later forward starts. Anything else reading parameters waits for all gathers. A
  compiled forward (Note [Compiled wrapper] in zero_ext/compiled.py) waits for all at its
  start; the traced hooks do nothing.
"""
from __future__ import annotations

import weakref

from torch import nn


class ParamWaits:
    def __init__(self, wrapper, module: nn.Module, engine, params: list):
        self._engine = engine
        index = {id(p): i for i, p in enumerate(params)}
        bucket_of = list(engine.bucket_of_params)
        self._buckets_of: dict[int, list[int]] = {}   # id(module) -> buckets of its own parameters
        self._owner: dict[int, int] = {}             # engine parameter -> id of the module owning it
        for m in module.modules():
            own = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
            if not own:
                continue
            self._buckets_of[id(m)] = sorted({bucket_of[i] for i in own})
            for i in own:
                self._owner.setdefault(i, id(m))
            m.register_forward_pre_hook(self._hook(wrapper, self._buckets_of[id(m)], id(m)))
        self._bucket_of = bucket_of
        self._ran: set[int] | None = None     # modules whose hook ran in the first forward
        self.eager: list[int] | None = None   # buckets waited for when a forward starts
        self.whole = False                    # this forward waited for every gather (compiled)

    def _hook(self, wrapper, buckets: list, key: int):
        ref = weakref.ref(wrapper)   # Note [No cycles through C++] (model.py)

        def hook(module, args):
            w = ref()
            if w is None:
                return
            waits = w.param_waits
            if waits.whole:   # compiled: waited for at the start (dynamo traces this to nothing)
                return
            if waits._ran is not None:
                waits._ran.add(key)
            w.engine.wait_param_buckets(buckets)

        return hook

    def before_forward(self, whole: bool = False) -> None:
        """Launch pending gathers; on the first forward (or a compiled one: whole) wait for all."""
        self.whole = whole
        if whole:
            self._engine.flush_params()
        elif self.eager is None:
            self._engine.flush_params()
            self._ran = set()
        else:
            self._engine.flush_params(wait=False)
            if self.eager:
                self._engine.wait_param_buckets(self.eager)

    def after_forward(self) -> None:
        if self.eager is None and not self.whole and self._ran is not None:
            unseen = {i for i, m in self._owner.items() if m not in self._ran}
            self.eager = sorted({self._bucket_of[i] for i in unseen})
            self._ran = None
