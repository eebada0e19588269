"""One training run of a small case with zeroify options, for the tests that check that a
way of running the same maths (offload="cpu", step_in_backward=True) changes no bit:
they train each case twice and compare with differences().

    run = train(rank, stage, kind="gpt", opt="adamw", clip=1.0, offload="cpu")
    run.losses, run.params (gathered in stage 3), run.states (optimizer state tensors), run.stats
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from dist_harness import ROOT

DATA = os.path.join(ROOT, "examples", "data", "tinyshakespeare.txt")


class MLPUnused(torch.nn.Module):
    """The test MLP plus a layer no rank uses (find_unused_parameters=True)."""

    def __init__(self):
        super().__init__()
        from cases import MLP
        torch.manual_seed(1234)
        self.mlp = MLP()
        self.unused = torch.nn.Linear(7, 3)

    def forward(self, x, y):
        return self.mlp(x, y)


def optimizer(name: str, params):
    return {"adamw": lambda: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1),
            "adam": lambda: torch.optim.Adam(params, lr=3e-3),
            "sgd": lambda: torch.optim.SGD(params, lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
            "rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-3, momentum=0.5)}[name]()


@dataclass
class Run:
    losses: list
    params: list
    states: dict
    stats: dict
    objects: tuple   # (model, optimizer, scheduler or None) as zeroify returned them


def train(rank: int, stage: int, *, kind: str = "mlp", opt: str = "adamw", steps: int = 6, micro: int = 1,
          clip: float | None = None, sched_every: int | None = None, state=None, start: int = 0, **opts) -> Run:
    """`steps` optimizer steps of `micro` micro-steps each (no_sync but the last), from the
    same start on every call; state: (model, optimizer[, scheduler]) state dicts loaded
    first, training then going on with step `start`'s batches."""
    import zero_ext
    from cases import MLP, TINY_GPT, batch
    from gpt import GPT, CharDataset, GPTConfig
    data = None
    if kind == "gpt":
        data = CharDataset(DATA)
        torch.manual_seed(1)
        model = GPT(GPTConfig(**{**TINY_GPT, "vocab_size": data.vocab_size}))
    elif kind == "unused":
        model = MLPUnused()
    else:
        torch.manual_seed(1234)
        model = MLP()
    o = optimizer(opt, model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # offload's host-torch-optimizer warning (tested on its own)
        zm, zo = zero_ext.zeroify(model, o, stage=stage, bucket_bytes=8192, first_bucket_bytes=2048, **opts)
    sched = torch.optim.lr_scheduler.StepLR(zo, step_size=sched_every, gamma=0.7) if sched_every else None
    if state is not None:
        zm.load_state_dict(state[0])
        zo.load_state_dict(state[1])
        if sched is not None:
            sched.load_state_dict(state[2])
    losses = []
    for step in range(start, start + steps):
        for m in range(micro):
            if data is not None:
                g = torch.Generator().manual_seed(1000 * rank + 10 * step + m)
                x, y = data.get_batch("train", 4, model.config.block_size, g)
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
        if sched is not None:
            sched.step()
    with zero_ext.gathered_parameters(model):   # stage 3: whole only inside
        params = [p.detach().float().clone() for p in model.parameters()]
    assert all(p.numel() > 0 for p in params)
    states = dict(tensors(zo.state_dict()))
    return Run(losses, params, states, zo.stats(), (zm, zo, sched))


def saved(run: Run) -> tuple:
    """The run's model, optimizer and scheduler state dicts, as a script saves them."""
    zm, zo, sched = run.objects
    return ({k: v.clone() for k, v in zm.state_dict().items()}, zo.state_dict(),
            sched.state_dict() if sched is not None else None)


def tensors(obj, prefix=""):
    """(path, tensor clone) for every tensor inside a state dict."""
    if torch.is_tensor(obj):
        yield prefix, obj.detach().clone()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            yield from tensors(v, f"{prefix}/{k}")


def differences(a: Run, b: Run, what: str, states: bool = True) -> list:
    """Every difference between two runs (losses, parameters, optimizer states), as messages."""
    out = []
    if a.losses != b.losses:
        out.append(f"{what}: losses differ: {a.losses} vs {b.losses}")
    for i, (x, y) in enumerate(zip(a.params, b.params)):
        if not torch.equal(x, y):
            out.append(f"{what}: parameter {i} differs by up to {(x - y).abs().max().item():.3g}")
    if states:
        if sorted(a.states) != sorted(b.states):
            out.append(f"{what}: optimizer state keys differ: {sorted(set(a.states) ^ set(b.states))}")
        for k in sorted(set(a.states) & set(b.states)):
            x, y = a.states[k], b.states[k]
            if x.shape != y.shape or not torch.equal(x.float(), y.float()):
                out.append(f"{what}: optimizer state {k} differs")
    return out


def estimate_and_stats(rank: int, world: int, stage: int, *, opt: str = "adamw", steps: int = 3, **opts) -> tuple:
    """(estimate_memory(...), opt.stats() after `steps` steps) of the same zeroify options on
    the larger MLP (d_in 101, hidden 331, depth 4; AdamW at lr 1e-3 unless opt names another),
    with 64 KiB buckets (8 KiB first): the memory tests of the modes compare them."""
    import zero_ext
    from cases import MLP, batch
    torch.manual_seed(1234)
    model = MLP(d_in=101, hidden=331, d_out=7, depth=4)
    o = torch.optim.AdamW(model.parameters(), lr=1e-3) if opt == "adamw" else optimizer(opt, model.parameters())
    kw = dict(dict(bucket_bytes=65536, first_bucket_bytes=8192), **opts)
    est = zero_ext.estimate_memory(model, world, stage, optimizer=o, **kw)
    zm, zo = zero_ext.zeroify(model, o, stage=stage, **kw)
    for step in range(steps):
        x, y = batch("mlp_big", rank, step, 0)
        zm(x, y).backward()
        zo.step()
        zo.zero_grad()
    return est, zo.stats()
