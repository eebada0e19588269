"""Stage 3 holds no more than it says, counted from the tensors themselves.

A model of six blocks (units) and a root head trains three steps on 2 gloo ranks with
prefetch_depth 0, 1 and 2. At every block's forward start and end, at the loss and at each
block's backward start, the test counts the units whose storage holds bytes (a unit keeps
its storage object, resized to 0 bytes when released; one being gathered has its bytes
already), independently of the engine's own bookkeeping, and checks:
- never more than the root, the unit computing and `prefetch_depth` units ahead;
- at the loss (the activations' peak) only the root and the last unit (none with depth 0):
  nothing is fetched for backward before backward begins;
- the engine's accounting of gathered bytes (stats' gathered_params) equals the bytes of
  those storages, at every mark;
- after zero_grad(set_to_none=True) the step's gradient shard and ring are gone (held_bytes).
Run: .venv/bin/python -m pytest -q tests/test_peak_owners.py
"""
import pytest

from dist_harness import run_world

pytestmark = pytest.mark.dist

BLOCKS = 6


def _worker(rank, world, depth):
    import torch

    import zero_ext

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(48, 48)

        def forward(self, x):
            return torch.tanh(self.fc(x))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block() for _ in range(BLOCKS)])
            self.head = torch.nn.Linear(48, 8)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x).square().mean()

    torch.manual_seed(0)
    net = Net()
    zm, zo = zero_ext.zeroify(net, torch.optim.AdamW(net.parameters(), lr=1e-3), stage=3, unit_modules=["Block"],
                              min_unit_numel=0, coalesce_numel=0, prefetch_depth=depth)
    marks, held, first = [], {}, [True]   # held: each unit's storage object (resized, never replaced)

    def mark(label):
        if first[0]:   # the first step: take each storage while its unit is gathered
            for name, p in [("root", zm.module.head.weight)] + [(i, b.fc.weight) for i, b in enumerate(zm.module.blocks)]:
                if p.numel() > 0:
                    held.setdefault(name, p.untyped_storage())
            return
        blocks = sum(1 for k, s in held.items() if k != "root" and s.nbytes() > 0)
        marks.append({"label": label, "blocks": blocks, "bytes": sum(s.nbytes() for s in held.values()),
                      "meter": zo.stats()["buffer_bytes"]["gathered_params"]})

    for i, b in enumerate(zm.module.blocks):
        b.register_forward_pre_hook(lambda m, a, i=i: mark(f"fwd {i}"))

        def post(m, args, out, i=i):
            mark(f"fwd end {i}")
            out.register_hook(lambda g, i=i: mark(f"bwd {i}"))
        b.register_forward_hook(post)

    after = []
    for step in range(3):
        x = torch.randn(16, 48, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = zm(x)
        mark("loss")
        loss.backward()
        first[0] = False
        zo.step()
        zo.zero_grad(set_to_none=True)
        h = zo.stats()["held_bytes"]
        after.append({"gradients": h["gradients"], "grad_ring": h["grad_ring"], "bytes": sum(s.nbytes() for s in held.values())})
    return {"marks": marks, "after": after, "held": list(held)}


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_gathered_units_stay_within_the_window(depth):
    res = run_world(_worker, 2, depth)
    for r in res:
        marks = r["marks"]
        assert len(marks) == 2 * (3 * BLOCKS + 1) and len(r["held"]) == BLOCKS + 1, [m["label"] for m in marks]
        worst = max(marks, key=lambda m: m["blocks"])
        assert worst["blocks"] <= 1 + depth, f"{worst['blocks']} blocks gathered at {worst['label']} (depth {depth})"
        for m in marks:
            if m["label"] == "loss":
                want = min(1, depth)   # the last unit is kept for its backward when prefetching
                assert m["blocks"] == want, f"at the loss {m['blocks']} blocks are gathered, not {want}"
            assert m["meter"] == m["bytes"], f"{m['label']}: gathered_params {m['meter']} != storages {m['bytes']}"
        assert any(m["blocks"] == 1 + depth for m in marks), "the window was never used: the count is not seen"
        for a in r["after"]:
            assert a == {"gradients": 0, "grad_ring": 0, "bytes": 0}, a
