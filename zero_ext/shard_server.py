"""shard_server.py — what a rank that reads alone is served by the others (Note [Reading
alone] in csrc/engine/away.h says when a rank is away; this file serves it).

Note [Shard server]
  Each process runs one server thread per process group zeroify used, on a gloo group of
  its own (a side channel: the engine's group may be NCCL, and its collectives wait for
  the rank that is away). It answers point-to-point requests from any rank:
    unit u       this rank's part of stage-3 unit u's gather (UnitStore::unit_part),
    bucket b     this rank's slice of bucket b of the fp32 masters and of every
                 per-element optimizer state (what consolidated_state_dict broadcasts),
    whole        the states of the whole tensors this rank owns (Muon, Adafactor),
  each "as of step k": the reader sends the number of step() calls it has finished, and
  the server waits until its own rank has finished as many. No rank can finish more,
  because the next step needs the reader's collectives. What the reader then assembles
  is what the collective path assembles from the same pieces, computed by the same code
  (LocalShard, unit_part = the gather's source), so the two agree bit for bit.
  Why a Python thread: every piece it serves is computed by the Python and C++ code the
  collective path uses, generic torch optimizers' states and whole-tensor states
  included, so nothing is computed twice; and a rank is only asked while its main thread
  waits in a collective or a barrier, which releases the GIL (the engine's waits do,
  torch's do), as gloo's send and receive do. On a GPU the server copies on a CUDA stream
  of its own, after an event its rank recorded at the end of the step, so no copy is
  queued behind a collective that waits for the reader.
  The end of a script: the other ranks leave the training loop, return from main() and
  exit while rank 0 still writes its final checkpoint. So a model's end is a meeting
  (teardown: ZeroOptimizer.__del__, or the clean exit): each rank serves until every rank
  has come to it, unless the ranks diverged, a collective or a read failed, or nobody has
  asked for QUIET_S. A rank reading alone marks in the store the step it reads as of; a
  rank at its model's end waits past ARRIVE_S only for such a reader of its last step, so
  a rank that leaves the job while the others train (an error) lets them fail after it.
  The wait runs on a thread of its own, holding the optimizer, so no rank stops at a
  model's end (__del__ may run on any thread, the server's own included); the clean exit
  joins it. The side channel is not registered with torch.distributed, so
  a script's destroy_process_group() before that leaves it serving.
  Requests and replies: a 6-integer header (op, engine, steps done, a, b, 0) with tag
  TAG_REQUEST to the server; the reply with TAG_REPLY: a 2-integer head (0 or 1 for an
  error, bytes) then the bytes (the payload, or the error's message).
"""
from __future__ import annotations

import atexit
import io
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

from .comm import SideChannel
from .whole import owned_states

TAG_REQUEST, TAG_REPLY = 7_340_001, 7_340_002
OP_UNIT, OP_BUCKET, OP_WHOLE = 1, 2, 3
_SERVERS: dict = {}                      # id(process group) -> (group, its ShardServer)


class _Served:
    """What a server knows of one zeroified model: its optimizer and step() calls done."""

    def __init__(self, optimizer, device: torch.device):
        self.optimizer = weakref.ref(optimizer)   # Note [No cycles through C++] (model.py)
        self.device = device
        self.held = None                          # the optimizer, while its end waits (teardown)
        self.failed = False                       # a read of it failed here: the ranks parted
        self.reads_at = -1                        # the steps done when this rank last read alone
        self.done = 0
        self.event = None                         # CUDA: recorded at the end of the last step


class ShardServer:
    """One per process group: serves this rank's pieces of every model zeroified on it."""

    def __init__(self, channel):
        self.channel = channel           # comm.SideChannel: a gloo group of the server's own
        self.rank = channel.rank
        self.engines: dict[int, _Served] = {}   # by model id (the same on every rank)
        self.cond = threading.Condition()
        self.last_request = 0.0          # time.monotonic() of the last request served
        self.stream = None
        self.thread = threading.Thread(target=self._serve, name="zero_ext shard server", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ the serving rank
    def add(self, engine_id: int, optimizer, device: torch.device) -> None:
        with self.cond:
            self.engines[engine_id] = _Served(optimizer, device)
            self.cond.notify_all()

    def step_done(self, engine_id: int) -> None:
        """The end of a step() call on this rank: what it serves is as of this step now."""
        with self.cond:
            e = self.engines[engine_id]
            if e.device.type == "cuda":
                e.event = torch.cuda.current_stream(e.device).record_event()
            e.done += 1
            self.cond.notify_all()

    def _serve(self) -> None:
        head = torch.empty(6, dtype=torch.long)
        work = self.channel.irecv(head, TAG_REQUEST)
        while True:
            try:
                work.wait()   # no timeout: gloo closes the pair when a receive times out
            except RuntimeError:
                return        # the group was destroyed, or the job is ending
            src, req = work._source_rank(), head.clone()
            work = self.channel.irecv(head, TAG_REQUEST)
            self.last_request = time.monotonic()
            try:
                payload, status = self._answer(req.tolist())
            except Exception as e:  # noqa: BLE001 - the reader raises it, naming this rank
                payload, status = torch.frombuffer(bytearray(f"{type(e).__name__}: {e}".encode()),
                                                   dtype=torch.uint8), 1
            try:
                self.channel.send(torch.tensor([status, payload.numel()]), src, TAG_REPLY)
                self.channel.send(payload, src, TAG_REPLY)
            except RuntimeError:
                return                         # the reader is gone: so is the job

    def _answer(self, req: list) -> tuple[torch.Tensor, int]:
        """(payload, status): 0 the piece; 2 this rank finished more step() calls than the
        reader (payload: how many): the state it asks for is gone."""
        op, engine_id, steps, a, _, _ = req
        with self.cond:
            # a fast reader may ask before this rank's zeroify registered the model
            if not self.cond.wait_for(lambda: engine_id in self.engines, timeout=LINGER_S):
                raise RuntimeError(f"no model {engine_id} here after {LINGER_S:.0f} s")
            e = self.engines[engine_id]
            opt = e.held if e.held is not None else e.optimizer()
            if opt is None:
                raise RuntimeError(f"rank {self.rank} has released this model (its optimizer was freed before every "
                                   f"rank came to the model's end)")
            if not self.cond.wait_for(lambda: e.done >= steps, timeout=None):
                raise RuntimeError("interrupted")
            if e.done > steps:
                return torch.tensor([e.done]).view(torch.uint8), 2
            event = e.event
        if e.device.type == "cuda":
            if self.stream is None:
                self.stream = torch.cuda.Stream(e.device)
            with torch.cuda.stream(self.stream):
                if event is not None:
                    self.stream.wait_event(event)
                out = self._piece(opt, op, a)
                host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
                host.copy_(out, non_blocking=True)
            self.stream.synchronize()
            return host, 0
        return self._piece(opt, op, a), 0

    def _piece(self, opt, op: int, a: int) -> torch.Tensor:
        """This rank's piece, as bytes (uint8)."""
        if op == OP_UNIT:
            return _as_bytes(opt._engine.unit_part(a))
        if op == OP_BUCKET:
            shard = _local_shard(opt)
            return _as_bytes([shard.full(pieces, a) for pieces in _kinds(shard).values()])
        if op == OP_WHOLE:
            buf = io.BytesIO()
            torch.save(owned_states(opt), buf)
            return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        raise RuntimeError(f"unknown request {op}")

    # ------------------------------------------------------------------ the reading rank
    def ask(self, engine_id: int, r: int, op: int, a: int = 0) -> torch.Tensor:
        """Rank r's piece `op`/`a` of model `engine_id` as of this rank's step() calls (bytes)."""
        self.request(engine_id, r, op, a)
        return self.reply(engine_id, r)

    def request(self, engine_id: int, r: int, op: int, a: int = 0) -> None:
        """Ask rank r for a piece; reply() takes it (asking several ranks first lets them work at once)."""
        e = self.engines[engine_id]
        if e.reads_at != e.done:   # the ranks that end this model wait for a reader (_wait_for_all)
            self.channel.store.set(f"away/{engine_id}/{self.rank}", str(e.done))
            e.reads_at = e.done
        try:
            self.channel.send(torch.tensor([op, engine_id, e.done, a, 0, 0]), r, TAG_REQUEST)
        except RuntimeError as ex:
            raise RuntimeError(_gone(r, ex)) from ex

    def reply(self, engine_id: int, r: int) -> torch.Tensor:
        e = self.engines[engine_id]
        e.failed = True   # until the reply is read whole and is no error
        head = torch.empty(2, dtype=torch.long)
        self._recv(head, r)
        payload = torch.empty(int(head[1]), dtype=torch.uint8)
        self._recv(payload, r)
        e.failed = int(head[0]) != 0
        if int(head[0]) == 2:   # rank r stepped without this rank: this rank trained alone
            theirs = int(payload.view(torch.long)[0])
            raise RuntimeError(
                f"zero_ext: collective sequence diverged: rank {self.rank} reads alone as of {e.done} step() calls, "
                f"but rank {r} has finished {theirs}: a backward() or step() that rank {self.rank} ran alone took "
                f"part in the other ranks' training. A rank may evaluate, generate or call state_dict() alone, but "
                f"not train alone: run backward() and step() on every rank, then restart from the last checkpoint.")
        if int(head[0]) != 0:
            raise RuntimeError(f"zero_ext: rank {r} could not serve this rank, which reads alone: "
                               f"{bytes(payload.tolist()).decode(errors='replace')}")
        return payload

    def _recv(self, t: torch.Tensor, r: int) -> None:
        work = self.channel.irecv(t, TAG_REPLY, r)
        try:
            work.wait()
        except RuntimeError as e:
            raise RuntimeError(_gone(r, e)) from e


def _gone(r: int, error: Exception) -> str:
    return (f"zero_ext: rank {r} is gone: its process ended while this rank read alone from it (a crash, or an "
            f"exit that skips the wait at a clean exit, such as os._exit()), so its shard cannot be read; let every "
            f"rank's script end normally, or read on every rank ({error})")


def _as_bytes(tensors: list) -> torch.Tensor:
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]) if tensors \
        else torch.empty(0, dtype=torch.uint8)


def _local_shard(opt):
    from .checkpoint.entries import LocalShard
    return LocalShard(opt)


def _kinds(shard) -> dict:
    """name -> per-bucket pieces, in the order both sides use: the masters, then each state."""
    states = shard.states()
    return {"model": shard.masters, **{f"optim/{s}": states[s] for s in sorted(states)}}


# ---------------------------------------------------------------------- the end of a model
LINGER_S = 1800.0   # the longest a rank serves at a model's end (the process group's default timeout)
QUIET_S = 60.0      # ... or until no rank has asked it anything for this long
ARRIVE_S = 20.0     # ... or, when no rank reads alone as of its last step, this long
_ENDING: list = []  # the threads that wait at the end of a dropped model (teardown)


def teardown(optimizer) -> None:
    """A model's end on this rank (ZeroOptimizer.__del__, or the script's clean exit): serve
    until every rank has come to the same model's end, so that a rank that reads alone at
    the end of a script (`if rank == 0: torch.save(...)` after the loop, while the others
    return from main() and exit) still finds their pieces (Note [Shard server]). Not when
    the ranks diverged, a collective failed or a read from a server did (a peer is gone or
    the ranks parted: nobody will come), nor at interpreter shutdown; and at most QUIET_S
    after the last request this rank served.
    A thread of its own waits, holding the optimizer (the garbage collector clears weak
    references before it calls __del__): the rank goes on at once (a script that builds
    one model after another, a collection that runs __del__ on any thread, the server's
    own included), and its clean exit joins that thread."""
    entry = optimizer._server
    if entry is None or optimizer._torn_down or sys.is_finalizing():
        return
    optimizer._torn_down = True
    engine = optimizer._engine
    if engine is None or engine.sequence_diverged:
        return
    server, engine_id = entry
    with server.cond:
        e = server.engines[engine_id]
        if e.failed:
            return
        e.held = optimizer
    t = threading.Thread(target=_wait_for_all, args=(server, engine_id), daemon=True, name="zero_ext model end")
    _ENDING.append(t)
    t.start()


def join_ended() -> None:
    """Wait until every model this process dropped has ended (its optimizer released)."""
    while _ENDING:
        _ENDING.pop(0).join()


def _wait_for_all(server, engine_id: int) -> None:
    """Until every rank is at this model's end; or, after ARRIVE_S, as long as a rank reads
    alone as of this rank's last step (a reader at the end of the script) and asks within
    QUIET_S. A rank that leaves the job while the others train waits ARRIVE_S: nobody reads."""
    store, world = server.channel.store, server.channel.world
    done = server.engines[engine_id].done
    readers = [f"away/{engine_id}/{q}" for q in range(world) if q != server.rank]
    key = f"gone/{engine_id}"
    store.add(key, 1)
    start, told = time.monotonic(), False
    try:
        while int(store.add(key, 0)) < world:
            now = time.monotonic()
            if now - start > LINGER_S or now - max(start, server.last_request) > QUIET_S:
                return
            if now - start > ARRIVE_S and not any(
                    store.check([k]) and int(store.get(k)) == done for k in readers):
                return
            if not told and now - start > 10:
                print(f"zero_ext: rank {server.rank} waits at the end of its model until every rank is there (a "
                      f"rank reading alone, such as a rank-0 checkpoint, reads this rank's shard)",
                      file=sys.stderr, flush=True)
                told = True
            time.sleep(0.05)
    finally:
        with server.cond:
            e = server.engines[engine_id]
            held, e.held = e.held, None
        del held   # the optimizer may go now (outside the lock: its engine may wait for its gathers)


def _at_exit() -> None:
    """The script's clean exit: the end of every model still alive. A rank that ends with
    an unhandled exception leaves at once: its peers are told by their collectives."""
    if getattr(sys, "last_value", None) is not None:
        return
    for _, server in list(_SERVERS.values()):
        for e in list(server.engines.values()):
            opt = e.optimizer()
            if opt is not None:
                teardown(opt)
    join_ended()


# ---------------------------------------------------------------------- the reader's side
def start(pg, optimizer, engine_id: int, device: torch.device) -> None:
    """zeroify: serve this model's pieces (one server thread per process group)."""
    known = _SERVERS.get(id(pg))
    if known is None or known[0] is not pg:
        known = _SERVERS[id(pg)] = (pg, ShardServer(SideChannel(pg)))
        if len(_SERVERS) == 1:
            atexit.register(_at_exit)
    server = known[1]
    server.add(engine_id, optimizer, device)
    optimizer._server = (server, engine_id)


def check_fits(nbytes: int, what: str) -> None:
    """A rank reading alone assembles `what` (nbytes) in its host memory: refuse before
    fetching anything when that would not fit."""
    from .changes import ZeroUsageError
    from .offload import available_host_bytes
    have = available_host_bytes()
    if have is not None and nbytes > have:
        raise ZeroUsageError(
            f"zero_ext: {what} on this rank alone would assemble {nbytes / 2**30:.2f} GiB in its host memory, "
            f"{have / 2**30:.2f} GiB are available; checkpoint with zero_ext.save(path, model, optimizer) on every "
            f"rank instead (each rank writes its shard; `python -m zero_ext.consolidate` makes one file of it "
            f"offline)")


def gather_unit(optimizer, u: int, wait: bool = True) -> bool:
    """Stage 3: engine.gather_unit, or, on a rank that reads alone (engine.sequence_away),
    the unit made whole from every rank's part at once. Returns whether it was prefetched."""
    engine = optimizer._engine
    if not engine.sequence_away:
        return engine.gather_unit(u, wait)
    if not engine.unit_gathered(u):
        _served_unit(optimizer, u)
    return False


def _served_unit(optimizer, u: int) -> None:
    """Unit u made whole from every rank's part (Note [Shard server])."""
    server, engine_id = optimizer._server
    engine = optimizer._engine
    if optimizer._config.param_quant is not None:
        raise RuntimeError("zero_ext: a rank that reads alone is served exact parameters, but this model gathers "
                           "them quantized (param_quant), so it would compute with other values than the others; "
                           "read on every rank, or zeroify without param_quant")
    others = [r for r in range(engine.world_size) if r != engine.rank]
    for r in others:
        server.request(engine_id, r, OP_UNIT, u)
    own = engine.unit_part(u)
    parts = []
    for r in range(engine.world_size):
        if r == engine.rank:
            parts.append(own)
            continue
        raw, got, at = server.reply(engine_id, r), [], 0
        for t in own:
            n = t.numel() * t.element_size()
            got.append(raw[at:at + n].view(t.dtype).to(t.device))
            at += n
        parts.append(got)
    engine.install_unit(u, parts)


def bucket(optimizer, shard, r: int, b: int) -> dict:
    """Rank r's slice of bucket b of the masters and of each state ("model", "optim/<state>"),
    fp32, as this rank's LocalShard `shard` names them."""
    server, engine_id = optimizer._server
    raw = server.ask(engine_id, r, OP_BUCKET, b).view(torch.float32)
    names = list(_kinds(shard))
    n = raw.numel() // len(names)
    return {k: raw[i * n:(i + 1) * n] for i, k in enumerate(names)}


def whole(optimizer, r: int) -> dict:
    """The whole-tensor states rank r owns, by engine parameter index (whole.owned_states)."""
    server, engine_id = optimizer._server
    raw = server.ask(engine_id, r, OP_WHOLE)
    return torch.load(io.BytesIO(raw.numpy().tobytes()), weights_only=False)
