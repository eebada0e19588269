"""Models whose stage-3 unit sequence is not "registration order forward, its
reverse backward" (tests/test_prefetch.py):

  EncDec          T5-style encoder-decoder: a shared embedding tied to the head, the
                  first encoder/decoder block computes a relative position bias that
                  every later block of its stack reuses, decoder blocks attend to the
                  encoder's output (so its gradient completes only after the whole
                  decoder's backward)
  CheckpointGPT   examples/gpt.py's GPT with every block under activation
                  checkpointing (recomputed during backward)
  HeadLate        BERT pretraining's shape: heads registered before the trunk
                  that feeds them, one behind a pooler registered after it
  TinyBlocks      many blocks of a few hundred parameters each, each block a unit:
                  a step is mostly per-unit overhead (benchmarks/bench_units.py's
                  shape, smaller)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gpt import GPT


class Attention(nn.Module):
    def __init__(self, d, heads, causal, buckets=0):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        # T5: only the first layer of a stack owns the relative position bias
        self.rel = nn.Embedding(buckets, heads) if buckets else None

    def position_bias(self, t, s):
        rel = (torch.arange(s)[None, :] - torch.arange(t)[:, None]).clamp(-(self.rel.num_embeddings // 2),
                                                                          self.rel.num_embeddings // 2 - 1)
        return self.rel(rel + self.rel.num_embeddings // 2).permute(2, 0, 1)[None]   # (1, heads, t, s)

    def forward(self, x, ctx=None, bias=None):
        ctx = x if ctx is None else ctx
        (b, t, d), s = x.shape, ctx.shape[1]
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = (y.view(b, s, self.heads, -1).transpose(1, 2) for y in self.kv(ctx).chunk(2, dim=-1))
        if self.rel is not None:
            bias = self.position_bias(t, s)
        scores = q @ k.transpose(-1, -2) + (0 if bias is None else bias)
        if self.causal:
            scores = scores.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(1), float("-inf"))
        y = scores.softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, t, d)), bias


class EncBlock(nn.Module):
    def __init__(self, d, heads, first):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, causal=False, buckets=8 if first else 0)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, x, bias=None):
        a, bias = self.attn(self.ln1(x), bias=bias)
        x = x + a
        return x + self.ff(self.ln2(x)), bias


class DecBlock(nn.Module):
    def __init__(self, d, heads, first):
        super().__init__()
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attn = Attention(d, heads, causal=True, buckets=8 if first else 0)
        self.cross = Attention(d, heads, causal=False)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, x, enc, bias=None):
        a, bias = self.self_attn(self.ln1(x), bias=bias)
        x = x + a
        x = x + self.cross(self.ln2(x), ctx=enc)[0]
        return x + self.ff(self.ln3(x)), bias


class EncDec(nn.Module):
    VOCAB, D, HEADS, LAYERS = 29, 16, 2, 3

    def __init__(self):
        super().__init__()
        d = self.D
        self.shared = nn.Embedding(self.VOCAB, d)
        self.encoder = nn.ModuleList(EncBlock(d, self.HEADS, i == 0) for i in range(self.LAYERS))
        self.enc_ln = nn.LayerNorm(d)
        self.decoder = nn.ModuleList(DecBlock(d, self.HEADS, i == 0) for i in range(self.LAYERS))
        self.dec_ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, self.VOCAB, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, src, tgt):
        x, bias = self.shared(src), None
        for block in self.encoder:
            x, bias = block(x, bias)
        enc = self.enc_ln(x)
        y, bias = self.shared(tgt[:, :-1]), None
        for block in self.decoder:
            y, bias = block(y, enc, bias)
        logits = self.head(self.dec_ln(y))
        return F.cross_entropy(logits.reshape(-1, self.VOCAB), tgt[:, 1:].reshape(-1))


class CheckpointGPT(GPT):
    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1])
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class HeadLate(nn.Module):
    """BERT pretraining's shape: two heads on one trunk, both registered before it,
    one of them behind a pooler registered after it."""

    def __init__(self, d_in=11, hidden=29, d_out=3, depth=3):
        super().__init__()
        self.mlm = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, d_out))
        self.nsp = nn.Linear(hidden, 2)
        self.embed = nn.Linear(d_in, hidden)
        self.trunk = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth))
        self.pooler = nn.Linear(hidden, hidden)

    def forward(self, x, y):
        h = torch.tanh(self.embed(x))
        for layer in self.trunk:
            h = h + torch.tanh(layer(h))
        nsp = self.nsp(torch.tanh(self.pooler(h[:1])))
        return F.mse_loss(self.mlm(h), y) + nsp.square().mean()


class DirectParams(nn.Module):
    """Parameters read without calling their module: a head used as F.linear(h, head.weight)
    (a tied or custom head) and a parameter of the root itself. Stages 1-2 with
    overlap_param_gather must not read them mid-gather (Note [Gathers waited per module])."""

    def __init__(self, d_in=13, hidden=37, d_out=5, depth=3):
        super().__init__()
        self.head = nn.Linear(hidden, d_out)          # never called
        self.embed = nn.Linear(d_in, hidden)
        self.trunk = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth))
        self.scale = nn.Parameter(torch.ones(hidden))

    def forward(self, x, y):
        h = torch.tanh(self.embed(x))
        for layer in self.trunk:
            h = h + torch.tanh(layer(h))
        return F.mse_loss(F.linear(h * self.scale, self.head.weight, self.head.bias), y)


class TinyBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + torch.tanh(self.norm(self.fc(x)))


class TinyBlocks(nn.Module):
    def __init__(self, d=16, depth=24):
        super().__init__()
        self.blocks = nn.ModuleList(TinyBlock(d) for _ in range(depth))

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return F.mse_loss(x, y)

