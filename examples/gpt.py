"""A small GPT and a character-level dataset for the zero_ext examples and tests.

    from gpt import GPT, GPTConfig, CharDataset
    data = CharDataset("examples/data/tinyshakespeare.txt")
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=64))
    x, y = data.get_batch("train", batch_size=16, block_size=64, generator=g)
    logits, loss = model(x, y)

Importing this file has no side effects (no data is read, no model is built).
The model is the usual pre-LayerNorm decoder: token + position embeddings, n_layer
blocks of causal self-attention and an MLP, a final LayerNorm and an lm head whose
weight IS the token embedding's weight (one Parameter shared by identity).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 65     # tokens; 65 distinct characters in tinyshakespeare
    block_size: int = 64     # longest context the position embedding covers
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128        # must be divisible by n_head
    dropout: float = 0.0
    bias: bool = True        # biases in Linear and LayerNorm layers


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        B, T, C = x.shape                                    # batch, time, channels
        q, k, v = self.qkv(x).split(C, dim=2)                # each (B, T, C)
        head_size = C // self.n_head
        q = q.view(B, T, self.n_head, head_size).transpose(1, 2)   # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, head_size).transpose(1, 2)
        v = v.view(B, T, self.n_head, head_size).transpose(1, 2)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)     # heads side by side again
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config, init=True):
        """init=False keeps only each layer's own default initialization (what a
        model built on the meta device and materialized by zero_ext stage 3 replays
        before its init_fn)."""
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)   # token embedding
        self.wpe = nn.Embedding(config.block_size, config.n_embd)   # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: the lm head and the token embedding are one Parameter object.
        self.lm_head.weight = self.wte.weight

        # Deterministic given torch.manual_seed: modules are initialised in
        # registration order. Residual projections get a smaller std (GPT-2 paper).
        if not init:
            return
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def num_params(self):
        """Trainable elements, each shared Parameter counted once."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def forward(self, idx, targets=None):
        """idx: (B, T) int64 token ids, T <= block_size. targets: (B, T) or None.

        Returns (logits (B, T, vocab_size), loss scalar or None).
        """
        B, T = idx.shape
        assert T <= self.config.block_size, f"sequence length {T} > block_size {self.config.block_size}"
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Extend idx (B, T) by max_new_tokens sampled tokens; returns (B, T + max_new_tokens)."""
        was_training = self.training
        self.eval()
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            logits, _ = self(context)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth_largest, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            next_token = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat([idx, next_token], dim=1)
        self.train(was_training)
        return idx


class CharDataset:
    """A text file as a sequence of character ids, split 90/10 into train and val."""

    def __init__(self, path, val_fraction=0.1):
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        dtype = torch.uint8 if self.vocab_size <= 256 else torch.int64
        data = torch.tensor(self.encode(text), dtype=dtype)   # (len(text),)
        n_train = int(len(data) * (1.0 - val_fraction))
        self.splits = {"train": data[:n_train], "val": data[n_train:]}

    def encode(self, text):
        return [self.stoi[ch] for ch in text]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)

    def get_batch(self, split, batch_size, block_size, generator):
        """Random windows of split: x (B, block_size) int64 and y = x shifted by one.

        All randomness comes from `generator`, so a rank with its own generator draws
        its own batches, the same ones on every run.
        """
        data = self.splits[split]
        windows = data.unfold(0, block_size + 1, 1)          # (len - block_size, block_size + 1) view
        starts = torch.randint(len(windows), (batch_size,), generator=generator)
        chunk = windows[starts].long()                       # (B, block_size + 1)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
