"""Run a function on N real processes joined by a gloo process group.

    results = run_world(fn, world_size, *args, timeout_s=300)
    results = run_world(fn, world_size, *args, reuse=True)    # the module's standing world

fn(rank, world_size, *args) runs in each process after init_process_group('gloo')
(FileStore rendezvous in a temp dir, so no ports); its return value comes back
per rank. A worker's exception fails the call with the worker's traceback, and a
run that outlives timeout_s is killed, so no test can hang.

backend= picks another init_process_group backend: "cuda:gloo" (a CUDA-only gloo
group, so several ranks can share one GPU: NCCL refuses two ranks on one device)
or "nccl". With a backend that carries CUDA tensors each rank first makes
cuda:(rank % device count) its current device, so on one GPU every rank is on cuda:0.

Note [Standing worlds]
  Starting a world costs each rank a fresh interpreter, torch's import and a
  rendezvous: seconds per call on a busy 2-core machine, most of the time of a
  short test. With reuse=True the call runs on a standing world of that size
  instead: processes started once per test module (conftest.py ends them when the
  module is done) that keep their gloo group and run one function after another.
  Between two functions every rank collects garbage, meets the others at a
  barrier, and puts back what a fresh process would have: the environment,
  the working directory, torch's default RNG seed, one intra-op thread, fp32 as
  the default dtype. What it cannot put back is the reason a call stays fresh
  (the default): a function that expects errors, kills or hangs a rank, leaves
  collectives unmatched, makes or destroys the default group, measures resident
  memory (freed pages stay in the process), changes other process-wide state
  (integrations' singletons), or uses another backend. A failure or timeout in a
  standing world ends it; the next call starts a new one.
  The process groups a function made (zeroify's side group, node groups) are left
  alive, not destroyed: torch names a group made with use_local_synchronization=True
  after its ranks and the number of groups that exist, so a group made after one
  was destroyed takes that one's name and finds its stale addresses in the store
  (gloo then connects to a closed port, or hangs, depending on which rank is first).

Note [Forked ranks]
  Ranks of gloo worlds (fresh and standing) start from multiprocessing's fork server,
  which has imported torch, torch.distributed and zero_ext once (a preload), instead of
  from a fresh interpreter each: importing torch costs a rank ~1.4 s of CPU, most of a
  short test's time on a 2-core machine. The server is a clean process (it imported
  modules and ran nothing else), so a forked rank sees what a spawned one would, except
  the environment and the working directory, which are those of the server's start:
  each rank takes the parent's at its entry (an environment variable read when torch is
  imported keeps the server's value). Worlds on a backend that carries CUDA tensors
  keep "spawn"; ZX_TEST_START=spawn brings it back for every world.

Note [Frozen heap]
  A full garbage collection walks every object the interpreter tracks: ~170k once
  torch is imported, 70 ms; in a rank forked from the server, the first walk also
  writes to every page that holds them (copy on write), 200+ ms. A standing world
  collects twice between two functions (Note [Standing worlds]), hundreds of times
  in a suite. So what exists when this module is imported (torch, zero_ext: the
  server's preload, and the pytest process's imports), and what survives a standing
  world's reset (modules a function imported), is moved out of the collector's sight
  with gc.freeze(): a collection walks only what the last function made, which is
  what it is there for. Frozen objects are never collected as cycles, so the reset
  first lets the models the function dropped end (their optimizers are held until
  every rank is at their end: zero_ext/alone/end.py) and collects them; what is
  frozen then is the interpreter's modules and their caches, alive until exit anyway.
  Measured on 3 files of standing worlds (test_after_zeroify, test_offload,
  test_parity, one process): the resets' first collections 13.6 s -> 1.8 s, the
  machine's CPU time 180 s -> 152 s.
"""
from __future__ import annotations

import atexit
import gc
import io
import os
import pickle
import sys
import tempfile
import time
import traceback

import multiprocessing

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the start method of the ranks (Note [Forked ranks])
START_METHOD = os.environ.get("ZX_TEST_START", "forkserver")
if START_METHOD == "forkserver":
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "zero_ext", "dist_harness"])


def _start_method(backend: str) -> str:
    return "spawn" if uses_cuda(backend) else START_METHOD


def _parent_state() -> tuple:
    """What a forked rank takes from the parent at its entry (Note [Forked ranks])."""
    return dict(os.environ), os.getcwd()


def _take_parent_state(state) -> None:
    env, cwd = state
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    os.chdir(cwd)

# Set by conftest.py for each test: whether it may start processes (it is marked `dist`).
# A test that calls run_world without the mark fails, so `make check` (-m "not dist")
# cannot start a world by accident.
SPAWN_ALLOWED = True
SPAWN_REFUSED = ("this test starts processes (run_world) but is not marked `dist`: add "
                 "@pytest.mark.dist (or pytestmark = pytest.mark.dist for the module) so that "
                 "`make check` leaves it out")


def uses_cuda(backend: str) -> bool:
    """Whether a process group of this backend string carries CUDA tensors."""
    return backend == "nccl" or "cuda" in backend


def _add_paths():
    for p in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")):
        if p not in sys.path:
            sys.path.insert(0, p)


def _entry(rank, world, store_path, out_dir, fn, args, init_pg, backend="gloo", state=None):
    if state is not None:
        _take_parent_state(state)
    _add_paths()
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if uses_cuda(backend):
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if init_pg:
            dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        torch.save({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        # Drop every reference to the process group (a saved exception's frames hold
        # one) before destroying it, then leave without interpreter finalization:
        # gloo's threads can abort ("terminate called without an active exception")
        # when a process group is torn down during Py_Finalize. The result is saved.
        gc.collect()
        if init_pg and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _joined(ctx, expect_errors: bool) -> bool:
    """True once every rank has exited. With expect_errors a rank may be killed on
    purpose (SIGKILL): poll instead of ctx.join(), which would terminate the others
    before they report how they failed."""
    if not expect_errors:
        return ctx.join(timeout=1.0)
    if any(p.is_alive() for p in ctx.processes):
        time.sleep(0.2)
        return False
    return True


def _raise_failed(fn, outs):
    failed = [(r, o) for r, o in enumerate(outs) if not o["ok"]]
    if failed:
        # a rank's own error first; "connection closed" on the others is its echo
        failed.sort(key=lambda ro: "Connection closed" in ro[1]["error"])
        raise AssertionError("\n".join(f"rank {r} failed: {o['error']}\n{o['trace']}" for r, o in failed))


def run_world(fn, world_size: int, *args, timeout_s: float = 300, init_pg: bool = True,
              expect_errors: bool = False, backend: str = "gloo", reuse: bool = False):
    """Returns [result of rank 0, ..., result of rank N-1]. With expect_errors=True
    returns the per-rank dicts {"ok", "result"|"error"} instead of raising. With
    reuse=True runs on the test module's standing world (Note [Standing worlds])."""
    if not SPAWN_ALLOWED:
        raise AssertionError(SPAWN_REFUSED)
    if reuse:
        assert init_pg and not expect_errors and backend == "gloo", \
            "reuse=True is for plain gloo worlds whose functions succeed (Note [Standing worlds])"
        return _standing(world_size).run(fn, args, timeout_s)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(_entry, args=(world_size, store, tmp, fn, args, init_pg, backend, _parent_state()),
                                 nprocs=world_size, join=False, start_method=_start_method(backend))
        deadline = time.monotonic() + timeout_s
        try:
            while not _joined(ctx, expect_errors):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout_s}s "
                                       f"(a rank is hanging)")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        outs = []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pt")
            if not os.path.exists(path):
                if not expect_errors:
                    raise RuntimeError(f"rank {r} of {fn.__name__} exited without a result")
                outs.append({"ok": False, "error": "exited without a result", "trace": ""})
                continue
            outs.append(torch.load(path, weights_only=False, map_location="cpu"))   # CUDA results too
    if expect_errors:
        return outs
    _raise_failed(fn, outs)
    return [o["result"] for o in outs]


# ---------------------------------------------------------------------------- standing worlds

def _standing_entry(rank, world, store_path, conn, state):
    """A rank of a standing world: runs (fn, args) messages until an empty one."""
    _take_parent_state(state)
    _add_paths()
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    gc.freeze()   # Note [Frozen heap]
    default_pg = dist.group.WORLD
    seed = torch.initial_seed()
    env, cwd = dict(os.environ), os.getcwd()
    while True:
        message = conn.recv_bytes()
        if not message:
            break
        torch.manual_seed(seed)
        try:
            fn, args = pickle.loads(message)
            result = fn(rank, world, *args)
            reply = {"ok": True, "result": result}
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which ends this world
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        if reply["ok"]:
            try:
                _reset(default_pg, env, cwd)
            except BaseException as e:  # noqa: BLE001
                reply = {"ok": False, "error": f"resetting the standing world after {fn.__name__}: "
                                               f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        buf = io.BytesIO()
        torch.save(reply, buf)
        del reply, message
        conn.send_bytes(buf.getvalue())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # as _entry: no interpreter finalization with gloo's threads alive


def _reset(default_pg, env, cwd):
    """Put back what the last function may have changed (Note [Standing worlds])."""
    import torch.distributed as dist

    gc.collect()
    if not dist.is_initialized() or dist.group.WORLD is not default_pg:
        raise RuntimeError("the function destroyed or replaced the default process group: run it with reuse=False")
    dist.barrier()   # every rank is done with the last function's collectives
    if "zero_ext.alone.end" in sys.modules:
        # the models the function dropped end once every rank is here: let them go
        sys.modules["zero_ext.alone.end"].join_ended()
    gc.collect()
    gc.freeze()   # what survived lives on: later collections skip it (Note [Frozen heap])
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


class _StandingWorld:
    def __init__(self, world: int):
        self.world = world
        self.tmp = tempfile.TemporaryDirectory()
        ctx = mp.get_context(_start_method("gloo"))
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_standing_entry,
                            args=(rank, world, os.path.join(self.tmp.name, "store"), child, _parent_state()),
                            daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, fn, args, timeout_s):
        from multiprocessing.connection import wait

        message = pickle.dumps((fn, args))
        for c in self.conns:
            c.send_bytes(message)
        deadline = time.monotonic() + timeout_s
        outs = [None] * self.world
        pending = dict(zip(self.conns, range(self.world)))
        try:
            while pending:
                left = deadline - time.monotonic()
                if any(o is not None and not o["ok"] for o in outs):
                    # the others may wait forever in a collective with the failed rank
                    left = min(left, 5.0)
                if left <= 0:
                    break
                for c in wait(list(pending), timeout=left):
                    rank = pending.pop(c)
                    try:
                        outs[rank] = torch.load(io.BytesIO(c.recv_bytes()), weights_only=False, map_location="cpu")
                    except EOFError:
                        outs[rank] = {"ok": False, "error": "exited without a result", "trace": ""}
        finally:
            if pending or any(not o["ok"] for o in outs if o is not None):
                _end_standing(self.world)
        if any(o is not None and not o["ok"] for o in outs):
            for rank in range(self.world):
                if outs[rank] is None:
                    outs[rank] = {"ok": False, "error": "killed: did not finish after another rank failed",
                                  "trace": ""}
            _raise_failed(fn, outs)
        if pending:
            raise TimeoutError(f"{fn.__name__} on {self.world} ranks did not finish in {timeout_s}s "
                               f"(a rank is hanging)")
        return [o["result"] for o in outs]

    def close(self):
        for c in self.conns:
            try:
                c.send_bytes(b"")
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()
        self.tmp.cleanup()


_WORLDS: dict[int, _StandingWorld] = {}


def _standing(world: int) -> _StandingWorld:
    if world not in _WORLDS:
        _WORLDS[world] = _StandingWorld(world)
    return _WORLDS[world]


def _end_standing(world: int) -> None:
    w = _WORLDS.pop(world, None)
    if w is not None:
        for p in w.procs:
            if p.is_alive():
                p.kill()
        w.close()


def end_standing_worlds() -> None:
    """Ends every standing world (conftest.py: after each test module)."""
    for world in list(_WORLDS):
        _WORLDS.pop(world).close()


atexit.register(end_standing_worlds)
# Note [Frozen heap]: torch's and zero_ext's objects, imported by now (in the fork server,
# its whole preload), are left out of every later collection here and in forked ranks.
gc.freeze()
