"""Nothing a user does after zeroify() is silently lost. For every stage
and fp32/bf16: state-dict loads (on the wrapper, on .module, on a submodule, a
full state dict into stage 3) and in-place edits either hold bit for bit through
an lr=0 step, or raise a zero_ext error naming the fix; the wrapped torch
optimizer, zeroify twice, add_param_group and dtype/device moves raise. One
multi-rank load (3 ranks), and a large load: a 144 MiB full state dict loads into
stage 3 at N=4 within one unit + the shard of extra memory per rank, and
training then matches DDP started from the same weights."""
import os

import pytest
import torch
from torch import nn

import zero_ext
from zero_ext import ZeroUsageError
from dist_harness import run_world

STAGES = [0, 1, 2, 3]
DTYPES = ["fp32", "bf16"]


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 11), nn.LayerNorm(11), nn.Linear(11, 5))


def _zeroify(stage, dtype, seed=0, lr=0.0):
    """lr=0 AdamW with weight decay: a step leaves the fp32 masters bit for bit as they were."""
    m = _model(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1)
    zm, zo = zero_ext.zeroify(m, opt, stage=stage, param_dtype=dtype, unit_modules=["Linear"], min_unit_numel=0)
    return zm, zo, m, opt


def _step(zm, zo, seed=0):
    g = torch.Generator().manual_seed(seed)
    zm(torch.randn(4, 7, generator=g)).float().square().mean().backward()
    zo.step()
    zo.zero_grad()


def _masters(zm, zo):
    """name -> the fp32 master weights (all ranks' shards assembled on every rank)."""
    return zero_ext.consolidated_state_dict(zm, zo, to=0)["model"]


def _params(zm):
    """name -> the parameters as the model computes with them (stage 3: gathered)."""
    return {k: v.clone() for k, v in zm.state_dict().items()}


def _assert_same(got: dict, want: dict, keys=None):
    for k in keys or want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{k} differs"


# ---------------------------------------------------------------------------------- loads
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("via", ["wrapper", "module"])
def test_load_state_dict_reaches_the_master(stage, dtype, via):
    zm, zo, _, _ = _zeroify(stage, dtype)
    _step(zm, zo)
    new = _model(seed=1).state_dict()
    target = zm if via == "wrapper" else zm.module
    res = target.load_state_dict(new)
    assert res.missing_keys == [] and res.unexpected_keys == []
    _step(zm, zo, seed=1)                                      # lr=0: must not bring old values back
    _assert_same(_masters(zm, zo), new)                        # fp32 master == the values loaded, bit for bit
    low = torch.bfloat16 if dtype == "bf16" else torch.float32
    _assert_same(_params(zm), {k: v.to(low) for k, v in new.items()})
    if stage == 3:
        assert all(p.numel() == 0 for p in zm.module.parameters()), "stage 3 keeps parameters released"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage", [2, 3])
def test_load_into_a_submodule_and_partial_loads(stage, dtype):
    zm, zo, m, _ = _zeroify(stage, dtype)
    before = _masters(zm, zo)
    new = _model(seed=2).state_dict()
    sub = {k[len("2."):]: v for k, v in new.items() if k.startswith("2.")}
    assert m[2].load_state_dict(sub).missing_keys == []       # a submodule of the zeroified model
    partial = {"0.weight": new["0.weight"]}
    res = zm.load_state_dict(partial, strict=False)
    assert sorted(res.missing_keys) == ["0.bias", "1.bias", "1.weight", "2.bias", "2.weight"]
    _step(zm, zo)
    got = _masters(zm, zo)
    _assert_same(got, new, ["2.weight", "2.bias", "0.weight"])
    _assert_same(got, before, ["0.bias", "1.weight", "1.bias"])   # not in the state dict: untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage", STAGES)
def test_load_keys_and_errors_as_torch(stage, dtype):
    zm, zo, _, _ = _zeroify(stage, dtype)
    plain = _model()
    good = _model(seed=3).state_dict()
    bad = dict(good)
    del bad["1.bias"]
    bad["extra.weight"] = torch.zeros(2)
    # strict=False: torch's missing/unexpected keys, and what is there loads
    assert tuple(zm.load_state_dict(bad, strict=False)) == tuple(plain.load_state_dict(bad, strict=False))
    # strict=True and a size mismatch: torch's own messages, with the logical shape in stage 3
    wrong = dict(good, **{"2.weight": torch.zeros(3, 3)})
    for sd, strict in ((bad, True), (wrong, True), (wrong, False)):
        with pytest.raises(RuntimeError) as mine:
            zm.load_state_dict(sd, strict=strict)
        with pytest.raises(RuntimeError) as ref:
            plain.load_state_dict(sd, strict=strict)
        assert str(mine.value) == str(ref.value)
    with pytest.raises(ZeroUsageError, match="assign=False"):
        zm.module.load_state_dict(dict(good), assign=True)   # (torch writes assign into a state dict's _metadata)
    with pytest.raises(ValueError, match="assign=False"):
        zm.load_state_dict(good, assign=True)
    # after all that, a clean load still lands exactly
    zm.load_state_dict(good)
    _step(zm, zo)
    _assert_same(_masters(zm, zo), good)


# ---------------------------------------------------------------------------------- edits
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage", STAGES)
def test_inplace_edits_survive_a_step_or_raise(stage, dtype):
    zm, zo, m, _ = _zeroify(stage, dtype)
    _step(zm, zo)
    before = _masters(zm, zo)
    with torch.no_grad():
        m[0].weight.mul_(2)
        nn.init.constant_(m[2].bias, 0.375)
    edited = {"0.weight": m[0].weight.detach().clone(), "2.bias": m[2].bias.detach().clone()}
    if stage == 3:
        with pytest.raises(ZeroUsageError, match="gathered_parameters"):
            _step(zm, zo)
        zo.zero_grad()
        _step(zm, zo)                 # refused once; later steps run
        _assert_same(_masters(zm, zo), before)
        return
    _step(zm, zo, seed=1)             # lr=0: the edits stay, bit for bit
    _assert_same(_params(zm), edited, ["0.weight", "2.bias"])
    got = _masters(zm, zo)
    _assert_same(got, {k: v.float() for k, v in edited.items()})           # folded into the fp32 master
    _assert_same(got, before, ["0.bias", "1.weight", "1.bias", "2.weight"])  # the rest keeps its fp32 bits


@pytest.mark.parametrize("dtype", DTYPES)
def test_stage3_edits_through_gathered_parameters_are_not_refused(dtype):
    zm, zo, m, _ = _zeroify(3, dtype)
    with zero_ext.gathered_parameters(m[0], modifier_rank=0), torch.no_grad():
        m[0].weight.mul_(2)
        edited = m[0].weight.detach().clone()
    _step(zm, zo)
    _assert_same(_params(zm), {"0.weight": edited})


# ---------------------------------------------------------------------------------- slips
@pytest.mark.parametrize("stage", STAGES)
def test_wrapped_optimizer_and_second_zeroify_refuse(stage):
    zm, zo, m, opt = _zeroify(stage, "fp32")
    with pytest.raises(ZeroUsageError, match="optimizer zeroify\\(\\) returned"):
        opt.step()
    with pytest.raises(ZeroUsageError, match="before calling zeroify"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ZeroUsageError, match="before calling zeroify"):
        zo.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(zero_ext.ZeroInputError, match="already zeroified"):
        zero_ext.zeroify(zm.module, torch.optim.AdamW(zm.module.parameters()), stage=stage)
    with pytest.raises(zero_ext.ZeroInputError, match="already wrapped"):
        zero_ext.zeroify(_model(), opt, stage=stage)
    _step(zm, zo)                                  # the returned pair still trains
    assert zo.stats()["steps"] == 1 and len(zo.param_groups) == 1


MOVES = {
    "double": lambda zm: zm.double(),
    "half": lambda zm: zm.half(),
    "to(float64)": lambda zm: zm.to(torch.float64),
    "module.to(bf16)": lambda zm: zm.module.to(torch.bfloat16),
    "submodule.double": lambda zm: zm.module[2].double(),
    "to(meta)": lambda zm: zm.to("meta"),
    "to_empty": lambda zm: zm.module.to_empty(device="cpu"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage", STAGES)
def test_dtype_and_device_moves_raise_at_the_call(stage, dtype):
    zm, zo, m, _ = _zeroify(stage, dtype)
    _step(zm, zo)
    masters, params = _masters(zm, zo), _params(zm)
    for name, move in MOVES.items():
        if name == "module.to(bf16)" and dtype == "bf16":
            move = lambda zm: zm.module.float()          # noqa: E731 - the move that changes a bf16 model
        if name == "to_empty" and stage == 3:
            # Outside forward a stage-3 parameter is an empty tensor: to_empty() swaps it for
            # another empty one, which the next gather replaces; nothing is lost (checked below).
            move(zm)
            continue
        with pytest.raises(ZeroUsageError, match="param_dtype") as e:
            move(zm)
        assert "zero_ext" in str(e.value), name
    zm.cpu()                                             # changes nothing: allowed
    zm.to(torch.device("cpu"))
    _step(zm, zo, seed=1)                                # still attached: lr=0 keeps everything
    _assert_same(_masters(zm, zo), masters)
    _assert_same(_params(zm), params)


# ---------------------------------------------------------------------------------- ranks
CASES_3_RANKS = [(1, "bf16"), (2, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")]


def _load_worker(rank, world, new):
    out = {}
    for stage, dtype in CASES_3_RANKS:
        zm, zo, _, _ = _zeroify(stage, dtype)
        _step(zm, zo, seed=rank)
        zm.module.load_state_dict(new) if rank % 2 else zm.load_state_dict(new)
        _step(zm, zo, seed=10 + rank)
        full = zero_ext.consolidated_state_dict(zm, zo, to=0)
        out[stage, dtype] = {"masters": None if full is None else full["model"], "params": _params(zm)}
    return out


@pytest.mark.dist
def test_load_on_three_ranks():
    """Each rank writes only its fragments, with no collective; every rank ends with
    the loaded values, and the assembled fp32 masters equal them bit for bit."""
    new = _model(seed=5).state_dict()
    outs = run_world(_load_worker, 3, new, reuse=True)
    for stage, dtype in CASES_3_RANKS:
        _assert_same(outs[0][stage, dtype]["masters"], new)
        low = torch.bfloat16 if dtype == "bf16" else torch.float32
        for r in outs:
            _assert_same(r[stage, dtype]["params"], {k: v.to(low) for k, v in new.items()})


# --------------------------------------------------------- a large full state dict into stage 3
def _deep(layers, width, device=None):
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width, device=device), nn.Tanh()]
    return nn.Sequential(*mods)


def _big_worker(rank, world, path, layers, width, steps):
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)     # as test_build_sharded: measure allocations, not caching

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    model = _deep(layers, width, device="meta")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    zm, zo = zero_ext.zeroify(model, opt, stage=3, unit_modules=["Linear"], min_unit_numel=0)
    open("/proc/self/clear_refs", "w").write("5")     # reset the peak (VmHWM) to now
    base, anon_base = status("VmRSS:"), status("RssAnon:")
    sd = torch.load(path, mmap=True, weights_only=True)   # the full state dict, read as it is used
    res = zm.load_state_dict(sd)
    del sd
    peak = status("VmHWM:") - base
    anon = status("RssAnon:") - anon_base   # what the load allocated (the rest: pages of the mapped file)
    unit = (width * width + width) * 4
    shard = zo.stats()["model_state_bytes"]["parameters"]

    # DDP from the same weights; both train on the same data
    torch.manual_seed(0)
    ref = _deep(layers, width)
    ref.load_state_dict(torch.load(path, weights_only=True))
    ddp = nn.parallel.DistributedDataParallel(ref, gradient_as_bucket_view=True)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, width, generator=g)
        pair = []
        for net, o in ((ddp, opt_ref), (zm, zo)):
            loss = net(x).square().mean()
            loss.backward()
            o.step()
            o.zero_grad()
            pair.append(loss.item())
        losses.append(pair)
    worst = 0.0
    for k in range(0, 2 * layers, 2):
        with zero_ext.gathered_parameters(model[k]):
            for a, b in ((ref[k].weight, model[k].weight), (ref[k].bias, model[k].bias)):
                worst = max(worst, ((a - b).norm() / a.norm()).item())
    return {"peak": peak, "anon": anon, "unit": unit, "shard": shard, "losses": losses, "rel": worst,
            "keys": (res.missing_keys, res.unexpected_keys)}


@pytest.mark.dist
def test_full_state_dict_into_stage3_at_n4_memory_and_ddp_parity(tmp_path):
    """A large full state dict: 16 x Linear(1536, 1536) = 144.1 MiB of fp32 parameters."""
    world, layers, width, steps = 4, 16, 1536, 2
    path = os.path.join(tmp_path, "full.pt")
    torch.manual_seed(11)
    torch.save(_deep(layers, width).state_dict(), path)
    # As a checkpoint read when a job starts: on disk, not in the page cache, where
    # this process's writes left it in large folios that a rank's first read would
    # map whole, beyond the bytes it reads.
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    outs = run_world(_big_worker, world, path, layers, width, steps, timeout_s=600)
    full = layers * (width * width + width) * 4
    assert full > 144 * 2**20
    for rank, r in enumerate(outs):
        assert r["keys"] == ([], [])
        bound = r["unit"] + r["shard"]
        print(f"rank {rank}: load grew RSS by {r['peak'] / 2**20:.1f} MiB (anonymous {r['anon'] / 2**20:.2f} MiB); "
              f"one unit + shard = "
              f"{bound / 2**20:.1f} MiB; full model {full / 2**20:.1f} MiB")
        assert r["peak"] <= bound, f"rank {rank}: {r['peak'] / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"
        worst_loss = max(abs(a - b) / abs(a) for a, b in r["losses"])
        print(f"rank {rank}: vs DDP, worst relative loss difference {worst_loss:.2g}, weights {r['rel']:.2g}")
        for ddp_loss, mine in r["losses"]:
            assert abs(ddp_loss - mine) <= 1e-5 * abs(ddp_loss), r["losses"]
        assert r["rel"] <= 1e-5, f"rank {rank}: relative weight difference to DDP {r['rel']:.3g}"


def test_step_hooks_profiler_and_scheduler_as_torch():
    """Note [Step hooks] (zero_ext/optim.py): step() skips torch's profile_hook_step wrapper
    when nothing needs it, and otherwise runs it: per-optimizer and global pre/post hooks
    fire once per step in torch's order, a pre-hook may replace the arguments, the profiler
    sees "Optimizer.step#ZeroOptimizer.step", and an LR scheduler sees the step (no
    "lr_scheduler.step() before optimizer.step()" warning)."""
    import warnings

    import torch.optim.optimizer as optim_module
    m = _model()
    zm, zo = zero_ext.zeroify(m, torch.optim.AdamW(m.parameters(), lr=1e-2), stage=1)
    x = torch.randn(4, 7)

    def closure():
        loss = zm(x).square().mean()
        loss.backward()
        return loss

    calls = []
    handles = [zo.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o is zo))),
               zo.register_step_post_hook(lambda o, a, k: calls.append(("post", o is zo))),
               optim_module.register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global pre", o is zo))),
               optim_module.register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global post", o is zo)))]
    try:
        before = [p.detach().clone() for p in m.parameters()]
        loss = zo.step(closure)
        assert torch.is_tensor(loss)
        assert calls == [("global pre", True), ("pre", True), ("post", True), ("global post", True)], calls
        assert any(not torch.equal(a, b) for a, b in zip(before, m.parameters())), "the hooked step stepped"
    finally:
        for h in handles:
            h.remove()
    # a pre-hook that replaces the arguments: the step gets its closure
    seen = []
    h = zo.register_step_pre_hook(lambda o, a, k: ((a[0],), {"closure": lambda: seen.append(1) or closure()}))
    try:
        zo.step()
    finally:
        h.remove()
    assert seen == [1]
    calls.clear()
    zo.step(closure)                     # no hooks left: the direct path, nothing recorded
    assert calls == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        zo.step(closure)
    names = {e.name for e in prof.events()}
    assert "Optimizer.step#ZeroOptimizer.step" in names, sorted(n for n in names if "step" in n.lower())
    sched = torch.optim.lr_scheduler.StepLR(zo, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        zo.step(closure)
        sched.step()
    assert not [x for x in w if "lr_scheduler.step()" in str(x.message)], [str(x.message) for x in w]
    assert zo.param_groups[0]["lr"] == 5e-3


def test_step_runs_without_grad_and_restores_the_mode():
    """Note [Step hooks]: step() turns gradients off itself (no torch.no_grad() decorator):
    the update records no autograd history, a closure still computes gradients, and the
    caller's grad mode is back afterwards, also when the step raises."""
    m = _model()
    zm, zo = zero_ext.zeroify(m, torch.optim.AdamW(m.parameters(), lr=1e-2), stage=1)
    x = torch.randn(4, 7)

    def closure():
        assert torch.is_grad_enabled(), "the closure runs with gradients on, as in torch"
        loss = zm(x).square().mean()
        loss.backward()
        return loss

    for mode in (True, False):
        with torch.set_grad_enabled(mode):
            before = [p.detach().clone() for p in m.parameters()]
            zo.step(closure)
            assert torch.is_grad_enabled() is mode
            assert any(not torch.equal(a, b) for a, b in zip(before, m.parameters())), "the step stepped"
            assert all(p.grad_fn is None and p.is_leaf for p in m.parameters()), "the update recorded history"
    del zo.param_groups[0]["lr"]      # the step raises (Note [Hyperparameters]) ...
    zm(x).square().mean().backward()
    with pytest.raises(RuntimeError, match="'lr'"):
        zo.step()
    assert torch.is_grad_enabled()    # ... and the grad mode is restored
