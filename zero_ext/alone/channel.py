"""The transport of reading alone: requests and replies on a gloo group of the servers' own,
beside the engine's group (which may be NCCL, and whose collectives wait for the away rank).

A request (tag TAG_REQUEST): 6 integers (op, model id, the reader's step() calls done, a, 0, 0).
A reply (TAG_REPLY): 2 integers (status, bytes), then the bytes: the piece (OK), an error's
message (FAILED), or the server's step() calls done when ahead of the reader (AHEAD).
"""
from __future__ import annotations

import datetime
import itertools

import torch
import torch.distributed as dist

TAG_REQUEST, TAG_REPLY = 7_340_001, 7_340_002
OP_UNIT, OP_BUCKET, OP_WHOLE = 1, 2, 3            # what a request asks for (zero_ext/alone/serving.py)
OK, FAILED, AHEAD = 0, 1, 2                        # a reply's status


class SideChannel:
    """Point-to-point messages on a gloo group of its own, unregistered so that a script's
    destroy_process_group() leaves it serving; a long timeout, as a timed-out receive closes gloo's pair."""

    _made = itertools.count()   # every rank makes its side channels in the same order

    def __init__(self, pg):
        self.world, self.rank = pg.size(), pg.rank()
        store = dist.distributed_c10d._world.pg_map[pg][1]
        self.store = dist.PrefixStore(f"zero_ext/side/{next(SideChannel._made)}/", store)
        self.group = dist.ProcessGroupGloo(self.store, self.rank, self.world, datetime.timedelta(days=365))

    def listen(self):
        """(work, header): a receive of the next request from any rank (work._source_rank())."""
        head = torch.empty(6, dtype=torch.long)
        return self.group.recv_anysource([head], TAG_REQUEST), head

    def answer(self, r: int, payload: torch.Tensor, status: int) -> None:
        self.group.send([torch.tensor([status, payload.numel()])], r, TAG_REPLY).wait()
        self.group.send([payload], r, TAG_REPLY).wait()

    def ask(self, r: int, op: int, model_id: int, done: int, a: int) -> None:
        try:
            self.group.send([torch.tensor([op, model_id, done, a, 0, 0])], r, TAG_REQUEST).wait()
        except RuntimeError as e:
            raise RuntimeError(gone(r, e)) from e

    def receive(self, r: int) -> tuple[int, torch.Tensor]:
        """(status, payload bytes) of rank r's reply."""
        head = torch.empty(2, dtype=torch.long)
        self._recv(head, r)
        payload = torch.empty(int(head[1]), dtype=torch.uint8)
        self._recv(payload, r)
        return int(head[0]), payload

    def _recv(self, t: torch.Tensor, r: int) -> None:
        try:
            self.group.recv([t], r, TAG_REPLY).wait()
        except RuntimeError as e:
            raise RuntimeError(gone(r, e)) from e


def gone(r: int, error: Exception) -> str:
    return (f"zero_ext: rank {r} is gone: its process ended while this rank read alone from it (a crash, or an "
            f"exit that skips the wait at a clean exit, such as os._exit()), so its shard cannot be read; let every "
            f"rank's script end normally, or read on every rank ({error})")


def as_bytes(tensors: list) -> torch.Tensor:
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]) if tensors \
        else torch.empty(0, dtype=torch.uint8)
