"""Stage 3 hierarchical partitioning (node_size) on real gloo ranks: 4 ranks as 2
nodes of 2, and 3 ranks as 3 nodes of 1.

1. Exact: every mode trains in lockstep with plain stage 3 on the same batches (20
   steps; the MLPs 8), and the fp32 master shards and the gathered parameters are bit-identical
   to plain stage 3's on every rank: an MLP with a module applied twice in one forward
   (a second forward of a unit before its backward), an MLP under activation
   checkpointing (units recomputed in backward), the tiny GPT.
2. Backward gathers never cross nodes: each step the world group gathers what plain
   stage 3 gathers less exactly what the node groups gathered, and during
   loss.backward() the world group issues no all-gather (plain stage 3 does on the
   MLPs, so the check can fail).
3. With param_quant="int8" + grad_quant (int8 and int4) the hierarchical run equals
   the quantized run without it bit for bit, and after every step every rank holds
   bit-identical parameters (all ranks' gathered parameters compared).
4. stats(): secondary buffer bytes (held between forward and backward, none after
   the step), per-group counters whose intra + inter parts add up to the world
   counters, inter = (N-L)/N of them, node gathers all intra.
5. Invalid options raise ValueError naming the fix, before any collective.

Run: .venv/bin/python -m pytest -q tests/test_hier.py
"""
import os

import pytest

from cases import batch, build_model, loss_of
from dist_harness import run_world

pytestmark = pytest.mark.dist

STEPS = 20          # the GPT: 20 steps, as tests/test_parity.py
MLP_STEPS = 8       # the MLP cases (time)
UNITS = dict(unit_modules=["Linear", "Block"], min_unit_numel=0)   # as tests/test_stage3.py


def _masters(zo):
    import torch
    return torch.cat([s.reshape(-1) for s in zo._engine.param_shards()]).clone()


def _gathered(zm):
    import torch
    return torch.cat([t.float().reshape(-1) for t in zm.state_dict().values()])


def _lockstep(rank, world, kind, modes, steps):
    """Train one fresh model per mode (zeroify options) in lockstep on the same
    batches. Returns per mode: masters, gathered parameters after every step,
    all-gathers of the world / node groups during each backward, last stats."""
    import torch

    import zero_ext

    runs = {}
    for name, opts in modes.items():
        model = build_model(kind)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        runs[name] = zero_ext.zeroify(model, opt, stage=3, **UNITS, **opts)
    out = {name: {"gathered": [], "world_bwd": [], "world": [], "node": [], "peak_secondary": 0} for name in modes}

    def node(s):
        return s.get("comm_groups", {}).get("intra", {}).get("node_all_gather", {}).get("numel", 0)

    for step in range(steps):
        x, y = batch(kind, rank, step, 0)
        for name, (zm, zo) in runs.items():
            start = zo.stats()
            loss = loss_of(kind, zm, x, y)
            before = zo.stats()
            loss.backward()
            after = zo.stats()
            ag = lambda s, key: s["comm"]["all_gather"][key]
            out[name]["world_bwd"].append(ag(after, "calls") - ag(before, "calls"))   # during backward()
            out[name]["world"].append(ag(after, "numel") - ag(start, "numel"))       # forward + backward
            out[name]["node"].append(node(after) - node(start))
            out[name]["peak_secondary"] = max(out[name]["peak_secondary"], before["buffer_bytes"]["secondary"])
            zo.step()
            zo.zero_grad()
            out[name]["gathered"].append(_gathered(zm))
    for name, (zm, zo) in runs.items():
        out[name]["masters"] = _masters(zo)
        out[name]["stats"] = zo.stats()
    return out


def _invalid(rank, world):
    """A node size that does not divide the world size raises on every rank before
    the engine exists (so before any collective of the engine)."""
    import torch

    import zero_ext
    model = build_model("mlp")
    try:
        zero_ext.zeroify(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, node_size=3)
    except ValueError as e:
        return str(e)
    return None


def _worker4(rank, world):
    hier = dict(node_size=2)
    q8 = dict(param_quant="int8", grad_quant="int8", quant_block_numel=32)
    q4 = dict(param_quant="int8", grad_quant="int4", quant_block_numel=32)
    return {
        "invalid": _invalid(rank, world),
        "mlp_twice": _lockstep(rank, world, "mlp_twice", {"plain": {}, "hier": hier}, MLP_STEPS),
        "mlp_ckpt": _lockstep(rank, world, "mlp_ckpt", {"plain": {}, "hier": hier}, MLP_STEPS),
        "gpt": _lockstep(rank, world, "gpt", {"plain": {}, "hier": hier, "q8": q8, "q8_hier": {**q8, **hier},
                                             "q4_hier": {**q4, **hier}}, STEPS),
    }


def _worker3(rank, world):
    return _lockstep(rank, world, "gpt", {"plain": {}, "hier1": dict(node_size=1), "hier3": dict(node_size=3)}, 5)


@pytest.fixture(scope="module")
def four():
    return run_world(_worker4, 4, timeout_s=600, reuse=True)


def _same(a, b):
    import torch
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.int32),
                                                                      b.view(-1).view(torch.int32))


@pytest.mark.parametrize("kind", ["mlp_twice", "mlp_ckpt", "gpt"])
def test_hierarchical_is_exact(four, kind):
    for r, res in enumerate(four):
        plain, hier = res[kind]["plain"], res[kind]["hier"]
        assert _same(plain["masters"], hier["masters"]), f"{kind} rank {r}: masters differ from plain stage 3"
        for step, (a, b) in enumerate(zip(plain["gathered"], hier["gathered"])):
            assert _same(a, b), f"{kind} rank {r}: parameters differ from plain stage 3 after step {step}"
        assert not _same(res[kind]["plain"]["gathered"][0], res[kind]["plain"]["gathered"][-1])   # it trained
        # Backward gathers stay inside the node: each step, the world group gathers
        # what plain stage 3 gathers less exactly what the node groups gathered
        # (the re-gathers; some are prefetched at the end of forward), and during
        # backward() itself the world group gathers nothing.
        assert min(hier["node"]) > 0
        assert [w + n for w, n in zip(hier["world"], hier["node"])] == plain["world"], kind
        assert hier["world_bwd"] == [0] * len(plain["world_bwd"]), f"{kind} rank {r}: a backward gather crossed nodes"
        if kind != "gpt":   # the tiny GPT's backward gathers are all prefetched during forward
            assert sum(plain["world_bwd"]) > 0, f"{kind}: plain stage 3 should re-gather in backward"
        assert hier["peak_secondary"] > 0 and hier["stats"]["buffer_bytes"]["secondary"] == 0


def test_quantized_hierarchical_bit_identical(four):
    for r, res in enumerate(four):
        g = res["gpt"]
        assert _same(g["q8"]["masters"], g["q8_hier"]["masters"]), f"rank {r}: q8 + hier masters differ from q8"
        assert not _same(g["q8"]["masters"], g["plain"]["masters"])   # quantization did something
        assert g["q8_hier"]["world_bwd"] == [0] * STEPS and g["q4_hier"]["world_bwd"] == [0] * STEPS
    for mode in ("q8_hier", "q4_hier", "hier"):
        for step in range(STEPS):
            ref = four[0]["gpt"][mode]["gathered"][step]
            for r in range(1, 4):
                assert _same(ref, four[r]["gpt"][mode]["gathered"][step]), \
                    f"{mode}: rank {r}'s parameters differ from rank 0's after step {step}"


def test_group_counters(four):
    for res in four:
        s, p = res["gpt"]["hier"]["stats"], res["gpt"]["plain"]["stats"]
        groups = s["comm_groups"]
        assert groups["node_size"] == 2
        for kind, c in s["comm"].items():
            intra, inter = groups["intra"][kind], groups["inter"][kind]
            for key in ("bytes", "wire_bytes"):
                assert intra[key] + inter[key] == c[key]
                assert abs(inter[key] - c[key] // 2) <= 1   # (N-L)/N = 1/2
        node = groups["intra"]["node_all_gather"]
        # the node gathers are the backward half of plain stage 3's gathers
        assert node["bytes"] > 0 and node["bytes"] + s["comm"]["all_gather"]["bytes"] == p["comm"]["all_gather"]["bytes"]
        assert "comm_groups" not in p
        q = res["gpt"]["q4_hier"]["stats"]
        assert q["comm_groups"]["inter"]["all_gather"]["wire_bytes"] < q["comm_groups"]["inter"]["all_gather"]["bytes"] / 3


def test_invalid_node_size_raises(four):
    import zero_ext
    from zero_ext.nodes import resolve_node_size
    for res in four:
        assert res["invalid"] is not None and "does not divide the world size 4" in res["invalid"]
    with pytest.raises(ValueError, match="stage 3"):
        zero_ext.ZeroConfig(stage=2, node_size=2)
    with pytest.raises(ValueError, match="node_size must be >= 1"):
        zero_ext.ZeroConfig(stage=3, node_size=0)
    old = os.environ.pop("LOCAL_WORLD_SIZE", None)
    try:
        with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
            resolve_node_size("auto", 4)
        os.environ["LOCAL_WORLD_SIZE"] = "2"
        assert resolve_node_size("auto", 4) == 2
        assert resolve_node_size(4, 4) is None and resolve_node_size(2, 1) is None
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if old is not None:
            os.environ["LOCAL_WORLD_SIZE"] = old


def test_three_ranks_node_sizes_1_and_3():
    res = run_world(_worker3, 3, timeout_s=300, reuse=True)
    for r, out in enumerate(res):
        for mode in ("hier1", "hier3"):
            assert _same(out["plain"]["masters"], out[mode]["masters"]), f"{mode} rank {r}: masters differ"
        assert out["hier1"]["world_bwd"] == [0] * 5 and min(out["hier1"]["node"]) > 0
        assert [w + n for w, n in zip(out["hier1"]["world"], out["hier1"]["node"])] == out["plain"]["world"]
        assert "comm_groups" not in out["hier3"]["stats"]   # node_size == world: plain stage 3
