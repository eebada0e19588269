"""Where a call's pieces come from, decided once per call: source(away) is COLLECTIVE (every
rank is here) or SERVED (this rank reads alone from the others' servers, Note [Shard server]),
with the same methods, so callers do not branch. `away`: Engine.sequence_mark's answer.
"""
from __future__ import annotations

import io

import torch

from .. import offload
from ..changes import ZeroUsageError
from . import channel as wire


class Collective:
    """Every rank makes the same call: each piece comes by a collective."""

    reads_alone = False

    def fits(self, nbytes: int, what: str) -> None:
        """Every rank holds its share: nothing to refuse."""

    def buffers(self, engine, tensors: list) -> None:
        engine.broadcast_tensors(tensors, 0)      # rank 0's buffers, as DDP's forward

    def unit(self, opt, u: int, wait: bool = True) -> bool:
        """Stage 3: make unit u whole; whether it had been prefetched."""
        return opt.engine.gather_unit(u, wait)

    def units(self, opt, launch: list, together: bool) -> None:
        """Prefetch these units (together: in one collective, Note [Coalesced unit gathers])."""
        if together:
            opt.engine.gather_units(launch)
        else:
            for u in launch:
                opt.engine.gather_unit(u, False)

    def bucket_slices(self, opt, own: dict, b: int, to: int | None, buf: torch.Tensor):
        """Yields (kind, rank r, r's slice of bucket b) on rank `to` (None: every rank), own[kind]
        being this rank's; one broadcast per rank and kind, one slice held at a time."""
        rank = opt.engine.rank
        for kind, mine in own.items():
            for r in range(opt.engine.partitions):
                if r != to:
                    got = opt.comm.broadcast_from(mine if rank == r else None, buf[:mine.numel()], r)
                    if to is None or rank == to:
                        yield kind, r, got
                elif rank == to:                   # the receiving rank has its own
                    yield kind, r, mine

    def whole_states(self, opt, mine: dict, to: int | None) -> dict:
        """Every rank's whole-tensor states by engine index, on rank `to` ({} elsewhere)."""
        return {i: st for d in (opt.comm.gather_object(mine, dst=to) or []) for i, st in d.items()}


class Served(Collective):
    """This rank reads alone: each piece is asked of its owner's shard server."""

    reads_alone = True    # nothing it reads can change until it is back (model.py keeps units)

    def fits(self, nbytes: int, what: str) -> None:
        """Refuse, before fetching anything, to assemble `what` where host memory is short."""
        have = offload.available_host_bytes()
        if have is not None and nbytes > have:
            raise ZeroUsageError(
                f"zero_ext: {what} on this rank alone would assemble {nbytes / 2**30:.2f} GiB in its host memory, "
                f"{have / 2**30:.2f} GiB are available; checkpoint with zero_ext.save(path, model, optimizer) on "
                f"every rank instead (each rank writes its shard; `python -m zero_ext.consolidate` makes one file of "
                f"it offline)")

    def buffers(self, engine, tensors: list) -> None:
        """A rank reading alone keeps the buffers it has."""

    def unit(self, opt, u: int, wait: bool = True) -> bool:
        engine = opt.engine
        if engine.unit_gathered(u):
            return False
        if opt.config.param_quant is not None:
            raise RuntimeError("zero_ext: a rank that reads alone is served exact parameters, but this model gathers "
                               "them quantized (param_quant), so it would compute with other values than the "
                               "others; read on every rank, or zeroify without param_quant")
        for r in _others(engine):                  # every rank works on its part at once
            _request(opt.serving, r, wire.OP_UNIT, u)
        own = engine.unit_part(u)
        parts, sizes = [own] * engine.world_size, [t.numel() * t.element_size() for t in own]
        for r in _others(engine):
            parts[r] = [b.view(t.dtype).to(t.device) for b, t in zip(_reply(opt.serving, r).split(sizes), own)]
        engine.install_unit(u, parts)
        return False

    def units(self, opt, launch: list, together: bool) -> None:
        for u in launch:
            self.unit(opt, u)

    def bucket_slices(self, opt, own: dict, b: int, to: int | None, buf: torch.Tensor):
        sent = ["model"] + sorted(k for k in own if k != "model")   # every kind, in LocalShard.kinds() order
        theirs = {}
        for r in _others(opt.engine):
            raw = _ask(opt.serving, r, wire.OP_BUCKET, b).view(torch.float32)
            theirs[r] = dict(zip(sent, raw.view(len(sent), -1)))
        for kind, mine in own.items():
            for r in range(opt.engine.partitions):
                yield kind, r, theirs[r][kind] if r in theirs else mine

    def whole_states(self, opt, mine: dict, to: int | None) -> dict:
        out = dict(mine)
        for r in _others(opt.engine):
            raw = _ask(opt.serving, r, wire.OP_WHOLE)
            out.update(torch.load(io.BytesIO(raw.numpy().tobytes()), weights_only=False))
        return out


COLLECTIVE, SERVED = Collective(), Served()


def source(away: bool) -> Collective:
    """The pieces of a call that Engine.sequence_mark settled: SERVED when it answered away."""
    return SERVED if away else COLLECTIVE


def _others(engine) -> list:
    return [r for r in range(engine.world_size) if r != engine.rank]


def _ask(served, r: int, op: int, a: int = 0) -> torch.Tensor:
    _request(served, r, op, a)
    return _reply(served, r)


def _request(served, r: int, op: int, a: int = 0) -> None:
    """Ask rank r for a piece as of this rank's step() calls, marked in the store (Note [Model's end])."""
    server = served.server
    if served.reads_at != served.done:
        server.channel.store.set(f"away/{served.model_id}/{server.rank}", str(served.done))
        served.reads_at = served.done
    server.channel.ask(r, op, served.model_id, served.done, a)


def _reply(served, r: int) -> torch.Tensor:
    rank = served.server.rank
    served.failed = True   # until the reply is read whole and is no error
    status, payload = served.server.channel.receive(r)
    served.failed = status != wire.OK
    if status == wire.AHEAD:   # rank r stepped without this rank: this rank trained alone
        raise RuntimeError(
            f"zero_ext: collective sequence diverged: rank {rank} reads alone as of {served.done} step() calls, "
            f"but rank {r} has finished {int(payload.view(torch.long)[0])}: a backward() or step() that rank {rank} "
            f"ran alone took part in the other ranks' training. A rank may evaluate, generate or call state_dict() "
            f"alone, but not train alone: run backward() and step() on every rank, then restart from the last "
            f"checkpoint.")
    if status != wire.OK:
        raise RuntimeError(f"zero_ext: rank {r} could not serve this rank, which reads alone: "
                           f"{bytes(payload.tolist()).decode(errors='replace')}")
    return payload
