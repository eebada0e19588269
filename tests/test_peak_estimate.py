"""estimate_memory(..., loss_fn=...)'s peak: the activations measured on fake tensors.

- The fake run counts what a real run on the CPU counts, byte for byte: the same counter
  (zero_ext/peak.py's _LiveBytes) around a real forward and backward of the same GPT (flash
  attention, cross entropy, a tied head), each parameter's gradient dropped as it lands.
- Activations scale with the batch, and parameters are never counted: twice the batch is
  twice the bytes, within the loss's fixed part.
- The peak adds, on top of the model state, stage 3's root and last unit at the loss; stages
  0-1's gradient buckets are not held at the loss but come back through backward (counted
  with the activations as they land), unless offload keeps them.
The process-level check (the estimate within 10% of the measured peak, per system) is
benchmarks/bench_peak_process.py's last table.
"""
import sys
from pathlib import Path

import torch

import zero_ext
from zero_ext.peak import _LiveBytes, activation_peak

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64)


def _loss_fn(batch):
    def loss_fn(m):
        x = torch.randint(0, CFG.vocab_size, (batch, CFG.block_size + 1))
        return m(x[:, :-1].contiguous(), x[:, 1:].contiguous())[1]
    return loss_fn


def _real_count(model, loss_fn) -> int:
    params = list(model.parameters())
    hooks = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in params]
    with _LiveBytes(params) as live:
        loss = loss_fn(model)
        loss.backward()
        del loss
    for h in hooks:
        h.remove()
    return live.peak


def test_fake_run_counts_what_a_real_run_counts():
    torch.manual_seed(0)
    model = GPT(CFG)
    fake = activation_peak(model, _loss_fn(4))
    real = _real_count(model, _loss_fn(4))
    assert fake == real > 0, (fake, real)
    assert all(p.grad is None for p in model.parameters()), "the user's model is untouched"


def test_activations_scale_with_the_batch_and_leave_parameters_out():
    with torch.device("meta"):
        model = GPT(CFG)
    one, two = activation_peak(model, _loss_fn(1)), activation_peak(model, _loss_fn(2))
    params = sum(p.numel() * 4 for p in model.parameters())
    assert params > one / 4, "the parameters are a share the check would see, were they counted"
    assert 1.8 * one < two < 2.2 * one, (one, two)


def test_peak_adds_model_state_and_the_gathered_units_at_the_loss():
    with torch.device("meta"):
        model = GPT(CFG)
    act = activation_peak(model, _loss_fn(4))
    est = zero_ext.estimate_memory(model, 2, 3, unit_modules=["Block"], loss_fn=_loss_fn(4))
    peak, msb, buf = est["peak"], est["model_state_bytes"], est["buffer_bytes"]
    assert peak["activations"] == act
    assert peak["model_state"] == msb["parameters"] + msb["master_weights"] + msb["optimizer_states"]
    assert peak["gathered"] == buf["gathered_root"] + buf["gathered_unit"] > 0
    assert peak["total"] == peak["model_state"] + peak["gathered"] + act
    # no prefetch: the last unit is released after its forward too
    est0 = zero_ext.estimate_memory(model, 2, 3, unit_modules=["Block"], prefetch_depth=0, loss_fn=_loss_fn(4))
    assert est0["peak"]["gathered"] == buf["gathered_root"]
    # stages 0-1 release their gradient buckets at zero_grad(set_to_none=True): none at the loss, they
    # come back through backward, counted with the activations as they land; offload keeps them
    for stage in (0, 1):
        est1 = zero_ext.estimate_memory(model, 2, stage, loss_fn=_loss_fn(4))
        m1 = est1["model_state_bytes"]
        assert m1["gradients"] > 0 and est1["peak"]["model_state"] == m1["total"] - m1["gradients"]
        kept = activation_peak(model, _loss_fn(4), grad_bytes=4, first_grad=est1["buffer_bytes"]["grad_ring"])
        assert est1["peak"]["activations"] == kept >= act
    # bf16 parameters, a batch of 1 (the peak at backward's end): the buckets keep fp32 gradients
    # (reduce_dtype), 4 bytes an element, not 2
    bf = zero_ext.estimate_memory(model, 2, 1, param_dtype="bf16", loss_fn=_loss_fn(1))
    assert bf["peak"]["activations"] == activation_peak(model, _loss_fn(1), torch.bfloat16, 4,
                                                        bf["buffer_bytes"]["grad_ring"])
    assert bf["peak"]["activations"] > activation_peak(model, _loss_fn(1), torch.bfloat16, 2)
    off = zero_ext.estimate_memory(model, 2, 1, offload="cpu", loss_fn=_loss_fn(4))
    assert off["peak"]["model_state"] == off["model_state_bytes"]["total"] and off["peak"]["activations"] == act
