"""Elastic training with torchrun's own agent (README, "Elastic training"): two agents
on this machine (c10d rendezvous on 127.0.0.1, --nnodes=1:2; A runs 2 workers, B 1) train
examples/train_gpt.py with a checkpoint every K steps. A starts alone (world size 2); B
joins after the first checkpoint and the job resumes at world size 3 (grow, uneven shards);
B is killed with its worker after the next checkpoint and A's workers resume at world
size 2 (shrink). Every resume must come from the last checkpoint saved before it, the
final checkpoint must verify and hold the last step, and each resumed segment must equal
a plain job (env://, no agent) that runs it uninterrupted at the same world size from a
copy of the checkpoint it resumed from, taken while no worker runs (between the old
workers' exit and the new ones' start-up). The segment trained from scratch is no resume.

Most of the test's time is processes starting (each worker imports torch and zero_ext),
not training. So B and the reference jobs' workers start ahead of time, imported and held
(HELD, WORKER: the workers while A's notice the loss of B, about 3 s of waiting), the
reference jobs run beside the job's last segment, and the worlds are small (7 worker start-ups in the job, 5 in the references; there were 10 and 10).
STEPS = 300 leaves the first segment a wide margin (B joins within about a second).
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from dist_harness import ROOT

SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
STEPS, EVERY = 300, 10
MODEL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
         "--stage", "2", "--threads", "1", "--warmup", "0", "--eval-iters", "1", "--sample-chars", "0",
         "--log-every", "100000", "--lr", "1e-3",
         # the workers that see a peer die fail after 2 x sequence_timeout (Note [Collective
         # sequence check]: the others' reports are awaited first), 2 s here instead of 6
         "--zero-config", '{"sequence_timeout": 1.0}']
TIMEOUT_S = 420

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(not hasattr(socket, "AF_INET"), reason="needs TCP on 127.0.0.1")]


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_", "RANK", "WORLD"))}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    # torch 2.13's agents share the rendezvous TCP store with the workers by default, and an
    # agent that was rank 0 before keeps its cached store address instead of publishing it in
    # the new round, so an agent joining a later round waits for it forever (README).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid):
    """Every live process below `pid` (Linux /proc)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


# A torchrun agent started ahead of its time: torch.distributed.run imported (most of an
# agent's start-up), then held until its arguments come as a line of JSON on its stdin.
HELD = "import json, sys, torch.distributed.run as run; run.main(json.loads(sys.stdin.readline()))"


# A reference job's worker started ahead of its time: torch, zero_ext and the script imported,
# then held until its environment (RANK, WORLD_SIZE, MASTER_PORT...) and arguments come on stdin.
WORKER = ("import json, os, sys; sys.path.insert(0, os.path.join(os.getcwd(), 'examples')); import zero_ext, "
          "train_gpt; env, argv = json.loads(sys.stdin.readline()); os.environ.update(env); train_gpt.main(argv)")


def _held(**kw):
    return subprocess.Popen([sys.executable, "-c", HELD], cwd=ROOT, env=_env(), stdin=subprocess.PIPE, text=True,
                            **kw)


class Agent:
    """One torchrun agent in its own session; its output lines, timestamped. `held`: it
    imports torch.distributed.run, then waits for go() (HELD)."""

    def __init__(self, name, args, log, held=False):
        self.name, self.log, self.args = name, log, args
        kw = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.proc = _held(**kw) if held else subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *args], cwd=ROOT, env=_env(), text=True, **kw)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def go(self):
        self.proc.stdin.write(json.dumps(self.args) + "\n")
        self.proc.stdin.close()

    def _read(self):
        for line in self.proc.stdout:
            self.log.append((time.monotonic(), self.name, line.rstrip("\n")))

    def kill(self):
        """SIGKILL the agent and its workers (torchrun starts them in sessions of their
        own, so they are found as the agent's descendants), as if their machine died."""
        victims = [self.proc.pid] + _descendants(self.proc.pid)
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def wait(self, deadline):
        try:
            return self.proc.wait(timeout=max(1, deadline - time.monotonic()))
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.thread.join(5)


def _wait_for(log, pattern, deadline, after=0.0):
    rx = re.compile(pattern)
    while time.monotonic() < deadline:
        for t, _, line in list(log):
            if t >= after and rx.search(line):
                return t, line
        time.sleep(0.05)
    raise AssertionError(f"no line matching {pattern!r} in time; log:\n" + "\n".join(f"{n}: {l}" for _, n, l in log))


def _segments(log):
    """[(time, start step, world size)] of every training run the log shows (rank 0's header
    and, when it resumed, its 'resumed from' line), in time order."""
    runs, pending = [], None
    for t, _, line in sorted(log):
        m = re.search(r"\| world size (\d+) \|", line)
        if m:
            if pending is not None:
                runs.append(pending)
            pending = (t, 0, int(m.group(1)))
            continue
        m = re.search(r"resumed from .* at step (\d+) .* now world size (\d+)", line)
        if m and pending is not None:
            pending = (pending[0], int(m.group(1)), int(m.group(2)))
            runs.append(pending)
            pending = None
    if pending is not None:
        runs.append(pending)
    return runs


def _saves(log):
    return [(t, int(m.group(1))) for t, _, line in sorted(log)
            for m in [re.search(r"saved .* at step (\d+)", line)] if m]


def _workers(agent):
    """The training processes below `agent` now."""
    out = []
    for pid in _descendants(agent.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"train_gpt.py" in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")   # exited, not yet reaped
    except OSError:
        return True


def _snapshot(run, dest, workers, deadline):
    """Copy the job's checkpoint directory once `workers` have exited: until the next
    workers start and save, nothing writes it, so the copy is what they resume from."""
    while not all(_gone(p) for p in workers):
        assert time.monotonic() < deadline, "the workers did not exit"
        time.sleep(0.02)
    shutil.copytree(run, dest)


class Reference:
    """A plain job of `nproc` workers over env:// (no agent: nothing restarts it), held from
    the test's start; run() trains from a copy of a checkpoint directory, wait() checks it."""

    def __init__(self, nproc, log_dir):
        self.outs = [os.path.join(log_dir, f"ref{nproc}-{r}.log") for r in range(nproc)]
        self.procs = []
        for out in self.outs:
            with open(out, "w") as f:
                self.procs.append(subprocess.Popen([sys.executable, "-c", WORKER], cwd=ROOT, env=_env(),
                                                   stdin=subprocess.PIPE, stdout=f, stderr=subprocess.STDOUT, text=True))

    def run(self, steps, start, work):
        """Train from a copy of the directory `start` to `steps`, in `work`; returns its checkpoint."""
        shutil.copytree(start, work)
        ckpt = os.path.join(work, "ckpt")
        argv = [*MODEL, "--steps", str(steps), "--save-every", str(EVERY), "--checkpoint", ckpt]
        port, n = _free_port(), len(self.procs)
        for r, p in enumerate(self.procs):
            env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            p.stdin.write(json.dumps([env, argv]) + "\n")
            p.stdin.close()
        return ckpt

    def wait(self, deadline):
        for p, out in zip(self.procs, self.outs):
            try:
                code = p.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise
            with open(out) as f:
                assert code == 0, f.read()[-6000:]

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _assert_same(got, expect, what):
    """Two consolidated checkpoints: the same step, samples and world size, parameters within 1e-5."""
    assert got["extra"] == expect["extra"], (what, got["extra"], expect["extra"])
    assert got["model"].keys() == expect["model"].keys()
    for name, tensor in expect["model"].items():
        torch.testing.assert_close(got["model"][name], tensor, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what}: {name}: {m}")


def test_elastic_shrink_and_grow(tmp_path):
    from zero_ext.checkpoint import consolidate, read_manifest

    deadline = time.monotonic() + TIMEOUT_S
    run = str(tmp_path / "run")                 # the checkpoint and its .tmp/.old siblings
    os.makedirs(run)
    ckpt = os.path.join(run, "ckpt")
    port = _free_port()

    def agent_args(host):
        # A hosts the rendezvous store (on a real cluster: the endpoint's machine) and runs 2
        # workers; B is a client with 1 (so the grown world, 3, shards unevenly).
        return ["--nnodes=1:2", f"--nproc_per_node={2 if host else 1}", "--max-restarts=3", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test", "--monitor-interval=0.2",
                # a dead agent leaves the rendezvous after keep_alive_interval x keep_alive_max_attempt
                # seconds without a heartbeat (torch's default: 5 x 3); A alone waits last_call_timeout
                # for others before each of its rounds (no round here needs two agents at once)
                f"--rdzv-conf=is_host={int(host)},last_call_timeout=1,join_timeout=120,read_timeout=30,"
                "keep_alive_interval=1,keep_alive_max_attempt=3",
                SCRIPT, *MODEL, "--steps", str(STEPS), "--save-every", str(EVERY), "--checkpoint", ckpt]

    log = []
    a = Agent("A", agent_args(True), log)
    b = Agent("B", agent_args(False), log, held=True)   # imports while A starts
    refs = []
    try:
        _wait_for(log, r"\| world size 2 \|", deadline)
        _wait_for(log, rf"saved .* at step {EVERY} ", deadline)
        first = _workers(a)
        assert first, "agent A's workers were not found"
        b.go()                                   # grow: B joins, A's workers stop
        log.append((time.monotonic(), "test", "let agent B join"))
        _snapshot(run, str(tmp_path / "at_grow"), first, deadline)
        t3, line = _wait_for(log, r"resumed from .* now world size 3", deadline)
        s3 = int(re.search(r"at step (\d+)", line).group(1))
        _wait_for(log, rf"saved .* at step {s3 + EVERY} ", deadline, after=t3)
        second = _workers(a)
        assert second, "agent A's workers were not found"
        killed_at = time.monotonic()
        b.kill()                                 # shrink: B and its workers die
        log.append((killed_at, "test", "killed agent B and its workers"))
        # the reference jobs' workers import while A's notice the loss and meet again
        refs += [Reference(3, str(tmp_path)), Reference(2, str(tmp_path))]
        _snapshot(run, str(tmp_path / "at_shrink"), second, deadline)
        t2, line = _wait_for(log, r"resumed from .* now world size 2", deadline, after=killed_at)
        s2 = int(re.search(r"at step (\d+)", line).group(1))
        # the segments the job resumed, each from a copy of what it resumed from, beside its last one
        grown = refs[0].run(s2, str(tmp_path / "at_grow"), str(tmp_path / "ref_grown"))
        shrunk = refs[1].run(STEPS, str(tmp_path / "at_shrink"), str(tmp_path / "ref_shrunk"))
        assert a.wait(deadline) == 0, "agent A failed"
        for ref in refs:
            ref.wait(deadline)
    finally:
        for ref in refs:
            ref.kill()
        for agent in (a, b):
            if agent.proc.poll() is None:
                os.killpg(agent.proc.pid, signal.SIGKILL)
    text = "\n".join(f"[{t:9.2f}] {n}: {l}" for t, n, l in sorted(log))
    print(text)

    runs = _segments(log)
    saves = _saves(log)
    assert [w for _, _, w in runs] == [2, 3, 2], text
    # every resume came from the last checkpoint completed before it started: the last one
    # logged, or the next one, when the agent stopped the workers after that save completed
    # but before its line reached the log (seen once: resumed at 150, last line at 140)
    for t, start, _ in runs[1:]:
        before = [s for ts, s in saves if ts < t]
        assert before and start in (before[-1], before[-1] + EVERY), \
            f"resumed at {start}, last save before it {before[-1:]}\n{text}"
    assert [start for _, start, _ in runs] == [0, s3, s2] and EVERY <= s3 < s2, text
    # the copies are what the resumed workers loaded
    at_grow = consolidate(str(tmp_path / "at_grow" / "ckpt"))
    at_shrink = consolidate(str(tmp_path / "at_shrink" / "ckpt"))
    assert (at_grow["extra"]["step"], at_shrink["extra"]["step"]) == (s3, s2), text
    # the final checkpoint verifies (sizes, CRCs) and holds the last step
    final = consolidate(ckpt)
    assert final["extra"]["step"] == STEPS and final["extra"]["samples"] > 0, final["extra"]
    assert read_manifest(ckpt)
    # each resumed segment equals the same segment run uninterrupted
    _assert_same(at_shrink, consolidate(grown), f"world size 3, steps {s3}-{s2}")
    _assert_same(final, consolidate(shrunk), f"world size 2, steps {s2}-{STEPS}")
    shutil.rmtree(tmp_path, ignore_errors=True)
