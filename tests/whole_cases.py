"""Training cases for optimizers that need whole tensors (torch.optim.Muon,
torch.optim.Adafactor): DDP + the torch optimizers (the reference), the same
reference with gradients summed in another order (the noise floor of the
reference itself), and zero_ext, side by side on the same data."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from cases import batch, build_model, loss_of


@dataclass
class WholeCase:
    name: str
    model: str = "gpt"               # "gpt" | "mlp"
    recipe: str = "muon"             # "muon": Muon(hidden matrices) + AdamW(rest); "adafactor": Adafactor(all)
    stage: int = 2
    steps: int = 20
    clip: float | None = None
    scheduler: bool = False          # StepLR(step_size=5, gamma=0.5) on every optimizer
    config: dict = field(default_factory=dict)


def hidden_matrices(model: nn.Module) -> set:
    """The parameters Muon takes in the usual recipe: 2-D weights that are not
    embeddings or the (tied) output head."""
    skip = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {id(p) for p in model.parameters() if p.ndim == 2 and id(p) not in skip}


def make_optimizers(recipe: str, model: nn.Module) -> list:
    if recipe == "adafactor":
        return [torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.01)]
    hidden = hidden_matrices(model)
    mats = [p for p in model.parameters() if id(p) in hidden]
    rest = [p for p in model.parameters() if id(p) not in hidden]
    # AdamW(fused=True): torch's fused CPU kernel, which zero_ext's equals bit for bit (tests/cases.py)
    return [torch.optim.Muon(mats, lr=2e-2, weight_decay=0.1, momentum=0.95),
            torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.1, fused=True)]


class NSCounter:
    """Counts torch's Newton-Schulz calls (one per matrix orthogonalized) while on."""

    def __init__(self):
        import torch.optim._muon as muon
        self.module, self.original, self.count, self.on = muon, muon._zeropower_via_newtonschulz, 0, False

        def counted(*args, **kwargs):
            if self.on:
                self.count += 1
            return self.original(*args, **kwargs)

        muon._zeropower_via_newtonschulz = counted

    def close(self):
        self.module._zeropower_via_newtonschulz = self.original


def _reverse_order_allreduce(model: nn.Module, world: int) -> None:
    """The reference's noise floor: average gradients as DDP would, but summed in
    reverse rank order (a different, equally valid rounding)."""
    for p in model.parameters():
        if p.grad is None:
            continue
        parts = [torch.empty_like(p.grad) for _ in range(world)]
        dist.all_gather(parts, p.grad)
        total = torch.zeros_like(p.grad)
        for t in reversed(parts):
            total += t
        p.grad.copy_(total / world)


def _rel(a: nn.Module | dict, b: dict) -> float:
    worst = 0.0
    for name, t in (a.named_parameters() if isinstance(a, nn.Module) else a.items()):
        t = t.detach().float()
        u = b[name].detach().float()
        worst = max(worst, ((t - u).norm() / t.norm().clamp_min(1e-30)).item())
    return worst


def train_whole(case: WholeCase, rank: int, world: int):
    import zero_ext

    ref = build_model(case.model)
    floor_model = copy.deepcopy(ref)
    mine = copy.deepcopy(ref)
    ddp = nn.parallel.DistributedDataParallel(ref) if world > 1 else ref
    opts_ref = make_optimizers(case.recipe, ref)
    opts_floor = make_optimizers(case.recipe, floor_model)
    given = make_optimizers(case.recipe, mine)
    zm, zos = zero_ext.zeroify(mine, given if len(given) > 1 else given[0], stage=case.stage, **case.config)
    zos = zos if isinstance(zos, list) else [zos]
    scheds = []
    if case.scheduler:
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in opts_ref + opts_floor + zos]
    counter = NSCounter()
    ns_per_step, comm, losses, norms = [], [], [], []
    try:
        for step in range(case.steps):
            x, y = batch(case.model, rank, step, 0)
            loss_of(case.model, ddp, x, y).backward()
            loss_of(case.model, floor_model, x, y).backward()
            if world > 1:
                _reverse_order_allreduce(floor_model, world)
            loss = loss_of(case.model, zm, x, y)
            loss.backward()
            losses.append(loss.item())
            if case.clip is not None:
                n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), case.clip)
                torch.nn.utils.clip_grad_norm_(floor_model.parameters(), case.clip)
                norms.append((float(n_ref), float(zos[0].clip_grad_norm_(case.clip))))
            for o in opts_ref + opts_floor:
                o.step()
                o.zero_grad()
            before = counter.count
            counter.on = True
            for o in zos:
                o.step()
            counter.on = False
            for o in zos:
                o.zero_grad()
            ns_per_step.append(counter.count - before)
            for s in scheds:
                s.step()
            c = zos[0].stats()["comm"]
            comm.append({k: (v["calls"], v["numel"]) for k, v in c.items()})
    finally:
        counter.close()
    dtype = next(mine.parameters()).dtype
    mine_sd = zm.state_dict()
    start = build_model(case.model).state_dict()
    stats = zos[0].stats()
    return {
        "rel": _rel(ref, mine_sd), "floor": _rel(ref, dict(floor_model.named_parameters())),
        "equal": all(torch.equal(p.detach(), mine_sd[n]) for n, p in ref.named_parameters()),
        "moved": sum((mine_sd[n] - start[n]).abs().sum().item() for n, _ in ref.named_parameters()),
        "ns_per_step": ns_per_step, "comm": comm, "stats": stats, "losses": losses, "norms": norms,
        "matrices": len(hidden_matrices(ref)) if case.recipe == "muon" else 0, "dtype": dtype,
        "psi": sum(p.numel() for p in ref.parameters()),
        "lrs": [[g["lr"] for g in o.param_groups] for o in zos],
        "lrs_ref": [[g["lr"] for g in o.param_groups] for o in opts_ref],
    }


def run_whole_cases(rank: int, world: int, cases: list):
    out = {}
    for case in cases:
        out[case.name] = train_whole(case, rank, world)
        if dist.is_initialized():
            dist.barrier()
    return out
