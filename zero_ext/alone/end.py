"""The end of a model on a rank that serves: it keeps serving until every rank is there."""
from __future__ import annotations

import sys
import threading
import time

from .serving import LINGER_S, SERVERS

# Note [Model's end]
#   Ranks may exit while rank 0 still writes its final checkpoint, reading their shards
#   alone. So a model's end (ZeroOptimizer.__del__, or the clean exit) is a meeting: each
#   rank serves until every rank has come. No wait when the ranks diverged, a collective or
#   a read of this model failed (nobody will come), or at interpreter shutdown. It stops
#   after QUIET_S without a request, and after ARRIVE_S unless a rank reads alone as of its
#   last step (readers mark that step in the store), so a rank leaving mid-training lets the
#   others fail after it. The wait runs on a thread of its own holding the optimizer (weak
#   references are cleared before __del__, which may run on any thread); the clean exit
#   joins those threads.

QUIET_S = 60.0      # a model's end stops after this long without a request
ARRIVE_S = 20.0     # ... or after this long, when no rank reads alone as of its last step
_ENDING: list = []  # the threads that wait at the end of a dropped model


def teardown(optimizer) -> None:
    """This model's end on this rank (Note [Model's end])."""
    served = optimizer.serving
    if served is None or served.ended or sys.is_finalizing():
        return
    served.ended = True
    engine = optimizer.engine
    if engine is None or engine.sequence_diverged:
        return
    with served.server.cond:
        if served.failed:
            return
        served.held = optimizer
    t = threading.Thread(target=_wait_for_all, args=(served,), daemon=True, name="zero_ext model end")
    _ENDING.append(t)
    t.start()


def join_ended() -> None:
    """Wait until every model this process dropped has ended (its optimizer released)."""
    while _ENDING:
        _ENDING.pop(0).join()


def _wait_for_all(served) -> None:
    """Until every rank is at this model's end, or a reason to stop (Note [Model's end])."""
    server = served.server
    store, world = server.channel.store, server.channel.world
    readers = [f"away/{served.model_id}/{q}" for q in range(world) if q != server.rank]
    key = f"gone/{served.model_id}"
    store.add(key, 1)
    start, told = time.monotonic(), False
    try:
        while int(store.add(key, 0)) < world:
            now = time.monotonic()
            if now - start > LINGER_S or now - max(start, server.last_request) > QUIET_S:
                return
            if now - start > ARRIVE_S and not any(
                    store.check([k]) and int(store.get(k)) == served.done for k in readers):
                return
            if not told and now - start > 10:
                print(f"zero_ext: rank {server.rank} waits at the end of its model until every rank is there (a "
                      f"rank reading alone, such as a rank-0 checkpoint, reads this rank's shard)",
                      file=sys.stderr, flush=True)
                told = True
            time.sleep(0.05)
    finally:
        with server.cond:
            held, served.held = served.held, None
        del held   # the optimizer may go now (outside the lock: its engine may wait for its gathers)


def at_exit() -> None:
    """The script's clean exit: every live model's end (not after an unhandled exception)."""
    if getattr(sys, "last_value", None) is not None:
        return
    for _, server in list(SERVERS.values()):
        for served in list(server.models.values()):
            opt = served.optimizer()
            if opt is not None:
                teardown(opt)
    join_ended()
