"""Every elementwise torch.optim optimizer zero_ext accepts runs
through the generic path (the user's optimizer class over 1-D views of the local
shard) and matches DDP + the same plain torch optimizer; plus the fused kernels'
less common options (dampening, maximize, Adam's L2 weight decay)."""
import pytest
import torch

from cases import Case, run_cases
from dist_harness import run_world
from test_parity import check

GENERIC = {
    "Adagrad": dict(lr=0.05, weight_decay=0.01, lr_decay=0.01),
    "Adadelta": dict(lr=1.0, weight_decay=0.01),
    "Adamax": dict(lr=3e-3, weight_decay=0.01),
    "ASGD": dict(lr=0.05, weight_decay=0.01, t0=5),
    "NAdam": dict(lr=3e-3, weight_decay=0.01),
    "RAdam": dict(lr=3e-3, weight_decay=0.01),
    "RMSprop": dict(lr=3e-3, momentum=0.9, centered=True, weight_decay=0.01),
    "Rprop": dict(lr=3e-3),
    "AdamW": dict(lr=3e-3, weight_decay=0.1),
    "SGD": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
}

FUSED_OPTIONS = [
    ("sgd", dict(lr=0.05, momentum=0.9, dampening=0.1, nesterov=False, weight_decay=0.01)),
    ("sgd", dict(lr=0.05, momentum=0.0, nesterov=False, weight_decay=0.01, maximize=True)),
    ("adamw", dict(maximize=True)),
    ("adam", dict(weight_decay=0.05)),
]


def cases():
    out = []
    for stage in (0, 1, 2):
        for name, kw in GENERIC.items():
            out.append(Case(f"generic-{name}-s{stage}", model="mlp", optimizer=name, opt_kwargs=kw,
                            stage=stage, config=dict(fused="never")))
        for k, (opt, kw) in enumerate(FUSED_OPTIONS):
            out.append(Case(f"fused-{opt}-{k}-s{stage}", model="mlp", optimizer=opt, opt_kwargs=kw, stage=stage))
    return out


def test_every_elementwise_optimizer_is_claimed():
    """The list above covers every optimizer zeroify accepts."""
    from zero_ext.optim import ELEMENTWISE
    assert {c.__name__ for c in ELEMENTWISE} - {"Adam"} == set(GENERIC)


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 3])
def test_generic_path_matches_torch(world):
    cs = cases()
    results = run_world(run_cases, world, cs, timeout_s=900, reuse=True)
    for rank, res in enumerate(results):
        for case in cs:
            r = res[case.name]
            exact = case.optimizer.lower() in ("sgd", "asgd")
            check(f"world {world} rank {rank} {case.name}", r, "sgd" if exact else "adamw")
            assert r["stats"]["fused"] == (not case.name.startswith("generic")), case.name
