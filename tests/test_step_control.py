"""The step control (Note [Step control], csrc/core/zx_step_control.h): the fused
step's clip factor, inf/nan verdict, loss-scale update and step counts kept in the
parameters' memory, so that a GPU step reads nothing back to the host. On a GPU it
runs as one-thread CUDA kernels; here the same C rules run on CPU tensors
(step_control=True), on real gloo ranks, against the host path (step_control=False):

  - fp16 with dynamic loss scaling, an inf injected on one rank, Adam and SGD with
    momentum (whose first step is the first one not skipped): parameters, optimizer
    state, step counts, scales and skip counts equal the host path's bit for bit;
  - with clip_grad_norm_ every step: the returned norms equal the host path's within
    1e-6 relative and the parameters within 1e-6 relative (the norm is accumulated in
    another order: float out2 rather than a host double);
  - a checkpoint round trip (state_dict / load_state_dict) carries the device scaler
    and step counts.
"""
import pytest

from dist_harness import run_world

pytestmark = pytest.mark.dist


def _worker(rank, world, stage, opt_name, step_control, clip):
    import torch

    import zero_ext
    from cases import batch, build_model, loss_of

    torch.manual_seed(0)
    model = build_model("mlp")
    if opt_name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, dampening=0.1)
    zm, zo = zero_ext.zeroify(model, opt, stage=stage, param_dtype="fp16", loss_scale="dynamic",
                              initial_loss_scale=2.0 ** 8, loss_scale_growth_interval=2,
                              loss_scale_hysteresis=2, min_unit_numel=0, step_control=step_control)
    assert (zo.step_control is not None) == step_control
    target = list(model.parameters())[0]
    bad = {0, 3, 4}                  # step 0 overflows: SGD's first real step is step 1
    norms, scales, skipped = [], [], []
    for step in range(8):
        x, y = batch("mlp", rank, step, 0)
        handle = None
        if step in bad and rank == world - 1:
            handle = target.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), float("inf")))
        zo.backward(loss_of("mlp", zm, x, y))
        if handle is not None:
            handle.remove()
        if clip:
            norms.append(float(zo.clip_grad_norm_(0.05)))
        zo.step()
        zo.zero_grad()
        scales.append(zo.loss_scale)
        skipped.append(zo.skipped_steps)
    sd = zo.sharded_state_dict()
    z = sd["zero_ext"]
    # Round trip: a fresh optimizer loads the state and reports the same scaler and steps.
    model2 = build_model("mlp")
    opt2 = type(opt)(model2.parameters(), **{k: v for k, v in opt.defaults.items() if k in ("lr",)})
    zm2, zo2 = zero_ext.zeroify(model2, opt2, stage=stage, param_dtype="fp16", loss_scale="dynamic",
                                initial_loss_scale=2.0 ** 8, loss_scale_growth_interval=2,
                                loss_scale_hysteresis=2, min_unit_numel=0, step_control=step_control)
    zo2.load_state_dict(sd)
    with zero_ext.gathered_parameters(zm):
        params = [p.detach().clone() for p in zm.module.parameters()]
    return {"params": params, "states": {k: v.clone() for k, v in zo._engine.states().items()},
            "shards": [s.clone() for s in zo._engine.param_shards()], "norms": norms, "scales": scales,
            "skipped": skipped, "steps": list(z["steps"]), "scaler": z["loss_scaler"],
            "reloaded": (zo2.loss_scale, zo2.skipped_steps, list(zo2.group_steps), zo2.scaler_state_dict())}


def _both_paths(rank, world, stage, opt_names, clip):
    """Every optimizer in opt_names on the host path and with the step control, in one
    world (one launch instead of four: the processes' start-up dominates)."""
    return {(name, ctl): _worker(rank, world, stage, name, ctl, clip)
            for name in opt_names for ctl in (False, True)}


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("stage,world", [(0, 2), (1, 3), (2, 2), (3, 3)])
def test_step_control_equals_host_path(stage, world):
    runs = run_world(_both_paths, world, stage, ("adamw", "sgd"), False, timeout_s=300, reuse=True)
    for opt_name in ("adamw", "sgd"):
        for r, run in enumerate(runs):
            h, d = run[(opt_name, False)], run[(opt_name, True)]
            _check_equal(h, d, f"stage {stage}, rank {r}/{world}, {opt_name}")


def _check_equal(h, d, tag):
    assert d["skipped"] == h["skipped"] and h["skipped"][-1] == 3, f"{tag}: skipped {d['skipped']} vs {h['skipped']}"
    assert d["scales"] == h["scales"], f"{tag}: scales {d['scales']} vs {h['scales']}"
    assert d["steps"] == h["steps"] == [5], f"{tag}: steps {d['steps']} vs {h['steps']}"
    assert d["scaler"] == h["scaler"], f"{tag}: scaler state"
    for a, b in zip(d["shards"], h["shards"]):
        assert a.equal(b), f"{tag}: master shards differ"
    for k in h["states"]:
        assert d["states"][k].equal(h["states"][k]), f"{tag}: optimizer state {k} differs"
    for a, b in zip(d["params"], h["params"]):
        assert a.equal(b), f"{tag}: parameters differ"
    assert d["reloaded"] == h["reloaded"] and d["reloaded"][2] == [5], f"{tag}: reload {d['reloaded']}"


@pytest.mark.parametrize("stage,world", [(1, 2), (3, 3)])
def test_step_control_clipping_matches_host_path(stage, world):
    runs = run_world(_both_paths, world, stage, ("adamw",), True, timeout_s=300, reuse=True)
    for r, run in enumerate(runs):
        h, d = run[("adamw", False)], run[("adamw", True)]
        tag = f"stage {stage}, rank {r}/{world}"
        assert len(d["norms"]) == 8
        for s, (a, b) in enumerate(zip(d["norms"], h["norms"])):
            if s in (0, 3, 4):
                assert a == b == float("inf"), f"{tag} step {s}: an overflowing step's norm is inf ({a}, {b})"
            else:
                assert abs(a - b) <= 1e-6 * b, f"{tag} step {s}: norm {a} vs host {b}"
        assert d["skipped"] == h["skipped"] and d["scales"] == h["scales"]
        for a, b in zip(d["params"], h["params"]):
            assert _rel(a, b) <= 1e-6, f"{tag}: parameters {_rel(a, b):.2e} from the host path"
