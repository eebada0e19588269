"""The transport of reading alone: requests and replies on a SideChannel (zero_ext/comm.py),
a gloo group of the servers' own, beside the engine's group (which may be NCCL, and whose
collectives wait for the rank that is away).

A request: 6 integers (op, model id, the reader's step() calls done, a, 0, 0), tag
TAG_REQUEST, to the server. The reply, tag TAG_REPLY: 2 integers (status, bytes), then the
bytes: the piece (status 0), an error's message (1), or the server's step() calls done
when it has finished more than the reader (2: the state asked for is gone).
"""
from __future__ import annotations

import torch

TAG_REQUEST, TAG_REPLY = 7_340_001, 7_340_002
OP_UNIT, OP_BUCKET, OP_WHOLE = 1, 2, 3            # what a request asks for (zero_ext/alone/serving.py)
OK, FAILED, AHEAD = 0, 1, 2                        # a reply's status


def listen(channel):
    """(work, header): a receive of the next request from any rank."""
    head = torch.empty(6, dtype=torch.long)
    return channel.irecv(head, TAG_REQUEST), head


def answer(channel, r: int, payload: torch.Tensor, status: int) -> None:
    channel.send(torch.tensor([status, payload.numel()]), r, TAG_REPLY)
    channel.send(payload, r, TAG_REPLY)


def ask(channel, r: int, op: int, model_id: int, done: int, a: int) -> None:
    try:
        channel.send(torch.tensor([op, model_id, done, a, 0, 0]), r, TAG_REQUEST)
    except RuntimeError as e:
        raise RuntimeError(gone(r, e)) from e


def receive(channel, r: int) -> tuple[int, torch.Tensor]:
    """(status, payload bytes) of rank r's reply."""
    head = torch.empty(2, dtype=torch.long)
    _recv(channel, head, r)
    payload = torch.empty(int(head[1]), dtype=torch.uint8)
    _recv(channel, payload, r)
    return int(head[0]), payload


def _recv(channel, t: torch.Tensor, r: int) -> None:
    work = channel.irecv(t, TAG_REPLY, r)
    try:
        work.wait()
    except RuntimeError as e:
        raise RuntimeError(gone(r, e)) from e


def gone(r: int, error: Exception) -> str:
    return (f"zero_ext: rank {r} is gone: its process ended while this rank read alone from it (a crash, or an "
            f"exit that skips the wait at a clean exit, such as os._exit()), so its shard cannot be read; let every "
            f"rank's script end normally, or read on every rank ({error})")


def as_bytes(tensors: list) -> torch.Tensor:
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]) if tensors \
        else torch.empty(0, dtype=torch.uint8)
