"""Stage 3 reduces the gradients of consecutive small units together (Note [Coalesced
gradient reductions] in csrc/engine/reducer.cpp): one collective for several buckets.

A model of many small blocks (each its own unit, plus a larger head that is reduced on
its own between them) trains stage 3 with the default coalesce_numel and with
coalesce_numel=0 (one reduction per bucket) on 2 and 3 gloo ranks (3 divides no
parameter count here), under no_sync accumulation and clipping:
  - with the all-to-all reduction (gloo's default) every loss and every parameter is
    bit-identical, fp32 and bf16 reduce (the same sums, added in the same order);
  - with the backend's reduce_scatter they agree with DDP's tolerance (gloo sums in
    an order that depends on the buffer);
  - the coalesced run launches fewer reductions per step than there are buckets, and
    moves the same number of elements.
"""
import pytest
import torch

from dist_harness import run_world

pytestmark = pytest.mark.dist

BLOCKS, WIDTH, STEPS = 12, 8, 3


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return x + torch.tanh(self.norm(self.lin(x)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.blocks = torch.nn.ModuleList(Block(WIDTH) for _ in range(BLOCKS // 2))
        self.wide = Block(160)                  # a unit too large to join a group, in the middle
        self.up = torch.nn.Linear(WIDTH, 160)
        self.down = torch.nn.Linear(160, WIDTH)
        self.more = torch.nn.ModuleList(Block(WIDTH) for _ in range(BLOCKS // 2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        x = self.down(self.wide(self.up(x)))
        for b in self.more:
            x = b(x)
        return x.square().mean()


def _train(rank, coalesce, reduce_scatter, reduce_dtype):
    import zero_ext
    model = Net()
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3,
                              unit_modules=["Block"], min_unit_numel=0, coalesce_numel=coalesce,
                              reduce_scatter=reduce_scatter, reduce_dtype=reduce_dtype)
    losses = []
    for step in range(STEPS):
        for micro in range(2):
            g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
            loss = zm(torch.randn(4, WIDTH, generator=g))
            if micro == 0:
                with zm.no_sync():
                    loss.backward()
            else:
                loss.backward()
            losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(zm.parameters(), 0.5)
        zo.step()
        zo.zero_grad()
    with zero_ext.gathered_parameters(model):
        params = [p.detach().clone() for p in model.parameters()]
    s = zo.stats()
    return dict(losses=losses, params=params, buckets=s["num_buckets"],
                calls=s["comm"]["reduce_scatter"]["calls"], numel=s["comm"]["reduce_scatter"]["numel"])


def _pair(rank, world, reduce_scatter, reduce_dtype):
    return [_train(rank, c, reduce_scatter, reduce_dtype) for c in (16384, 0)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("reduce_scatter, reduce_dtype", [("alltoall", "fp32"), ("alltoall", "bf16"),
                                                           ("native", "fp32")])
def test_coalesced_reductions_change_no_result(world, reduce_scatter, reduce_dtype):
    for rank, (grouped, single) in enumerate(run_world(_pair, world, reduce_scatter, reduce_dtype, reuse=True)):
        where = f"rank {rank}/{world}, {reduce_scatter} {reduce_dtype}"
        steps = STEPS   # one reducing backward per step (the other micro-step is no_sync)
        assert single["calls"] == steps * single["buckets"], f"{where}: one reduction per bucket without coalescing"
        assert grouped["calls"] <= steps * (single["buckets"] // 2), \
            f"{where}: {grouped['calls']} reductions in {steps} steps for {grouped['buckets']} buckets"
        assert grouped["numel"] == single["numel"], f"{where}: the groups moved other elements"
        moved = max(float((p - q).abs().max()) for p, q in zip(grouped["params"], _train_start()))
        assert moved > 1e-3, f"{where}: training did not move the parameters"
        if reduce_scatter == "alltoall":
            assert grouped["losses"] == single["losses"], f"{where}: losses differ"
            for k, (a, b) in enumerate(zip(grouped["params"], single["params"])):
                assert torch.equal(a, b), f"{where}: parameter {k} differs by {float((a - b).abs().max()):.3g}"
        else:
            for k, (a, b) in enumerate(zip(grouped["params"], single["params"])):
                assert float((a - b).abs().max()) <= 1e-5 * max(float(b.abs().max()), 1.0), f"{where}: parameter {k}"


def _train_start():
    return [p.detach().clone() for p in Net().parameters()]
