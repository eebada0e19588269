"""Note [Groups as an argument] (csrc/engine/groups.h): each engine call that one of several
wrapped optimizers makes for its own param groups names them, and covers those groups only;
a call without groups covers every group, whatever calls came before it (the engine keeps no
"active groups" between calls). In process, world 1, stage 1: two param groups, three
parameters, each group in its own bucket."""
import torch

from zero_ext import _C

SGD = dict(lr=0.5, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)


def _engine():
    opts = _C.EngineOptions()
    opts.stage = 1
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(7)),
              torch.nn.Parameter(torch.randn(3))]
    engine = _C.Engine(params, [0, 1, 1], [], None, opts)
    for i, p in enumerate(params):   # a backward: every gradient is 1
        p.grad = torch.ones_like(p)
        engine.mark_ready(i)
    engine.finalize_backward()
    return engine, params


def _by_group(engine, tensors):
    """group -> the elements of its parameters in the per-bucket `tensors` (padding left out:
    each parameter starts aligned, Note [Aligned pieces])."""
    pieces: dict = {}
    for f in engine.fragment_views(masters=False):
        g = engine.bucket_groups()[f.bucket]
        pieces.setdefault(g, []).append(tensors[f.bucket].narrow(0, f.slice_offset, f.numel))
    return {g: torch.cat(p) for g, p in pieces.items()}


def test_views_list_the_named_groups_buckets():
    engine, _ = _engine()
    assert sorted(engine.bucket_groups()) == [0, 1]
    assert engine.bucket_groups([1]) == [1] and engine.bucket_groups([0]) == [0]
    assert len(engine.param_shards([1])) == len(engine.grad_shards([1])) == 1
    assert {f.param for f in engine.fragment_views(groups=[1])} == {1, 2}
    assert {f.param for f in engine.fragment_views(masters=False, groups=[0])} == {0}
    assert sorted(engine.bucket_groups()) == [0, 1]   # no state left behind by the calls above


def test_scaling_and_zeroing_touch_the_named_groups_only():
    engine, params = _engine()
    engine.scale_grads(3.0, [1])
    grads = _by_group(engine, engine.grad_shards())
    assert grads[0].eq(1).all() and grads[1].eq(3).all() and grads[1].numel() == 10
    engine.scale_grads(2.0)   # every group
    grads = _by_group(engine, engine.grad_shards())
    assert grads[0].eq(2).all() and grads[1].eq(6).all()
    engine.zero_grad(True, [0])
    assert params[0].grad is None and params[1].grad is not None and params[2].grad is not None
    grads = _by_group(engine, engine.grad_shards())
    assert grads[0].eq(0).all() and grads[1].eq(6).all()


def test_a_step_updates_the_named_groups_and_counts_their_steps():
    engine, _ = _engine()
    before = _by_group(engine, [s.clone() for s in engine.param_shards()])
    engine.begin_step(advance=False)
    engine.advance_steps([1])
    assert engine.param_steps() == [0, 1, 1]
    engine.step_sgd([SGD, SGD], [1], [1, 1], 1.0)
    after = _by_group(engine, engine.param_shards())
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(after[1], before[1] - 0.5, rtol=0, atol=0)
    engine.advance_steps([0])
    engine.step_sgd([SGD, SGD], [0], [1, 1], 1.0)
    torch.testing.assert_close(_by_group(engine, engine.param_shards())[0][:5], before[0][:5] - 0.5, rtol=0, atol=0)
    assert engine.param_steps() == [1, 1, 1]
