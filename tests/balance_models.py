"""Models for the whole-tensor balance report: the example GPT (its default
config), a 24-layer one of the same shape ratios (balance depends on the
ratios of the matrices' shapes, not on their scale) but a tiny vocabulary, a
24-layer one of GPT-2 medium's ratios (its embedding big enough to fill the
padding: Note [Filling atomic buckets]) and GPT-2 medium itself on the meta
device, and the bound no whole-tensor assignment can beat."""
from __future__ import annotations

import torch

from gpt import GPT, GPTConfig


def build(kind: str):
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig())
    if kind == "gpt24":
        return GPT(GPTConfig(n_layer=24, n_head=4, n_embd=64, block_size=32))
    if kind == "gpt24m":   # GPT-2 medium's proportions: vocab / n_embd = 49, block / n_embd = 1
        return GPT(GPTConfig(n_layer=24, n_head=4, n_embd=128, vocab_size=6272, block_size=128))
    if kind == "gpt2-medium":   # the real shapes, on the meta device (no memory)
        with torch.device("meta"):
            return GPT(GPTConfig(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257, block_size=1024))
    raise ValueError(kind)


def lower_bound(cost_per_rank: list, kind: str, n: int) -> float:
    """max(largest cost, p_N + p_(N+1)) over the mean, for the hidden matrices'
    Newton-Schulz costs p_1 >= p_2 >= ... (with N+1 tensors on N ranks two of the
    N+1 largest share one); 1.0 when the mean itself is the bound."""
    from whole_cases import hidden_matrices
    model = build(kind)
    hidden = hidden_matrices(model)
    costs = sorted((p.shape[0] * p.shape[1] * min(p.shape) for p in model.parameters() if id(p) in hidden),
                   reverse=True)
    mean = sum(costs) / n
    bound = max(costs[0], costs[n - 1] + costs[n] if len(costs) > n else 0)
    assert abs(sum(cost_per_rank) - sum(costs)) <= 1e-9 * sum(costs), "the plan's costs are the matrices' costs"
    return max(1.0, bound / mean)
