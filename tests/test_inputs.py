"""Bad inputs raise clear exceptions before any collective, and no rank is left
hanging. A check one rank makes alone runs here, in this process (world size 1, no
process group); every case also runs on 2 real gloo ranks under a timeout, where each
rank must raise (the standing 2-rank world: every case raises on every rank, so no
collective is left unmatched)."""
import pytest

from dist_harness import run_world


def _bad_input_worker(rank, world, case):
    import torch
    from torch import nn

    import zero_ext
    from cases import MLP

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kwargs = dict(stage=2)
    if case == "unknown_key":
        kwargs["bucket_byte"] = 1 << 20
    elif case == "stage_range":
        kwargs["stage"] = 7
    elif case == "bad_type":
        kwargs["bucket_bytes"] = "big"
    elif case == "bad_choice":
        kwargs["reduce_scatter"] = "ring"
    elif case == "sparse":
        model = nn.Sequential(nn.Embedding(10, 4, sparse=True))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    elif case == "mixed_devices":
        model.layers[0].weight = nn.Parameter(torch.empty(37, 13, device="meta"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif case == "foreign_param":
        opt = torch.optim.AdamW(list(model.parameters()) + [nn.Parameter(torch.zeros(3))], lr=1e-3)
    elif case == "params_differ":
        model = MLP(hidden=37 + rank)            # rank 1 builds a different model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif case == "config_differs":
        kwargs["bucket_bytes"] = (1 << 20) + rank * 4096
    elif case == "non_elementwise":
        opt = torch.optim.LBFGS(model.parameters())
    elif case == "sparse_adam":
        opt = torch.optim.SparseAdam(model.parameters())
    elif case == "not_optimizer":
        opt = object()
    elif case == "not_module":
        model = lambda x: x  # noqa: E731
    elif case == "double_params":
        model = MLP().double()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif case == "no_trainable":
        for p in model.parameters():
            p.requires_grad_(False)
    elif case == "already_wrapped":
        model = nn.parallel.DistributedDataParallel(model)
    elif case == "differentiable":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, differentiable=True)
    elif case == "one_rank_bad":
        if rank == 1:
            kwargs["fused"] = "sometimes"
    elif case == "fused_always_generic":
        opt = torch.optim.Adagrad(model.parameters())
        kwargs["fused"] = "always"
    elif case == "bad_param_dtype":
        kwargs["param_dtype"] = "fp8"
    elif case == "bad_loss_scale":
        kwargs["loss_scale"] = -4.0
    elif case == "bf16_reduce_generic":
        opt = torch.optim.RMSprop(model.parameters())
        kwargs.update(param_dtype=torch.bfloat16, reduce_dtype="bf16")
    elif case == "bad_backoff":
        kwargs["loss_scale_backoff_factor"] = 2.0
    elif case == "missing_json":
        kwargs["config"] = "/nonexistent/zero.json"
    else:
        raise AssertionError(case)
    zero_ext.zeroify(model, opt, **kwargs)
    return "no error"


CASES = {
    "unknown_key": "unknown config option 'bucket_byte'. Did you mean 'bucket_bytes'",
    "stage_range": "stage must be 0, 1, 2 or 3",
    "bad_type": "bucket_bytes must be an int",
    "bad_choice": "reduce_scatter must be one of",
    "sparse": "sparse=True produces sparse gradients",
    "mixed_devices": "different device types",
    "foreign_param": "is not a parameter of the model",
    "params_differ": "wrap different parameters",
    "config_differs": "wrap different parameters",
    "non_elementwise": "LBFGS is not an elementwise optimizer",
    "sparse_adam": "SparseAdam is not an elementwise optimizer",
    "not_optimizer": "optimizer must be a torch.optim.Optimizer",
    "not_module": "model must be a torch.nn.Module",
    "double_params": "give zeroify() the model in float32",
    "bad_param_dtype": "param_dtype must be one of",
    "bad_loss_scale": "loss_scale must be 'auto', 'dynamic', None or a positive number",
    "bf16_reduce_generic": "reduce_dtype='bf16' needs a fused optimizer",
    "bad_backoff": "loss_scale_backoff_factor must be in (0, 1)",
    "no_trainable": "no parameter with requires_grad=True",
    "already_wrapped": "already wrapped (DistributedDataParallel)",
    "differentiable": "differentiable=True) is not supported",
    "one_rank_bad": "rejected their zeroify() inputs",
    "fused_always_generic": "has no fused kernel",
    "missing_json": "does not exist",
}


# cases that need a process group: what the ranks compare, and a DDP-wrapped model
# (DistributedDataParallel needs a process group to be built)
NEEDS_A_GROUP = {"params_differ", "config_differs", "one_rank_bad", "already_wrapped"}


@pytest.mark.parametrize("case", sorted(set(CASES) - NEEDS_A_GROUP))
def test_bad_input_raises_in_process(case):
    with pytest.raises(Exception) as info:
        _bad_input_worker(0, 1, case)
    assert CASES[case] in str(info.value), f"{str(info.value)!r} does not say {CASES[case]!r}"


def _caught(rank, world, case):
    """The worker's error on this rank, or None when zeroify accepted the inputs."""
    try:
        _bad_input_worker(rank, world, case)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_on_every_rank(case):
    errors = run_world(_caught, 2, case, timeout_s=120, reuse=True)
    for rank, msg in enumerate(errors):
        assert msg is not None, f"rank {rank}: {case} was accepted"
        if case == "one_rank_bad" and rank == 1:
            assert "fused must be one of" in msg, msg
        else:
            assert CASES[case] in msg, f"rank {rank}: {msg!r} does not say {CASES[case]!r}"
