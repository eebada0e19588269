"""Overlap proven, not assumed (Note [Communication delay] in csrc/engine/comm.cpp, in
the style of FSDP2's overlap test).

Every collective is delayed by DELAY_MS (zero_ext.delay_collectives: the engine's C++
collectives too), and the model's compute is a known time: each of BLOCKS blocks is a
Linear followed by a sleep of FWD_MS in forward and BWD_MS in backward (a sleep, not
arithmetic, so that two ranks on two cores and a busy machine do not stretch it). Per
step, at world size 2:

    compute   = the step without delay (sleeps + the real, tiny, arithmetic and comm)
    total     = collectives per step (stats()) x DELAY_MS
    serial    = the step when every collective is waited for where it is launched
    overlap   = the step with the delay, as the engine runs it

serial - compute >= 0.8 x total shows that the delay reaches every collective (so the
bound below is not met by a delay that did nothing), and overlap - compute <= 0.3 x
total is the claim: stage 2 (gradient reduce-scatters during backward, parameter
gathers waited per module in the next forward: overlap_param_gather) and stage 3
(unit gathers prefetched one unit ahead, reduce-scatters during backward) hide at
least 70% of their communication behind compute. The same runs on one GPU with
cuda:gloo (sleeps become spin kernels; the delay a spin kernel on a side stream) in
`make gpu-check`.

    pytest tests/test_overlap.py -s     # prints the table
"""
from __future__ import annotations

import statistics
import time

import pytest
import torch
from torch import nn

from dist_harness import run_world

pytestmark = pytest.mark.dist

BLOCKS = 8
WIDTH = 64
FWD_MS, BWD_MS = 10.0, 20.0
DELAY_MS = 7.5
STEPS = 4              # timed steps per variant, after one untimed
HIDDEN_MAX = 0.3       # overlap - compute <= this x total delay
APPLIED_MIN = 0.8      # serial - compute >= this x total delay


class Compute:
    """A known compute time: time.sleep on the CPU, a spin kernel on the current stream on CUDA."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cycles_per_ms = self._calibrate() if device.type == "cuda" else 0.0

    def _calibrate(self) -> float:
        torch.cuda._sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / start.elapsed_time(end)

    def __call__(self, ms: float) -> None:
        if self.device.type == "cuda":
            torch.cuda._sleep(int(ms * self.cycles_per_ms))
        else:
            time.sleep(ms / 1000.0)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, compute):
        ctx.compute = compute
        compute(FWD_MS)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.compute(BWD_MS)
        return g, None


class Block(nn.Module):
    def __init__(self, compute):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.compute = compute

    def forward(self, x):
        return _Sleep.apply(torch.tanh(self.lin(x)), self.compute)


class Chain(nn.Module):
    def __init__(self, compute):
        super().__init__()
        self.blocks = nn.ModuleList(Block(compute) for _ in range(BLOCKS))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def _collectives(stats) -> int:
    return sum(c["calls"] for c in stats["comm"].values())


def _overlap_worker(rank, world, stage, device_kind):
    import torch.distributed as dist

    import zero_ext
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    compute = Compute(device)
    torch.manual_seed(0)
    model = Chain(compute).to(device)
    one_bucket = (WIDTH * WIDTH + WIDTH) * 4          # one Linear per bucket: a gather and a reduce per block
    options = dict(bucket_bytes=one_bucket, first_bucket_bytes=one_bucket)
    if stage == 3:
        options.update(unit_modules=["Block"], min_unit_numel=0, coalesce_numel=0, prefetch_depth=1)
    else:
        options.update(overlap_param_gather=True)
    zm, zo = zero_ext.zeroify(model, torch.optim.SGD(model.parameters(), lr=1e-3), stage=stage, **options)
    x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(rank)).to(device)

    def sync():   # a barrier on the engine's device (a cuda:gloo group carries no CPU tensors)
        dist.all_reduce(torch.zeros(1, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step():
        zm(x).backward()
        zo.step()
        zo.zero_grad()

    out = {}
    for name, delay, serialize in (("compute", 0.0, False), ("overlap", DELAY_MS, False),
                                   ("serial", DELAY_MS, True), ("compute2", 0.0, False)):
        zero_ext.delay_collectives(zo, delay, serialize=serialize)
        step()                                       # untimed: the previous variant's gathers drain
        sync()
        before = zo.stats()
        times = []
        for _ in range(STEPS):
            t0 = time.perf_counter()
            step()
            if device.type == "cuda":   # the compute stream only: gathers still in flight overlap the next step
                torch.cuda.current_stream().synchronize()
            times.append(time.perf_counter() - t0)
        after = zo.stats()
        sync()
        out[name] = {"step_s": statistics.median(times),
                     "collectives": (_collectives(after) - _collectives(before)) / STEPS,
                     "wait_s": (after["comm_wait_s"] - before["comm_wait_s"]) / STEPS}
    zero_ext.delay_collectives(zo, 0.0)
    return out


def check_overlap(outs, stage: int, where: str) -> None:
    r = max(outs, key=lambda o: o["overlap"]["step_s"])     # the slowest rank
    compute = min(r["compute"]["step_s"], r["compute2"]["step_s"])
    total = r["overlap"]["collectives"] * DELAY_MS / 1000.0
    exposed, serial = r["overlap"]["step_s"] - compute, r["serial"]["step_s"] - compute
    print(f"\n{where} stage {stage}: compute {compute * 1e3:.0f} ms/step, {r['overlap']['collectives']:.0f} "
          f"collectives x {DELAY_MS:.0f} ms = {total * 1e3:.0f} ms of delay; exposed with overlap "
          f"{exposed * 1e3:.0f} ms ({exposed / total:.0%}), serialized {serial * 1e3:.0f} ms "
          f"({serial / total:.0%}); host blocked in waits {r['overlap']['wait_s'] * 1e3:.0f} ms/step")
    assert r["overlap"]["collectives"] >= 2 * BLOCKS, f"stage {stage}: only {r['overlap']['collectives']} " \
                                                      f"collectives per step; the test needs one per block each way"
    assert serial >= APPLIED_MIN * total, (
        f"stage {stage}: the serialized run added {serial * 1e3:.0f} ms, under {APPLIED_MIN:.0%} of the "
        f"{total * 1e3:.0f} ms of delay: the delay does not reach every collective")
    assert exposed <= HIDDEN_MAX * total, (
        f"stage {stage}: {exposed * 1e3:.0f} ms of the {total * 1e3:.0f} ms of communication delay per step "
        f"stayed exposed ({exposed / total:.0%} > {HIDDEN_MAX:.0%}): communication does not overlap compute")


@pytest.mark.parametrize("stage", [2, 3])
def test_communication_overlaps_compute(stage):
    outs = run_world(_overlap_worker, 2, stage, "cpu", timeout_s=300)
    check_overlap(outs, stage, "CPU, 2 gloo ranks")


@pytest.mark.parametrize("stage", [2, 3])
def test_communication_overlaps_compute_gpu(stage):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False (make gpu-check runs it)")
    outs = run_world(_overlap_worker, 2, stage, "cuda", timeout_s=300, backend="cuda:gloo")
    check_overlap(outs, stage, "GPU, 2 cuda:gloo ranks on one device")


def _direct_worker(rank, world):
    import zero_ext
    from cases import batch, build_model
    model = build_model("direct")
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=2,
                              overlap_param_gather=True, bucket_bytes=1024, first_bucket_bytes=1024)
    waits = zm._param_waits
    before = waits.eager
    for step in range(2):
        x, y = batch("direct", rank, step, 0)
        zm(x, y).backward()
        zo.step()
        zo.zero_grad()
    bucket_of = zm._engine.bucket_of_params
    index = {id(p): i for i, p in enumerate(zo._params)}
    direct = sorted({bucket_of[index[id(p)]] for p in (model.head.weight, model.head.bias, model.scale)})
    return {"before": before, "eager": waits.eager, "direct": direct,
            "buckets": zo.stats()["num_buckets"]}


def test_parameters_read_without_their_module_are_waited_first():
    """Note [Gathers waited per module]: the first forward waits for every gather and
    learns which parameters no module call covers (a head used as F.linear(h, head.weight),
    a parameter of the root): exactly their buckets are waited for when later forwards
    start. Parity with DDP on this model: tests/test_parity.py overlap-gather-direct."""
    for rank, r in enumerate(run_world(_direct_worker, 2)):
        assert r["before"] is None, f"rank {rank}: learned before any forward: {r['before']}"
        assert r["buckets"] > len(r["direct"]), f"rank {rank}: the model needs several buckets: {r}"
        assert r["eager"] == r["direct"], f"rank {rank}: waited first {r['eager']}, read directly {r['direct']}"


def _teardown_worker(rank, world):
    import gc
    import threading
    import zero_ext
    from cases import batch, build_model
    model = build_model("direct")
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=2,
                              overlap_param_gather=True, bucket_bytes=1024, first_bucket_bytes=1024)
    x, y = batch("direct", rank, 0, 0)
    zm(x, y).backward()
    zero_ext.delay_collectives(zo, 100)   # the gathers this step launches land >= 100 ms later
    zo.step()
    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.005)

    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.02)
    start = time.monotonic()
    del zm, zo, model
    gc.collect()
    zero_ext.alone.join_ended()   # the engine goes with the last reference to it (Note [Model's end])
    end = time.monotonic()
    stop.set()
    thread.join()
    return {"teardown_s": end - start, "ticks": sum(start < t < end for t in ticks)}


def test_engine_teardown_waits_without_the_gil():
    """Note [Engine teardown without the GIL] (csrc/binding.cpp): a model and optimizer
    dropped while the gathers of an overlapped step are in flight. The engine's destructor
    waits for them (here >= 100 ms each, delayed), and other threads run meanwhile (a Python
    thread here, gloo's worker threads in the hang this prevents): holding the GIL there,
    it let none run."""
    for rank, r in enumerate(run_world(_teardown_worker, 2)):
        assert r["teardown_s"] >= 0.1, f"rank {rank}: the engine did not wait for its gathers at teardown: {r}"
        assert r["ticks"] >= 10, f"rank {rank}: a Python thread ran {r['ticks']} times in {r['teardown_s']:.2f} s " \
                                 f"of teardown (every 5 ms expected): the destructor holds the GIL"
