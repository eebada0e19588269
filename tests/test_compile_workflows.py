"""A DDP script's habits on a model compiled with fullgraph=True: tests/test_rank_alone.py's
nanoGPT-style script (rank 0 alone evaluates under model.eval() and writes the checkpoint
from `model.module.state_dict()` and `optimizer.state_dict()`, torch's clip_grad_norm_
every step, a resume from that file after wrapping), where the wrapper line is
`torch.compile(zeroify(...), fullgraph=True)` against `torch.compile(DDP(model))`. Stage 3
with compile_units="whole" (rank 0's evaluation gathers every unit from the other ranks'
shard servers; stages 0-2 hold whole parameters) at 2 gloo ranks: every training loss, rank
0's evaluation, the file it wrote and the resumed run follow compiled DDP's within 1e-5
(fp32); dynamo counts no graph break. And GradScaler steps (scale, unscale_,
opt.clip_grad_norm_, step, update; one step skipped for an inf) of the compiled stage-3
model follow compiled DDP's with torch's clip. Stage 2 passes both too (about twice the
time: run with STAGES = (2, 3)).
"""
import os

import pytest
import torch

from dist_harness import run_world
from test_compile import _own_inductor_cache
from test_rank_alone import EVAL_EVERY, REL, _close, _dir, _flat_states, _rel, _script

pytestmark = pytest.mark.dist

STAGES = (3,)


def _compiled(stage):
    """The wrapper line: compiled DDP (stage None), or zeroify then torch.compile(fullgraph=True)."""
    def wrap(model, opt):
        if stage is None:
            from torch.nn.parallel import DistributedDataParallel as DDP
            return torch.compile(DDP(model)), opt
        import zero_ext
        options = {"compile_units": "whole", "min_unit_numel": 0} if stage == 3 else {}
        zm, zo = zero_ext.zeroify(model, opt, stage=stage, **options)
        return torch.compile(zm, fullgraph=True), zo
    return wrap


def _runs(rank, world, tmp):
    from torch._dynamo.utils import counters
    _own_inductor_cache()
    torch._dynamo.reset()
    out = {"ddp": _script(rank, world, _compiled(None), _dir(tmp, "ddp", rank))}
    out["ddp_resumed"] = _script(rank, world, _compiled(None), _dir(tmp, "ddp-resumed", rank),
                                 resume=os.path.join(tmp, "ddp", f"ckpt{EVAL_EVERY}.pt"))
    for stage in STAGES:
        name, wrap = f"s{stage}", _compiled(stage)
        counters.clear()
        out[name] = {"alone": _script(rank, world, wrap, _dir(tmp, name, rank))}
        out[name]["breaks"] = dict(counters["graph_break"])
        first = os.path.join(tmp, name, f"ckpt{EVAL_EVERY}.pt")
        out[name]["resumed"] = _script(rank, world, wrap, _dir(tmp, name + "-resumed", rank), resume=first)
    return out


def test_compiled_script_evaluates_checkpoints_and_resumes_as_compiled_ddp(tmp_path):
    outs = run_world(_runs, 2, str(tmp_path), timeout_s=900)
    ddp_file = torch.load(outs[0]["ddp"]["files"][0], weights_only=False)
    for stage in STAGES:
        name = f"s{stage}"
        for rank, out in enumerate(outs):
            r = out[name]
            assert r["breaks"] == {}, f"{name} rank {rank}: graph breaks {r['breaks']}"
            _close(f"{name} rank {rank} train", r["alone"]["train"], out["ddp"]["train"])
            _close(f"{name} rank {rank} resumed", r["resumed"]["train"], out["ddp_resumed"]["train"])
        alone = outs[0][name]["alone"]
        assert len(alone["eval"]) == len(outs[0]["ddp"]["eval"]) > 0
        for got, want in zip(alone["eval"], outs[0]["ddp"]["eval"]):
            _close(f"{name} rank 0's evaluation", got, want)
        first = torch.load(alone["files"][0], weights_only=False)
        assert first["model"].keys() == ddp_file["model"].keys()
        for k, t in ddp_file["model"].items():
            assert _rel(first["model"][k], t) <= REL, f"{name}: model {k} vs compiled DDP's file"
        sd, sp = _flat_states(ddp_file["optimizer"]), _flat_states(first["optimizer"])
        assert sd.keys() == sp.keys() and sd
        for key, t in sd.items():
            assert _rel(sp[key].float(), t.float()) <= 1e-4, f"{name}: optimizer {key} vs compiled DDP's file"


def _scaled(rank, world):
    """Four GradScaler steps (an inf in the second, so one step is skipped) of a compiled model."""
    import zero_ext
    from cases import batch, build_model, loss_of
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP
    _own_inductor_cache()
    torch._dynamo.reset()
    out = {}
    for system in ("ddp",) + STAGES:
        torch.manual_seed(0)
        model = build_model("gpt")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if system == "ddp":
            run = torch.compile(DDP(model))
            clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # noqa: E731
        else:
            options = {"compile_units": "whole", "min_unit_numel": 0} if system == 3 else {}
            zm, opt = zero_ext.zeroify(model, opt, stage=system, **options)
            run = torch.compile(zm, fullgraph=True)
            clip = lambda: opt.clip_grad_norm_(1.0)   # noqa: E731
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        counters.clear()
        losses, scales = [], []
        for it in range(4):
            x, y = batch("gpt", rank, it, 0)
            loss = loss_of("gpt", run, x, y)
            scaled = scaler.scale(loss) * (float("inf") if it == 1 else 1.0)
            scaled.backward()
            scaler.unscale_(opt)
            clip()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            scales.append(scaler.get_scale())
        out[system] = {"losses": losses, "scales": scales, "breaks": dict(counters["graph_break"])}
    return out


def test_compiled_grad_scaler_steps_as_compiled_ddp():
    for rank, out in enumerate(run_world(_scaled, 2, timeout_s=600)):
        ddp = out["ddp"]
        assert ddp["scales"][1] < ddp["scales"][0], "the inf step did not lower DDP's scale"
        for stage in STAGES:
            got = out[stage]
            assert got["breaks"] == {}, f"stage {stage} rank {rank}: graph breaks {got['breaks']}"
            assert got["scales"] == ddp["scales"], f"stage {stage} rank {rank}: scales {got['scales']}"
            _close(f"stage {stage} rank {rank} GradScaler losses", got["losses"], ddp["losses"])
