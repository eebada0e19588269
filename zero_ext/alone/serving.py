"""What a rank serves to one reading alone: one ShardServer thread per process group, answering
for this rank's pieces of every model zeroified on it."""
from __future__ import annotations

import io
import threading
import time
import weakref

import torch

from ..local_shard import LocalShard
from . import channel as wire

# Note [Shard server]
#   A rank reading alone (Note [Reading alone] in csrc/engine/away.h) asks each other rank's
#   server for its piece of stage-3 unit u's gather (UnitStore::unit_part), of bucket b (fp32
#   masters and per-element states, LocalShard), or of its whole tensors' states, as of the
#   step() calls the reader has finished: the server waits until its rank has finished as
#   many (none can finish more: its next step needs the reader). The pieces come from the
#   collective path's own code, so the reader assembles the same bits. A Python thread
#   reuses that code, and is asked only while its main thread waits in a collective, which
#   releases the GIL. On a GPU it copies on a stream of its own after the event its rank
#   recorded at the step's end, so no copy waits behind a collective waiting for the reader.

LINGER_S = 1800.0   # the longest a rank waits for a model, or serves at its end (torch's default timeout)
SERVERS: dict = {}  # id(process group) -> (group, its ShardServer)


class ServedModel:
    """One zeroified model at its server; its optimizer holds it (`serving`)."""

    def __init__(self, server, model_id: int, optimizer, device: torch.device):
        self.server = server
        self.model_id = model_id                  # the same on every rank
        self.optimizer = weakref.ref(optimizer)   # Note [No cycles through C++] (model.py)
        self.device = device
        self.held = None                          # the optimizer, while its end waits (Note [Model's end])
        self.ended = False                        # its end began on this rank
        self.failed = False                       # a read of it failed here: the ranks parted
        self.reads_at = -1                        # the steps done when this rank last read alone
        self.done = 0                             # step() calls finished on this rank
        self.event = None                         # CUDA: recorded at the end of the last step

    def step_done(self) -> None:
        """The end of a step() call on this rank: what it serves is as of this step now."""
        with self.server.cond:
            if self.device.type == "cuda":
                self.event = torch.cuda.current_stream(self.device).record_event()
            self.done += 1
            self.server.cond.notify_all()


class ShardServer:
    """One per process group: serves this rank's pieces of every model zeroified on it."""

    def __init__(self, side):
        self.channel = side              # a gloo group of the server's own
        self.rank = side.rank
        self.models: dict[int, ServedModel] = {}
        self.cond = threading.Condition()
        self.last_request = 0.0          # time.monotonic() of the last request served
        self.stream = None
        self.thread = threading.Thread(target=self._serve, name="zero_ext shard server", daemon=True)
        self.thread.start()

    def add(self, model_id: int, optimizer, device: torch.device) -> ServedModel:
        with self.cond:
            m = self.models[model_id] = ServedModel(self, model_id, optimizer, device)
            self.cond.notify_all()
        return m

    def _serve(self) -> None:
        work, head = self.channel.listen()
        while True:
            try:
                work.wait()   # no timeout: gloo closes the pair when a receive times out
            except RuntimeError:
                return        # the group was destroyed, or the job is ending
            src, req = work._source_rank(), head.clone()
            work, head = self.channel.listen()
            self.last_request = time.monotonic()
            try:
                payload, status = self._answer(req.tolist())
            except Exception as e:  # noqa: BLE001 - the reader raises it, naming this rank
                payload, status = torch.frombuffer(bytearray(f"{type(e).__name__}: {e}".encode()),
                                                   dtype=torch.uint8), wire.FAILED
            try:
                self.channel.answer(src, payload, status)
            except RuntimeError:
                return                         # the reader is gone: so is the job

    def _answer(self, req: list) -> tuple[torch.Tensor, int]:
        """(payload, status) for request `req`, once this rank has done the reader's steps."""
        op, model_id, steps, a, _, _ = req
        with self.cond:
            # a fast reader may ask before this rank's zeroify registered the model
            if not self.cond.wait_for(lambda: model_id in self.models, timeout=LINGER_S):
                raise RuntimeError(f"no model {model_id} here after {LINGER_S:.0f} s")
            m = self.models[model_id]
            opt = m.held if m.held is not None else m.optimizer()
            if opt is None:
                raise RuntimeError(f"rank {self.rank} has released this model (its optimizer was freed before every "
                                   f"rank came to the model's end)")
            self.cond.wait_for(lambda: m.done >= steps)
            if m.done > steps:
                return torch.tensor([m.done]).view(torch.uint8), wire.AHEAD
            event = m.event
        if m.device.type != "cuda":
            return piece(opt, op, a), wire.OK
        if self.stream is None:
            self.stream = torch.cuda.Stream(m.device)
        with torch.cuda.stream(self.stream):
            if event is not None:
                self.stream.wait_event(event)
            out = piece(opt, op, a)
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
        self.stream.synchronize()
        return host, wire.OK


def piece(opt, op: int, a: int) -> torch.Tensor:
    """This rank's piece `op`/`a` of the model of optimizer `opt`, as bytes (uint8)."""
    if op == wire.OP_UNIT:
        return wire.as_bytes(opt.engine.unit_part(a))
    if op == wire.OP_BUCKET:
        shard = LocalShard(opt)
        return wire.as_bytes([shard.full(pieces, a) for pieces in shard.kinds().values()])
    if op == wire.OP_WHOLE:
        buf = io.BytesIO()
        torch.save(opt.whole_states(), buf)
        return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    raise RuntimeError(f"unknown request {op}")
