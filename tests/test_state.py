"""Optimizer and model state: a same-world-size state_dict round trip resumes
training bit for bit; model.state_dict() has the plain module's keys; ZeroConfig
comes from keywords, dicts and JSON files."""
import json

import pytest
import torch

from dist_harness import run_world


def _train(zm, zo, kind, rank, steps, start):
    from cases import batch, loss_of
    for step in range(start, start + steps):
        x, y = batch(kind, rank, step, 0)
        loss_of(kind, zm, x, y).backward()
        zo.clip_grad_norm_(0.5)
        zo.step()
        zo.zero_grad()


def _round_trip_worker(rank, world, stage, opt_name, fused):
    import zero_ext
    from cases import build_model

    def fresh():
        model = build_model("gpt")
        opt = getattr(torch.optim, opt_name)(model.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR
        zm, zo = zero_ext.zeroify(model, opt, stage=stage, fused=fused)
        return model, zm, zo, sched(zo, step_size=3, gamma=0.5)

    model, zm, zo, sched = fresh()               # uninterrupted: 12 steps
    for k in range(4):
        _train(zm, zo, "gpt", rank, 3, 3 * k)
        sched.step()
    straight = [p.detach().clone() for p in model.parameters()]

    model, zm, zo, sched = fresh()               # 6 steps, save, rebuild, load, 6 more
    for k in range(2):
        _train(zm, zo, "gpt", rank, 3, 3 * k)
        sched.step()
    complete, sharded = zo.state_dict(), zo.sharded_state_dict()
    saved = (zm.state_dict(), sharded, sched.state_dict())
    assert set(saved[0]) == set(build_model("gpt").state_dict()), "model keys are the plain module's"
    diffs = []
    for opt_state in (complete, sharded):      # the complete form and this rank's shard
        model, zm, zo, sched = fresh()
        zm.load_state_dict(saved[0])
        zo.load_state_dict(opt_state)
        sched.load_state_dict(saved[2])
        for k in range(2, 4):
            _train(zm, zo, "gpt", rank, 3, 3 * k)
            sched.step()
        resumed = [p.detach().clone() for p in model.parameters()]
        diffs.append(max((a - b).abs().max().item() for a, b in zip(straight, resumed)))
    diff = max(diffs)
    moved = max((a - b).abs().max().item() for a, b in zip(straight, build_model("gpt").parameters()))
    # a shard loaded into another world size / stage is refused with a clear message
    other = dict(saved[1])
    other["zero_ext"] = dict(other["zero_ext"], world_size=world + 1)
    try:
        zo.load_state_dict(other)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"diff": diff, "moved": moved, "refused": refused, "lr": zo.param_groups[0]["lr"]}


COMBOS = [(stage, opt, fused) for stage in (0, 1, 2)
          for opt, fused in (("AdamW", "auto"), ("SGD", "auto"), ("RMSprop", "never"))]


def _round_trips(rank, world):
    return {c: _round_trip_worker(rank, world, *c) for c in COMBOS}


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_state_dict_round_trip(world):
    for rank, res in enumerate(run_world(_round_trips, world, reuse=True)):
        for (stage, opt_name, fused), r in res.items():
                name = f"world {world} stage {stage} {opt_name} rank {rank}"
                assert r["moved"] > 1e-4, name
                assert r["diff"] == 0.0, f"{name}: resumed run differs by {r['diff']}"
                assert "cannot load" in r["refused"], name
                assert r["lr"] == pytest.approx(3e-3 * 0.5 ** (4 // 3)), name   # StepLR(3, 0.5), 4 epochs


def test_config_sources(tmp_path):
    from zero_ext import ZeroConfig
    from zero_ext.config import make_config

    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"stage": 1, "bucket_bytes": 65536}))
    a = ZeroConfig.from_json(str(path))
    b = ZeroConfig.from_dict({"stage": 1, "bucket_bytes": 65536})
    c = make_config(str(path), None, {"reduce_scatter": "native"})
    assert a == b and a.stage == 1 and a.bucket_bytes == 65536
    assert c.stage == 1 and c.reduce_scatter == "native"
    assert make_config(a, 2, {}).stage == 2          # keyword stage wins
    with pytest.raises(ValueError, match="unknown config option 'stagee'"):
        ZeroConfig.from_dict({"stagee": 1})
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ZeroConfig.from_json(str(path))
    with pytest.raises(TypeError, match="overlap_param_gather must be True or False"):
        ZeroConfig(overlap_param_gather="yes")
    assert ZeroConfig().resolved_align(8) == 16 and ZeroConfig().resolved_align(1024) == 1


def test_config_keeps_its_process_group():
    """A ZeroConfig holding a process group, which cannot be deep-copied, merges and serializes."""
    import threading

    from zero_ext import ZeroConfig
    from zero_ext.config import make_config

    group = threading.Lock()   # stands for a ProcessGroup: neither can be deep-copied
    config = ZeroConfig(process_group=group)
    assert make_config(config, 3, {}).process_group is group
    assert "process_group" not in config.to_dict() and config.to_dict()["stage"] == 2


def test_single_process_without_process_group():
    """No process group: world size 1, no collectives, same maths as the torch optimizer."""
    import copy

    import torch.distributed as dist

    import zero_ext
    from cases import MLP

    assert not dist.is_initialized()
    torch.manual_seed(0)
    ref = MLP()
    mine = copy.deepcopy(ref)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    zm, zo = zero_ext.zeroify(mine, torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9), stage=2)
    for _ in range(5):
        x, y = torch.randn(4, 13), torch.randn(4, 5)
        ref(x, y).backward()
        zm(x, y).backward()
        o_ref.step(), o_ref.zero_grad(), zo.step(), zo.zero_grad()
    for a, b in zip(ref.parameters(), mine.parameters()):
        assert torch.equal(a, b)
    s = zo.stats()
    assert s["world_size"] == 1 and s["comm_bytes"] == 0
    assert "bucket" in zo.describe_plan()


@pytest.mark.parametrize("stage", [2, 3])
def test_wrappers_are_freed(stage):
    """No reference cycle through C++ keeps the engine (and so the process group's
    buffers) alive after the user drops the model and optimizer."""
    import gc
    import weakref

    import zero_ext
    from cases import MLP

    model = MLP()
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), stage=stage,
                              unit_modules=["Linear"] if stage == 3 else None)
    zm(torch.randn(4, 13), torch.randn(4, 5)).backward()
    zo.step()
    refs = [weakref.ref(zm), weakref.ref(zo), weakref.ref(zo._engine)]
    del zm, zo, model
    gc.collect()
    assert all(r() is None for r in refs), "zeroify's objects outlive their last user reference"


def _rank0_file_worker(rank, world, path):
    import torch.distributed as dist

    import zero_ext
    model = torch.nn.Linear(8, 8)
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=2)
    zm(torch.randn(4, 8)).sum().backward()
    zo.step()
    if rank == 0:                                  # rank 0's shard, written by rank 0 alone
        torch.save(zo.sharded_state_dict(), path)
    dist.barrier()
    try:
        zo.load_state_dict(torch.load(path, weights_only=False))   # every rank resumes from it
        return None
    except ValueError as e:
        return str(e)


@pytest.mark.dist
def test_rank0_optimizer_file_is_refused_elsewhere(tmp_path):
    """sharded_state_dict() is this rank's shard: a file rank 0 alone wrote loads on rank 0
    and is refused on every other rank, naming optimizer.state_dict() and zero_ext.save.
    (tests/test_ddp_checkpoint.py: the complete state_dict() that DDP scripts save.)"""
    errors = run_world(_rank0_file_worker, 2, str(tmp_path / "opt.pt"))
    assert errors[0] is None, errors[0]
    assert errors[1] is not None and "rank 0 alone" in errors[1], errors[1]
    assert "zero_ext.save" in errors[1] and "optimizer.state_dict() on every rank" in errors[1], errors[1]


def _bf16_round_trip_worker(rank, world, stage):
    """bf16 parameters: model.state_dict() holds the bf16 copy, so the fp32 masters travel in
    the complete optimizer state ("master_weights"): model then optimizer (the usual order)
    resumes bit for bit; optimizer then model takes the model's bf16 values as the masters
    (model.load_state_dict writes what it is given), so it differs (the control)."""
    import zero_ext
    from cases import build_model

    def fresh():
        model = build_model("gpt")
        zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=3e-3), stage=stage,
                                  param_dtype="bf16", reduce_dtype="bf16")
        return model, zm, zo

    def params(model):
        with zero_ext.gathered_parameters(model):
            return [p.detach().float().clone() for p in model.parameters()]

    model, zm, zo = fresh()
    _train(zm, zo, "gpt", rank, 6, 0)
    straight = params(model)
    model, zm, zo = fresh()
    _train(zm, zo, "gpt", rank, 3, 0)
    saved = ({k: v.clone() for k, v in zm.state_dict().items()}, zo.state_dict())
    has_masters = "master_weights" in saved[1]["zero_ext_complete"]
    diffs = []
    for model_first in (True, False):
        model, zm, zo = fresh()
        if model_first:
            zm.load_state_dict(saved[0])
            zo.load_state_dict(saved[1])
        else:
            zo.load_state_dict(saved[1])
            zm.load_state_dict(saved[0])
        _train(zm, zo, "gpt", rank, 3, 3)
        diffs.append(max((a - b).abs().max().item() for a, b in zip(straight, params(model))))
    return has_masters, diffs


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_state_dict_pair_keeps_fp32_masters(stage):
    for rank, (has_masters, diffs) in enumerate(run_world(_bf16_round_trip_worker, 2, stage, reuse=True)):
        assert has_masters, "the complete optimizer state has no master_weights with bf16 parameters"
        assert diffs[0] == 0.0, f"rank {rank}: resumed parameters differ by {diffs[0]} (model, then optimizer)"
        assert diffs[1] > 0.0, f"rank {rank}: the control (optimizer, then model) did not differ"
