"""Train a small ResNet-style CNN image classifier with zero_ext ZeRO, on generated data.

    torchrun --standalone --nproc_per_node=2 examples/train_cnn.py --stage 2
    torchrun --standalone --nproc_per_node=2 examples/train_cnn.py --ddp     # baseline
    python examples/train_cnn.py --stage 2 --steps 50                        # one process
    python examples/train_cnn.py --tiny --steps 10                           # seconds, for tests

The images are CIFAR-shaped (3x32x32, 10 classes) and generated, so nothing is
downloaded: a fixed random "teacher" gives each class a smooth random template image
(the same on every rank, from --seed), and a sample is its class's template plus
Gaussian noise. The CNN has to learn the ten templates; the loss falls and the
accuracy leaves chance (10%) within a few dozen steps.

The model has BatchNorm, so it has buffers (running mean/variance) besides its
parameters: zero_ext, like DDP, broadcasts them from rank 0 before every forward
(option broadcast_buffers=True, the default), so all ranks evaluate the same model.
The optimizer is SGD with Nesterov momentum, the classic choice for ResNets; zero_ext
runs it as a fused C kernel over this rank's shard.

--stage 0 has plain DDP semantics (nothing partitioned), 1 partitions the optimizer
states (the momentum), 2 also the gradients. --ddp runs torch's DistributedDataParallel
with the same optimizer instead of zero_ext; --stage is then ignored. Every rank draws
its own batches from a generator seeded with seed + 1000 * rank.
--json OUT makes rank 0 write a summary (losses, accuracy, step times, model-state bytes).
"""

import argparse
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import add_precision_argument, check_precision, leave_together, setup_distributed, train_classifier

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)          # channels, height, width (CIFAR-10)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage (default 2)")
    parser.add_argument("--ddp", action="store_true", help="baseline: torch DDP + the same SGD, no zero_ext")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=None, help="images per rank per step (default 32; 16 with --tiny)")
    parser.add_argument("--width", type=int, default=None, help="channels of the first stage (default 32; 4 with --tiny)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm; 0 disables clipping")
    parser.add_argument("--noise", type=float, default=1.0, help="std of the Gaussian noise added to the templates")
    parser.add_argument("--eval-size", type=int, default=256, help="held-out images for the final loss/accuracy")
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
    if args.batch_size is None:
        args.batch_size = 16 if args.tiny else 32
    if args.width is None:
        args.width = 4 if args.tiny else 32
    if args.tiny:
        args.eval_size = min(args.eval_size, 64)
    return args


# ----------------------------------------------------------------------------- model

class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, plus the input (projected when the shape changes)."""

    def __init__(self, in_channels, out_channels, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """stem (3 -> w) | block w, w | block w -> 2w, /2 | block 2w -> 4w, /2 | global avg pool | linear."""

    def __init__(self, width, num_classes=NUM_CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(IMAGE_SHAPE[0], width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(BasicBlock(width, width, stride=1),           # 32x32
                                    BasicBlock(width, 2 * width, stride=2),       # 16x16
                                    BasicBlock(2 * width, 4 * width, stride=2))   # 8x8
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        """x: (B, 3, 32, 32) float. Returns logits (B, num_classes)."""
        x = self.blocks(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


# ----------------------------------------------------------------------------- data

class TeacherImages:
    """Class-conditional images: the class's fixed smooth template + Gaussian noise."""

    def __init__(self, seed, noise):
        generator = torch.Generator().manual_seed(seed)                      # same on every rank
        coarse = torch.randn(NUM_CLASSES, IMAGE_SHAPE[0], 4, 4, generator=generator)
        self.templates = F.interpolate(coarse, size=IMAGE_SHAPE[1:], mode="bilinear",
                                       align_corners=False)                  # (10, 3, 32, 32)
        self.noise = noise

    def get_batch(self, batch_size, generator):
        """x (B, 3, 32, 32) float32, y (B,) int64; all randomness from `generator`."""
        y = torch.randint(NUM_CLASSES, (batch_size,), generator=generator)
        x = self.templates[y] + self.noise * torch.randn(batch_size, *IMAGE_SHAPE, generator=generator)
        return x, y


# ----------------------------------------------------------------------------- training

def train(args):
    """Build, train, evaluate, report. Returns the summary dict on every rank."""
    setup_distributed(args.threads)
    data = TeacherImages(args.seed, args.noise)
    torch.manual_seed(args.seed)                               # same initial weights on every rank
    model = ResNet(args.width)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, nesterov=True,
                          weight_decay=args.weight_decay)
    return train_classifier(model, opt, data.get_batch, args, "images")


def main(argv=None):
    args = parse_args(argv)
    train(args)
    leave_together()


if __name__ == "__main__":
    main()
