"""The fused steps read the optimizer's param groups as they are at each step (Note
[Hyperparameters] in csrc/kernels_binding.h): per-group options, a tensor lr, Adam's
decoupled_weight_decay, amsgrad, maximize, SGD's dampening and Nesterov, an LR scheduler
and hand edits between steps all act as in the plain torch optimizer.

World size 1, in process: the zeroified model (stage 1, fp32) trains beside a copy with the
plain torch optimizer (foreach=False) on the same batches; after every step the parameters
must agree within test_parity.py's bounds, and must move.
"""
import copy

import pytest
import torch

import zero_ext
from test_parity import ADAMW_REL, SGD_ABS

STEPS = 6


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.a = torch.nn.Linear(12, 16)
        self.b = torch.nn.Linear(16, 5)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).square().mean()


def _groups(model, first: dict, second: dict) -> list:
    return [dict(params=list(model.a.parameters()), **first), dict(params=list(model.b.parameters()), **second)]


CASES = {
    # name: (optimizer class, group 0 options, group 1 options, between steps: fn(opt, step))
    "adamw-two-groups": (torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.1, betas=(0.8, 0.95)),
                         dict(lr=1e-2, weight_decay=0.0, eps=1e-6), None),
    "adam-decoupled-amsgrad-maximize": (torch.optim.Adam, dict(lr=2e-3, weight_decay=0.05,
                                                               decoupled_weight_decay=True, amsgrad=True),
                                        dict(lr=4e-3, maximize=True, weight_decay=0.01), None),
    "adamw-tensor-lr": (torch.optim.AdamW, dict(lr=torch.tensor(3e-3)), dict(lr=torch.tensor(1e-3)), None),
    "adamw-lr-edited": (torch.optim.AdamW, dict(lr=3e-3), dict(lr=3e-3),
                        lambda opt, step: opt.param_groups[step % 2].update(lr=1e-3 * (step + 1),
                                                                            betas=(0.9 - 0.05 * step, 0.99))),
    "sgd-dampening-nesterov": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, dampening=0.2, weight_decay=0.01),
                               dict(lr=2e-2, momentum=0.8, nesterov=True, maximize=True), None),
    "sgd-scheduler": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9), dict(lr=5e-2),
                      "scheduler"),
}


def _run(case: str):
    cls, g0, g1, between = CASES[case]
    ref_model = Net()
    model = copy.deepcopy(ref_model)
    ref_opt = cls(_groups(ref_model, copy.deepcopy(g0), copy.deepcopy(g1)), foreach=False)
    zm, zo = zero_ext.zeroify(model, cls(_groups(model, copy.deepcopy(g0), copy.deepcopy(g1))), stage=1)
    scheds = []
    if between == "scheduler":
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (ref_opt, zo)]
    start = [p.detach().clone() for p in ref_model.parameters()]
    worst = 0.0
    for step in range(STEPS):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(step))
        for m, o in ((ref_model, ref_opt), (zm, zo)):
            m(x).backward()
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()
        if callable(between):
            between(ref_opt, step)
            between(zo, step)
        ref = torch.cat([p.detach().flatten() for p in ref_model.parameters()])
        mine = torch.cat([p.detach().flatten() for p in zm.parameters()])
        if cls is torch.optim.SGD:
            worst = max(worst, float((ref - mine).abs().max()))
        else:
            worst = max(worst, float((ref - mine).norm() / ref.norm()))
    moved = max(float((p.detach() - s).abs().max()) for p, s in zip(ref_model.parameters(), start))
    return worst, moved


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_step_reads_param_groups_like_torch(case):
    worst, moved = _run(case)
    assert moved > 1e-3, f"{case}: training did not move the parameters"
    bound = SGD_ABS if CASES[case][0] is torch.optim.SGD else ADAMW_REL
    assert worst <= bound, f"{case}: zero_ext vs torch {worst:.3g} > {bound}"


def test_a_param_group_without_an_option_is_refused_by_name():
    """A param group stripped of an option the fused step needs fails with its name, not a crash."""
    model = Net()
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=1)
    zm(torch.randn(4, 12)).backward()
    del zo.param_groups[0]["eps"]
    with pytest.raises(RuntimeError, match="'eps'"):
        zo.step()
