"""Train a small BERT-style encoder classifier with zero_ext ZeRO, on generated token sequences.

    torchrun --standalone --nproc_per_node=2 examples/train_encoder.py --stage 2
    torchrun --standalone --nproc_per_node=2 examples/train_encoder.py --ddp     # baseline
    python examples/train_encoder.py --stage 1 --steps 100                       # one process
    python examples/train_encoder.py --tiny --steps 10                           # seconds, for tests

The model is a compact encoder built from torch.nn.TransformerEncoderLayer: token +
position embeddings, a [CLS] token in front of every sequence, pre-LayerNorm encoder
layers, and a linear classifier on the [CLS] position. It needs nothing beyond torch.
A Hugging Face model works the same way, with no weight download:

    from transformers import BertConfig, BertForSequenceClassification
    model = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=64,
        num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, num_labels=2))
    model, opt = zero_ext.zeroify(model, opt, stage=2)    # forward(input_ids=x, labels=y).loss

The data are generated: a sequence is [CLS] then filler tokens, with token A and token
B each placed once at random positions; the label is 1 when A comes before B. A bag of
words cannot solve this: the encoder has to use the position embeddings, through
attention. The loss falls below ln 2 and the accuracy leaves chance (50%) in a few
dozen steps.

--stage 0 has plain DDP semantics (nothing partitioned), 1 partitions the AdamW states,
2 also the gradients. --ddp runs torch's DistributedDataParallel with the same AdamW
instead of zero_ext; --stage is then ignored. Every rank draws its own batches from a
generator seeded with seed + 1000 * rank.
--json OUT makes rank 0 write a summary (losses, accuracy, step times, model-state bytes).
"""

import argparse
from pathlib import Path

import torch
import torch.nn as nn

from common import add_precision_argument, check_precision, leave_together, setup_distributed, train_classifier

CLS, TOKEN_A, TOKEN_B = 0, 1, 2    # special tokens; ids >= FIRST_FILLER are filler
FIRST_FILLER = 3
NUM_CLASSES = 2                    # 1: A before B, 0: B before A


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage (default 2)")
    parser.add_argument("--ddp", action="store_true", help="baseline: torch DDP + the same AdamW, no zero_ext")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per rank per step (default 32; 16 with --tiny)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence, [CLS] included (default 32; 12 with --tiny)")
    parser.add_argument("--vocab-size", type=int, default=32)
    parser.add_argument("--n-layer", type=int, default=None, help="encoder layers (default 2; 1 with --tiny)")
    parser.add_argument("--n-head", type=int, default=None, help="attention heads (default 4; 2 with --tiny)")
    parser.add_argument("--d-model", type=int, default=None, help="hidden size (default 64; 32 with --tiny)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm; 0 disables clipping")
    parser.add_argument("--eval-size", type=int, default=512, help="held-out sequences for the final loss/accuracy")
    parser.add_argument("--tiny", action="store_true", help="a very small model and batch (for tests)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: 1 when world size > 1, else torch's default)")
    add_precision_argument(parser)
    parser.add_argument("--json", type=Path, default=None, help="rank 0 writes the run summary here")
    args = parser.parse_args(argv)
    check_precision(parser, args)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    for name, default, tiny in (("batch_size", 32, 16), ("seq_len", 32, 12), ("n_layer", 2, 1),
                                ("n_head", 4, 2), ("d_model", 64, 32)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else default)
    if args.seq_len < 3 or args.vocab_size <= FIRST_FILLER:
        parser.error(f"--seq-len must be >= 3 and --vocab-size > {FIRST_FILLER}")
    if args.d_model % args.n_head != 0:
        parser.error("--d-model must be divisible by --n-head")
    return args


# ----------------------------------------------------------------------------- model

class Encoder(nn.Module):
    """Embeddings | n_layer pre-LayerNorm TransformerEncoderLayers | LayerNorm | linear head on [CLS]."""

    def __init__(self, vocab_size, seq_len, d_model, n_head, n_layer, num_classes=NUM_CLASSES):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(d_model, n_head, dim_feedforward=4 * d_model, dropout=0.0,
                                       activation="gelu", batch_first=True, norm_first=True)
            for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, idx):
        """idx: (B, T) int64 token ids, idx[:, 0] == CLS. Returns logits (B, num_classes)."""
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)                 # (B, T, d_model)
        for layer in self.layers:
            x = layer(x)                                         # no padding, so no mask
        return self.head(self.ln_f(x[:, 0]))                     # [CLS] pooling


# ----------------------------------------------------------------------------- data

def get_batch(batch_size, seq_len, vocab_size, generator):
    """x (B, seq_len) int64: [CLS], fillers, one A and one B; y (B,) = 1 if A comes before B."""
    x = torch.randint(FIRST_FILLER, vocab_size, (batch_size, seq_len), generator=generator)
    x[:, 0] = CLS
    # two distinct positions in 1..seq_len-1 per sequence: a random permutation's first two
    positions = torch.rand(batch_size, seq_len - 1, generator=generator).argsort(dim=1)[:, :2] + 1
    pos_a, pos_b = positions[:, 0], positions[:, 1]
    rows = torch.arange(batch_size)
    x[rows, pos_a] = TOKEN_A
    x[rows, pos_b] = TOKEN_B
    return x, (pos_a < pos_b).long()


# ----------------------------------------------------------------------------- training

def build_optimizer(model, lr, weight_decay):
    """AdamW with weight decay on matrices and embeddings only (not on biases or LayerNorms)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))


def train(args):
    """Build, train, evaluate, report. Returns the summary dict on every rank."""
    setup_distributed(args.threads)
    torch.manual_seed(args.seed)                               # same initial weights on every rank
    model = Encoder(args.vocab_size, args.seq_len, args.d_model, args.n_head, args.n_layer)
    opt = build_optimizer(model, args.lr, args.weight_decay)
    return train_classifier(model, opt, lambda n, g: get_batch(n, args.seq_len, args.vocab_size, g), args,
                            "sequences")


def main(argv=None):
    args = parse_args(argv)
    train(args)
    leave_together()


if __name__ == "__main__":
    main()
