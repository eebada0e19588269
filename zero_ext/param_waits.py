"""param_waits.py — stages 1-2 with overlap_param_gather: each module waits for its own
parameters' gathers, so the post-step all-gather overlaps the next forward.

Note [Gathers waited per module]
  After the optimizer step, stages 1-2 all-gather every bucket of updated parameters.
  Waiting for all of them when the next forward starts exposes the whole gather: the
  forward's first layer needs one bucket, not all. With overlap_param_gather=True the
  engine launches the gathers last bucket first (buckets fill in gradient order, so the
  last bucket holds the first layers), and a forward pre-hook on every module that owns
  parameters waits only for the buckets holding them (Engine::wait_param_buckets): the
  gathers of later layers keep running while earlier layers compute, as FSDP2 overlaps
  its per-module all-gathers and Megatron's distributed optimizer its parameter gather.

  A parameter read without calling its module (a tied head used as
  F.linear(x, self.wte.weight) before self.wte runs) would see a gather in flight, so
  the first forward waits for everything, as before, and records which modules' hooks
  ran; the buckets of parameters whose module did not run are waited for when every
  later forward starts. Anything else that reads parameters (state_dict, the
  optimizer step, gathered_parameters) waits for all gathers first, as before. A model
  with a parameter cut across buckets (Note [Cut parameters]) waits for all of them at
  the first module. tests/test_overlap.py measures the overlap under a known delay.
  Under torch.compile the forward is one graph (Note [Compiled wrapper] in
  zero_ext/compiled.py): it waits for every gather when it starts, and the hooks,
  traced into the graph, do nothing.
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
        """Launch pending gathers; on the first forward (or a compiled one: whole) wait for
        all, and start recording on the first eager one."""
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
