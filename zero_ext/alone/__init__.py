"""Reading alone: a rank that evaluates, generates or checkpoints alone (`if rank == 0:`) is
served the pieces the other ranks hold (Note [Reading alone] in csrc/engine/away.h). channel.py
is the transport, serving.py what a rank serves, source.py where a call's pieces come from,
end.py the end of a model.
"""
from __future__ import annotations

import atexit

from .end import at_exit, join_ended, teardown
from .channel import SideChannel
from .serving import SERVERS, ShardServer
from .source import source

__all__ = ["join_ended", "serve", "source", "teardown"]


def serve(pg, optimizer, model_id: int, device):
    """zeroify: serve this model's pieces on `pg`; returns its ServedModel (the optimizer's `serving`)."""
    if not SERVERS:
        atexit.register(at_exit)
    known = SERVERS.get(id(pg))   # pg's ShardServer, made on first use (zeroify runs this on every rank)
    if known is None or known[0] is not pg:
        known = SERVERS[id(pg)] = (pg, ShardServer(SideChannel(pg)))
    return known[1].add(model_id, optimizer, device)
