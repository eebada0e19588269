"""Optimizer offload (offload="cpu", Note [Optimizer offload] in csrc/engine/offload.h).

On a CPU engine the whole offload pipeline runs: separate host buffers for the master,
the optimizer states and the gradient shard, the down ring filled as each bucket's
reduction lands and emptied by the worker thread, the per-bucket host step, the up ring
copied into the owned slices before the parameter gather. It must change no bit:

1. Each case trains twice from the same start, with and without offload, and every
   loss, every parameter and every optimizer state tensor (opt.state_dict()) must be
   bit-identical, on 1-3 gloo ranks (3 divides no parameter count here), stages 1 and 2:
   the GPT on tinyshakespeare with AdamW and clipping (fp32, and bf16 parameters with a
   bf16 reduce), SGD with Nesterov momentum under no_sync accumulation, a torch optimizer
   without fused kernel (RMSprop: stepped on the host shards), the native reduce-scatter
   and the all-to-all one, and a parameter no rank uses.
2. A state_dict round trip with offload resumes bit for bit like the run without it.
3. opt.stats() equals estimate_memory byte for byte: the host part (master, states,
   gradient shard, pinned rings) and the device part (no master/states, no stage-2
   gradients); and the copy counters say one down copy per bucket and backward, one up
   copy per bucket and step.
4. Bad input is refused before any collective, naming the fix: stage 0/3, grad_quant,
   param_quant, step_control=True, too little host memory (on every rank).
"""
import os
import warnings

import pytest
import torch

from dist_harness import ROOT, run_world

DATA = os.path.join(ROOT, "examples", "data", "tinyshakespeare.txt")
STEPS = 6


def _gpt(pdt):
    from gpt import GPT, CharDataset, GPTConfig
    from cases import TINY_GPT
    data = CharDataset(DATA)
    torch.manual_seed(1)
    model = GPT(GPTConfig(**{**TINY_GPT, "vocab_size": data.vocab_size}))
    return model, data


class _MLPUnused(torch.nn.Module):
    """The test MLP plus a layer no rank uses (find_unused_parameters=True)."""

    def __init__(self):
        super().__init__()
        from cases import MLP
        torch.manual_seed(1234)
        self.mlp = MLP()
        self.unused = torch.nn.Linear(7, 3)

    def forward(self, x, y):
        return self.mlp(x, y)


CASES = {
    # name: (model, optimizer, zeroify options, micro-steps, clip)
    "gpt-adamw-fp32-clip": ("gpt", "adamw", {}, 1, 1.0),
    "gpt-adamw-bf16": ("gpt", "adamw", dict(param_dtype="bf16", reduce_dtype="bf16"), 1, 1.0),
    "mlp-sgd-nesterov-accumulate": ("mlp", "sgd", {}, 2, None),
    "mlp-rmsprop-host-torch": ("mlp", "rmsprop", {}, 1, 0.5),
    "mlp-adam-native-reduce-scatter": ("mlp", "adam", dict(reduce_scatter="native"), 1, None),
    "mlp-adamw-unused": ("unused", "adamw", dict(find_unused_parameters=True), 1, None),
}


def _optimizer(name, params):
    return {"adamw": lambda: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1),
            "adam": lambda: torch.optim.Adam(params, lr=3e-3),
            "sgd": lambda: torch.optim.SGD(params, lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
            "rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-3, momentum=0.5)}[name]()


def _train(rank, case, stage, offload, steps=STEPS, state=None, start=0):
    """Losses, final parameters and optimizer state tensors of one run (and the run's
    objects); `state`: (model state, optimizer state) to load before training, which
    then goes on with step `start`'s batches."""
    import zero_ext
    from cases import MLP, batch
    kind, opt_name, opts, micro, clip = CASES[case]
    data = None
    if kind == "gpt":
        model, data = _gpt(opts.get("param_dtype"))
    elif kind == "unused":
        model = _MLPUnused()
    else:
        torch.manual_seed(1234)
        model = MLP()
    opt = _optimizer(opt_name, model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the host-torch-optimizer warning (tested below)
        zm, zo = zero_ext.zeroify(model, opt, stage=stage, offload=offload, bucket_bytes=8192,
                                  first_bucket_bytes=2048, **opts)
    if state is not None:
        zm.load_state_dict(state[0])
        zo.load_state_dict(state[1])
    losses = []
    for step in range(start, start + steps):
        for m in range(micro):
            if data is not None:
                x, y = data.get_batch("train", 4, model.config.block_size, torch.Generator().manual_seed(1000 * rank + 10 * step + m))
                loss = zm(x, y)[1]
            else:
                x, y = batch("mlp", rank, step, m)
                loss = zm(x, y)
            if m < micro - 1:
                with zm.no_sync():
                    loss.backward()
            else:
                loss.backward()
            losses.append(float(loss.detach()))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(zm.parameters(), clip)
        zo.step()
        zo.zero_grad()
    params = [p.detach().float().clone() for p in model.parameters()]
    flat = {}
    for key, st in _tensors(zo.state_dict()):
        flat[key] = st
    return losses, params, flat, (zm, zo)


def _tensors(obj, prefix=""):
    """(path, tensor clone) for every tensor inside a state dict."""
    if torch.is_tensor(obj):
        yield prefix, obj.detach().clone()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{k}")


def _differences(a, b, what):
    """Every difference between two runs' (losses, params, states), as messages."""
    out = []
    if a[0] != b[0]:
        out.append(f"{what}: losses differ: {a[0]} vs {b[0]}")
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        if not torch.equal(x, y):
            out.append(f"{what}: parameter {i} differs by up to {(x - y).abs().max().item():.3g}")
    if sorted(a[2]) != sorted(b[2]):
        out.append(f"{what}: optimizer state keys differ: {sorted(set(a[2]) ^ set(b[2]))}")
    for k in sorted(set(a[2]) & set(b[2])):
        if a[2][k].shape != b[2][k].shape or not torch.equal(a[2][k].float(), b[2][k].float()):
            out.append(f"{what}: optimizer state {k} differs")
    return out


def _compare_worker(rank, world, stage, cases):
    diffs = []
    for case in cases:
        ref = _train(rank, case, stage, None)
        off = _train(rank, case, stage, "cpu")
        diffs += _differences(ref, off, f"rank {rank}, stage {stage}, {case}")
        if off[3][1].stats()["offload"]["down_copies"] == 0:
            diffs.append(f"rank {rank}, {case}: the offload run made no down copy")
    return diffs


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_offload_bit_identical_one_rank(stage, case):
    """World 1, in process (no process group): every case, both stages."""
    diffs = _compare_worker(0, 1, stage, [case])
    assert not diffs, "\n".join(diffs)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_offload_bit_identical_ranks(world, stage):
    """Every case on 2 and 3 gloo ranks; every difference on every rank is reported."""
    results = run_world(_compare_worker, world, stage, sorted(CASES), reuse=True, timeout_s=600)
    diffs = [d for r in results for d in r]
    assert not diffs, "\n".join(diffs)


def _resumed(rank, case, stage, offload):
    """3 steps, model and optimizer state_dict(), fresh objects, load, 5 more steps."""
    first = _train(rank, case, stage, offload, steps=STEPS // 2)
    zm, zo = first[3]
    saved = ({k: v.clone() for k, v in zm.state_dict().items()}, zo.state_dict())
    del first, zm, zo
    return _train(rank, case, stage, offload, steps=STEPS // 2 + 2, state=saved, start=STEPS // 2)


def _resume_worker(rank, world, stage):
    diffs = []
    for case in ("gpt-adamw-fp32-clip", "gpt-adamw-bf16"):
        ref, off = _resumed(rank, case, stage, None), _resumed(rank, case, stage, "cpu")
        diffs += _differences(ref, off, f"rank {rank}, {case} resumed")
    # fp32: the resumed run is the uninterrupted one (bf16: state_dict() carries the bf16
    # parameters, not the fp32 master, with or without offload)
    case = "gpt-adamw-fp32-clip"
    straight = _train(rank, case, stage, None, steps=STEPS // 2 + STEPS // 2 + 2)
    off = _resumed(rank, case, stage, "cpu")
    diffs += _differences((straight[0][-len(off[0]):], straight[1], {}), (off[0], off[1], {}),
                          f"rank {rank}, {case} resumed vs uninterrupted")
    return diffs


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2])
def test_offload_state_dict_round_trip(stage):
    """Save after 3 offloaded steps, load into a fresh offloaded run: the next 5 steps
    equal the same round trip without offload, bit for bit, and (fp32) steps 4-8 of an
    uninterrupted run."""
    results = run_world(_resume_worker, 2, stage, reuse=True)
    diffs = [d for r in results for d in r]
    assert not diffs, "\n".join(diffs)


def _stats_worker(rank, world, stage, opts):
    import zero_ext
    from cases import MLP, batch
    torch.manual_seed(1234)
    model = MLP(d_in=101, hidden=331, d_out=7, depth=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    est = zero_ext.estimate_memory(model, world, stage, optimizer=opt, offload="cpu", bucket_bytes=65536,
                                   first_bucket_bytes=8192, **opts)
    zm, zo = zero_ext.zeroify(model, opt, stage=stage, offload="cpu", bucket_bytes=65536, first_bucket_bytes=8192,
                              **opts)
    steps = 3
    for step in range(steps):
        x, y = batch("mlp_big", rank, step, 0)
        zm(x, y).backward()
        zo.step()
        zo.zero_grad()
    s = zo.stats()
    return est, s, s["num_buckets"], steps


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opts", [{}, dict(param_dtype="bf16", reduce_dtype="bf16")], ids=["fp32", "bf16"])
def test_offload_stats_equal_estimate(stage, opts):
    """Host and device bytes of opt.stats() == estimate_memory's, byte for byte, on 3
    ranks; one down copy per bucket and backward, one up copy per bucket and step."""
    for rank, (est, s, buckets, steps) in enumerate(run_world(_stats_worker, 3, stage, opts, reuse=True)):
        host = {k: s["offload"][k] for k in est["offload"]}
        assert host == est["offload"], (rank, host, est["offload"])
        assert s["model_state_bytes"] == est["model_state_bytes"], (rank, s["model_state_bytes"],
                                                                      est["model_state_bytes"])
        assert s["model_state_bytes"]["master_weights"] == 0 and s["model_state_bytes"]["optimizer_states"] == 0
        assert (s["model_state_bytes"]["gradients"] == 0) == (stage == 2)
        assert s["offload"]["down_copies"] == buckets * steps, s["offload"]
        assert s["offload"]["up_copies"] == buckets * steps, s["offload"]
        item = 2 if opts else 4
        assert s["offload"]["up_bytes"] == s["shard_numel"] * item * steps, s["offload"]


@pytest.mark.parametrize("opts, needle", [
    (dict(stage=3), "needs stage 1 or 2"),
    (dict(stage=0), "needs stage 1 or 2"),
    (dict(stage=2, grad_quant="int8"), "grad_quant=None"),
    (dict(stage=2, param_quant="int8"), "param_quant=None"),
    (dict(stage=2, step_control=True), "step_control='auto'"),
    (dict(stage=2, offload="gpu"), "offload must be None or 'cpu'"),
])
def test_offload_bad_options_name_the_fix(opts, needle):
    import zero_ext
    from cases import MLP
    opts = dict({"offload": "cpu"}, **opts)
    model = MLP()
    with pytest.raises(ValueError, match="offload") as err:
        zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), **opts)
    assert needle in str(err.value), str(err.value)


def test_offload_unfused_optimizer_warns_once():
    import zero_ext
    from cases import MLP
    model = MLP()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        zero_ext.zeroify(model, torch.optim.RMSprop(model.parameters()), stage=2, offload="cpu")
    said = [w for w in seen if "offload='cpu' with RMSprop" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in seen]


def _too_little_memory_worker(rank, world):
    import zero_ext
    import zero_ext.offload as off
    from cases import MLP
    off.available_host_bytes = lambda: 1000   # this node "has" 1000 bytes
    model = MLP()
    try:
        zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), stage=2, offload="cpu")
    except Exception as e:   # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.dist
def test_offload_too_little_host_memory_raises_on_every_rank():
    """Found before any buffer or training collective: the bytes needed and available,
    and the fixes; the other rank hears of it through zeroify's input agreement."""
    out = run_world(_too_little_memory_worker, 2)
    assert "host memory" in out[0] and "are available" in out[0] and "offload=None" in out[0], out[0]
    assert "rejected their zeroify() inputs" in out[1] or "host memory" in out[1], out[1]
