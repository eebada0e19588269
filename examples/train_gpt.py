"""Train the small GPT of examples/gpt.py on tinyshakespeare with zero_ext ZeRO.

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --stage 2
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --ddp    # baseline
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --fsdp2  # torch FSDP2 peer
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --zero-redundancy  # torch ZeroRedundancyOptimizer
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --deepspeed 2      # DeepSpeed ZeRO-2, if installed
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --stage 3 --dtype bf16
    python examples/train_gpt.py --stage 2 --steps 50                       # one process
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --save-every 50 --checkpoint ckpt/gpt
    torchrun --standalone --nproc_per_node=3 examples/train_gpt.py --stage 3 --resume ckpt/gpt

--stage 0 has plain DDP semantics (nothing partitioned), 1 partitions the optimizer
states, 2 also the gradients. --ddp runs torch's DistributedDataParallel with the same
torch.optim.AdamW instead of zero_ext, as the baseline; --stage is then ignored.
--fsdp2 runs torch FSDP2 (torch.distributed.fsdp.fully_shard) with the same AdamW on
the DTensor parameters: a CPU device mesh over all ranks, each Block sharded, then the
root. The reduction is pinned, not left to the backend (gloo has lacked AVG, and FSDP2
on gloo has summed instead of averaging in some torch versions; 2.13's default does
average): SUM only on the comms (set_force_sum_reduction_for_comms), then a division by
the world size (set_gradient_divide_factor), the same mean gradient as DDP's; the
per-step losses match --ddp's to ~5e-7.
--zero-redundancy (torch's ZeroRedundancyOptimizer over the same AdamW, DDP for the
gradients) and --deepspeed S (DeepSpeed's ZeRO-1/2 engine, CPU accelerator, gloo) are the
other peers; examples/peers.py says how each is set up and measured.
The training data is one sequence of samples shared by all ranks (SampleStream): epoch
e is a permutation, seeded with seed + e, of the train split's non-overlapping windows of
block_size + 1 characters. Each optimizer step the ranks together take the next
world_size x accum x batch_size samples, rank r's micro-step m the batch_size samples at
position + (m x world_size + r) x batch_size; the position (samples consumed) then moves
past them. Two runs with the same flags see exactly the same data.

--save-every K writes a zero_ext checkpoint (zero_ext.save: every rank its shard,
replaced atomically) to --checkpoint every K steps and after the last, with the step and
the data position in its extra. When --checkpoint already holds a checkpoint (and
--save-every is given) the script resumes from it by itself; --resume PATH loads another
one. A checkpoint saved at any world size and stage loads at any other, and training
continues from its step with the samples that follow its data position: after a restart
at a new world size no sample is repeated or skipped (the ranks then split each step's
samples N' ways instead of N; a step's batch is world_size x accum x batch_size samples,
so the global batch changes with the world size, the per-rank batch does not). That is
how an elastic torchrun job runs (README, "Elastic training"):

    torchrun --nnodes=1:2 --nproc_per_node=2 --max-restarts=3 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST:29400 --rdzv-id=gpt examples/train_gpt.py --save-every 50 --checkpoint ckpt/gpt

--json OUT makes rank 0 write a summary (losses, step times, model-state bytes,
communication per step); examples/demo.py and benchmarks/bench_step.py read it.
Timing and communication are measured over the steps after --warmup, between barriers:
the step times on rank 0, zero_ext's own collective counters (opt.stats()), the bytes
sent on the loopback interface (/proc/net/dev; gloo on one host, so this is the wire
traffic of all ranks, plus that of anything else running on the machine), and the
bytes the rank processes wrote (/proc/self/io wchar, summed over ranks: gloo's socket
writes, immune to other processes' traffic). At the end every rank reads its peak
resident set size (VmHWM in /proc/self/status: the whole process, interpreter, torch
and data included, not just the model state) into "peak_rss_bytes_per_rank".
"""

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import peers
from common import leave_together, setup_distributed

from gpt import GPT, CharDataset, GPTConfig

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage (default 2)")
    parser.add_argument("--ddp", action="store_true", help="baseline: torch DDP + the same AdamW, no zero_ext")
    parser.add_argument("--fsdp2", action="store_true",
                        help="peer: torch FSDP2 (fully_shard per Block, then the root; CPU mesh, SUM reduction "
                             "divided by the world size) + the same AdamW, no zero_ext")
    parser.add_argument("--zero-redundancy", action="store_true",
                        help="peer: torch ZeroRedundancyOptimizer over the same AdamW, DDP for the gradients")
    parser.add_argument("--deepspeed", type=int, default=None, choices=[1, 2],
                        help="peer: DeepSpeed ZeRO stage 1 or 2 engine (CPU, gloo) with the same AdamW")
    parser.add_argument("--zero-config", type=json.loads, default={},
                        help='extra zeroify options as JSON, e.g. \'{"reduce_scatter": "native"}\'')
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before the timed window")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank per micro-step")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--lr-warmup", type=int, default=20, help="steps of linear learning-rate warmup")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm; 0 disables clipping")
    parser.add_argument("--accum", type=int, default=1,
                        help="micro-steps per optimizer step (no_sync on all but the last)")
    parser.add_argument("--adamw", default="default", choices=["default", "foreach", "fused"],
                        help="torch.optim.AdamW implementation (matters for --ddp only; zero_ext uses its own kernel)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--eval-iters", type=int, default=20, help="batches per split for the final loss estimate")
    parser.add_argument("--sample-chars", type=int, default=200, help="characters to generate at the end; 0 for none")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: 1 when world size > 1, else torch's default)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="compute precision. zero_ext: param_dtype (fp32 master weights in the shard, fp32 "
                             "gradient reduction; fp16 adds dynamic loss scaling); --ddp: torch.autocast; "
                             "--fsdp2: MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)")
    parser.add_argument("--json", type=Path, default=None, help="rank 0 writes the run summary here")
    parser.add_argument("--comm-delay-ms", type=float, default=0.0,
                        help="zero_ext only: delay every collective this much (zero_ext.delay_collectives), as "
                             "a slower link would; the summary's exposed_comm_ms_per_step shows what stays exposed")
    parser.add_argument("--save-every", type=int, default=0,
                        help="save a checkpoint every K steps and after the last (0: never)")
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/train_gpt"),
                        help="checkpoint directory that --save-every writes")
    parser.add_argument("--resume", type=Path, default=None,
                        help="continue from this checkpoint (saved at any world size and stage)")
    args = parser.parse_args(argv)
    if args.dtype == "fp16" and (args.ddp or args.fsdp2 or args.zero_redundancy or args.deepspeed is not None):
        parser.error("--dtype fp16 is for zero_ext (it scales the loss itself); use --dtype bf16 with a peer")
    if args.dtype != "fp32" and args.deepspeed is not None:
        parser.error("--deepspeed runs fp32 here (its bf16 mode is not wired up in this script)")
    if args.accum < 1 or args.steps < 1:
        parser.error("--accum and --steps must be >= 1")
    if sum([args.ddp, args.fsdp2, args.zero_redundancy, args.deepspeed is not None]) > 1:
        parser.error("--ddp, --fsdp2, --zero-redundancy and --deepspeed are exclusive")
    if (args.ddp or args.fsdp2 or args.zero_redundancy or args.deepspeed is not None) and \
            (args.save_every or args.resume):
        parser.error("--save-every and --resume are zero_ext checkpoints; drop the peer flag")
    return args


def has_checkpoint(path):
    """True when `path` (or the `path`.old a save interrupted between its renames left)
    holds a complete zero_ext checkpoint."""
    from zero_ext.checkpoint import MANIFEST, resolve
    return (Path(resolve(str(path))) / MANIFEST).exists()


def barrier():
    if dist.is_initialized():
        dist.barrier()


def build_optimizer(model, lr, weight_decay, adamw_impl):
    """AdamW with weight decay on matrices and embeddings only (not on biases or LayerNorms)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[adamw_impl]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), **impl)


def shard_fsdp2(model, dtype="fp32"):
    """torch FSDP2: fully_shard each Block, then the root, on a CPU mesh over all ranks.

    Must run before the optimizer is built (the parameters become DTensors). The
    reduction is pinned rather than left to the backend's AVG (which gloo has lacked):
    FSDP2 is told to use SUM only and to divide the gradients by the world size itself,
    so the reduced gradient is the mean over ranks, as DDP's.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if dtype == "bf16" else None,
                                  reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # Both setters apply to every FSDP module's parameter groups, so each module is set.
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(float(world_size))
    return model


def wrap_for_data_parallel(model, opt, args):
    """torch DDP (--ddp), FSDP2 (--fsdp2: already sharded, see shard_fsdp2) or zero_ext.zeroify.
    Returns (model, opt)."""
    if args.ddp:
        assert dist.is_initialized(), "--ddp needs a process group: run under torchrun (--nproc_per_node=1 is fine)"
        return DistributedDataParallel(model), opt
    if args.fsdp2:
        return model, opt
    if args.zero_redundancy:
        return peers.zero_redundancy(model, opt)
    if args.deepspeed is not None:
        return peers.deepspeed_engine(model, opt, args)
    import zero_ext
    options = {"param_dtype": args.dtype, **args.zero_config}
    model, opt = zero_ext.zeroify(model, opt, stage=args.stage, **options)
    if args.comm_delay_ms:
        zero_ext.delay_collectives(opt, args.comm_delay_ms)   # a slower link, to see what overlap hides
    return model, opt


def learning_rate(step, args):
    """Linear warmup to args.lr over args.lr_warmup steps, then constant."""
    return args.lr * min(1.0, (step + 1) / max(1, args.lr_warmup))


class SampleStream:
    """The train split as one sequence of samples that all ranks share (module docstring).

    position: samples consumed by the steps before this one (what a checkpoint stores).
    batch(m): this rank's micro-step m of the current step; advance() moves past the step.
    """

    def __init__(self, data, args, rank, world_size, position=0):
        self.split = data.splits["train"]
        self.block_size, self.batch_size, self.accum = args.block_size, args.batch_size, args.accum
        self.seed, self.rank, self.world_size = args.seed, rank, world_size
        self.num_windows = (len(self.split) - 1) // self.block_size
        self.position = position
        self._epoch, self._order = None, None

    def _start(self, sample):
        epoch, index = divmod(sample, self.num_windows)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = torch.randperm(self.num_windows, generator=torch.Generator().manual_seed(self.seed + epoch))
        return int(self._order[index]) * self.block_size

    def batch(self, micro):
        first = self.position + (micro * self.world_size + self.rank) * self.batch_size
        rows = [self.split[s:s + self.block_size + 1] for s in (self._start(first + i) for i in range(self.batch_size))]
        chunk = torch.stack(rows).long()
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def advance(self):
        self.position += self.world_size * self.accum * self.batch_size


def train_step(model, opt, stream, args, lr):
    """One optimizer step of args.accum micro-steps. Returns the mean micro-step loss (float)."""
    for group in opt.param_groups:          # zero_ext keeps the user's param_groups live, as torch does
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for micro in range(args.accum):
        x, y = stream.batch(micro)
        is_last = micro == args.accum - 1
        if args.fsdp2:                     # FSDP2 has no no_sync(): gradient sync is a module flag
            model.set_requires_gradient_sync(is_last)
            sync_context = contextlib.nullcontext()
        else:
            sync_context = contextlib.nullcontext() if is_last else model.no_sync()   # sync only on the last
        bf16_peer = (args.ddp or args.zero_redundancy) and args.dtype == "bf16"
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16_peer else contextlib.nullcontext()
        with sync_context:
            with autocast:
                _, loss = model(x, y)
            loss = loss.float()
            scaled = loss / args.accum
            if hasattr(opt, "scale_loss"):     # zero_ext: times the loss scale with fp16 (else unchanged)
                scaled = opt.scale_loss(scaled)
            scaled.backward()
        loss_sum += loss.item()
    if args.grad_clip > 0:
        if args.ddp or args.fsdp2 or args.zero_redundancy:   # torch's clip handles FSDP2's DTensor gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        else:
            opt.clip_grad_norm_(args.grad_clip)
    opt.step()
    return loss_sum / args.accum


@torch.no_grad()
def estimate_loss(model, data, args):
    """Mean loss over args.eval_iters fixed batches per split (the same on every rank and run)."""
    model.eval()
    losses = {}
    for split in ("train", "val"):
        generator = torch.Generator().manual_seed(args.seed)
        total = 0.0
        for _ in range(args.eval_iters):
            x, y = data.get_batch(split, args.batch_size, args.block_size, generator)
            total += model(x, y)[1].item()
        losses[split] = total / args.eval_iters
    model.train()
    return losses


def loopback_tx_bytes():
    """Bytes sent so far on the loopback interface 'lo' (Linux /proc/net/dev), or None."""
    try:
        with open("/proc/net/dev") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines[2:]:                       # two header lines
        name, fields = line.split(":", 1)
        if name.strip() == "lo":
            return int(fields.split()[8])        # 8 receive columns, then transmit bytes
    return None


def process_write_bytes():
    """Bytes this process has written so far, sockets included (Linux /proc/self/io wchar), or None."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_bytes():
    """This process's peak resident set size (VmHWM in /proc/self/status), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    value, unit = line.split()[1:3]
                    return int(value) * {"kB": 1024}.get(unit, 1)
    except (OSError, ValueError):
        pass
    return None


def peer(args):
    """The torch or DeepSpeed system run instead of zero_ext ("ddp", "fsdp2", ...), or None for zero_ext."""
    if args.deepspeed is not None:
        return f"deepspeed {args.deepspeed}"
    return "ddp" if args.ddp else "fsdp2" if args.fsdp2 else "zero_redundancy" if args.zero_redundancy else None


def comm_wait_s(opt, args):
    """Seconds zero_ext's host was blocked waiting for collectives (the exposed communication
    on the CPU; stats()["comm_wait_s"]); None for the peers, which do not count it."""
    return None if peer(args) else opt.stats()["comm_wait_s"]


def comm_counters(opt, args):
    """zero_ext's cumulative collective counters: (total bytes, {kind: bytes}); (None, {}) for the peers."""
    if peer(args):
        return None, {}
    stats = opt.stats()
    return stats["comm_bytes"], {kind: c["bytes"] for kind, c in stats["comm"].items()}


def memory_report(model, opt, args, deepspeed_grad_bytes=0):
    """(model-state bytes dict, buffer bytes) of this rank.

    zero_ext reports its own. For DDP the parameters, gradients and AdamW states are
    summed here, and its buffers are the reducer's gradient buckets (a copy of the
    gradients unless gradient_as_bucket_view=True), read from DDP's logging data, a
    private torch API: None where that is unavailable.
    For FSDP2 the same sums are taken over the local shards (DTensor.to_local()) of the
    parameters, their gradients and the AdamW states, i.e. what this rank holds between
    steps; its transient all-gather / reduce-scatter buffers have no public size, so
    buffer bytes are None (the peak RSS shows them, among everything else).
    ZeroRedundancyOptimizer and DeepSpeed: see examples/peers.py (DeepSpeed's gradients are
    measured before its last step, deepspeed_grad_bytes; its buckets have no public size).
    """
    if not peer(args):
        stats = opt.stats()
        return dict(stats["model_state_bytes"]), stats["buffer_bytes"]["total"]
    if args.deepspeed is not None:
        return peers.deepspeed_state_bytes(model, opt, deepspeed_grad_bytes), None

    if args.fsdp2:
        model.reshard()          # the root keeps its parameters unsharded after a forward (the evaluation)

    def nbytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t     # DTensor: this rank's shard
        return t.numel() * t.element_size()

    params = list(model.parameters())                          # shared parameters once
    state = {
        "parameters": sum(nbytes(p) for p in params),
        "gradients": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "master_weights": 0,
        "optimizer_states": sum(nbytes(t) for s in opt.state.values()
                                for t in s.values() if torch.is_tensor(t) and t.dim() > 0),
    }
    state["total"] = sum(state.values())
    if args.fsdp2:
        return state, None
    if args.zero_redundancy:                                   # only the owned parameters' moments
        state = peers.zero_redundancy_state_bytes(model, opt)
    try:
        logging_data = model._get_ddp_logging_data()
        bucket_bytes = sum(int(b) for b in str(logging_data["bucket_sizes"]).split(",") if b.strip())
        buffer_bytes = 0 if logging_data["gradient_as_bucket_view"] else bucket_bytes
    except (AttributeError, KeyError, ValueError):
        buffer_bytes = None
    return state, buffer_bytes


def train(args):
    """Build, train, measure, report. Returns the summary dict on every rank."""
    rank, world_size, threads = setup_distributed(args.threads)
    is_master = rank == 0

    def log(message):
        if is_master:
            print(message, flush=True)

    data = CharDataset(args.data)
    torch.manual_seed(args.seed)                               # same initial weights on every rank
    config = GPTConfig(vocab_size=data.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config)
    num_params = model.num_params()
    if args.fsdp2:
        assert dist.is_initialized(), "--fsdp2 needs a process group: run under torchrun (--nproc_per_node=1 is fine)"
        model = shard_fsdp2(model, args.dtype)                 # before the optimizer: params become DTensors
    opt = build_optimizer(model, args.lr, args.weight_decay, args.adamw)
    model, opt = wrap_for_data_parallel(model, opt, args)
    system = peer(args) or f"stage {args.stage}"
    tokens_per_step = args.batch_size * args.block_size * args.accum * world_size
    log(f"{system} | {args.dtype} | world size {world_size} | {threads} thread(s) per rank | {num_params:,} parameters | "
        f"{tokens_per_step:,} tokens per step | torch {torch.__version__}")

    start_step, position = 0, 0
    resume = args.resume
    if resume is None and args.save_every and has_checkpoint(args.checkpoint):
        resume = args.checkpoint                               # a restarted job picks up where it was
    if resume is not None:
        import zero_ext
        extra = zero_ext.load(resume, model, opt)
        start_step = extra["step"]
        position = extra.get("samples", 0)
        log(f"resumed from {resume} at step {start_step} (samples consumed {position:,}), saved at world size "
            f"{extra.get('world_size', '?')}, now world size {world_size}; torchrun restart "
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', 'n/a')}")
        if start_step >= args.steps:
            if args.resume is not None:
                raise SystemExit(f"the checkpoint is at step {start_step}; raise --steps to train further")
            log(f"the checkpoint is at step {start_step} >= --steps {args.steps}: nothing left to train")
            return None
    stream = SampleStream(data, args, rank, world_size, position)
    warmup = min(start_step + args.warmup, args.steps - 1)
    step_times, losses = [], []
    deepspeed_grad_bytes = []                                  # --deepspeed: measured before the last step
    for step in range(start_step, args.steps):
        if step == warmup:                                     # the timed window starts here
            barrier()
            wire_start = loopback_tx_bytes()
            written_start = process_write_bytes()
            comm_start, kinds_start = comm_counters(opt, args)
            wait_start = comm_wait_s(opt, args)
        t0 = time.perf_counter()
        if args.deepspeed is not None:                         # the engine owns backward and step
            loss = peers.deepspeed_train_step(model, opt, stream, args, learning_rate(step, args),
                                              deepspeed_grad_bytes if step == args.steps - 1 else None)
        else:
            loss = train_step(model, opt, stream, args, learning_rate(step, args))
        stream.advance()
        step_times.append(time.perf_counter() - t0)
        losses.append(loss)
        if step % args.log_every == 0 or step == args.steps - 1:
            log(f"step {step:5d} | loss {loss:.4f} | {1000 * step_times[-1]:7.1f} ms | "
                f"{tokens_per_step / step_times[-1]:8.0f} tokens/s")
        if args.save_every and ((step + 1) % args.save_every == 0 or step == args.steps - 1):
            import zero_ext
            zero_ext.save(args.checkpoint, model, opt,
                          extra={"step": step + 1, "samples": stream.position, "world_size": world_size})
            log(f"saved {args.checkpoint} at step {step + 1} (samples consumed {stream.position:,}, "
                f"world size {world_size})")
    barrier()
    wire_end = loopback_tx_bytes()
    written_end = process_write_bytes()
    comm_end, kinds_end = comm_counters(opt, args)
    timed = step_times[warmup - start_step:]
    timed_steps = len(timed)
    wait_end = comm_wait_s(opt, args)
    exposed_ms = None if wait_end is None else 1000 * (wait_end - wait_start) / timed_steps

    final = estimate_loss(model, data, args)
    model_state, buffer_bytes = memory_report(model, opt, args, sum(deepspeed_grad_bytes))
    written = None if written_start is None else written_end - written_start
    peak_rss = peak_rss_bytes()
    # (model-state bytes, bytes written, peak RSS) by rank
    per_rank = [(model_state["total"], written, peak_rss)] * world_size
    if dist.is_initialized():
        dist.all_gather_object(per_rank, (model_state["total"], written, peak_rss))
    model_state_per_rank = [total for total, _, _ in per_rank]
    peak_rss_per_rank = [rss for _, _, rss in per_rank]
    written_per_step = None if written is None else sum(w for _, w, _ in per_rank) / timed_steps
    if args.ddp:                                               # no counters: DDP all-reduces 2 x 4 bytes x params
        comm_per_step, comm_source = 2 * 4 * num_params, "theory"
        comm_kinds_per_step = {"all_reduce": comm_per_step}
    elif peer(args):                                           # FSDP2, ZeroRedundancyOptimizer, DeepSpeed
        # No counters: the bytes all ranks wrote (gloo's socket writes) / (N - 1). Each rank
        # sends (N - 1)/N of a collective's tensor, so this is the counters' convention (a
        # collective at its full tensor size, all-reduce twice); at N = 2 zero_ext's counters
        # and its ranks' written bytes agree to 0.1%.
        comm_per_step = None if written_per_step is None else written_per_step / max(1, world_size - 1)
        comm_source = "written"
        comm_kinds_per_step = {}
    else:
        comm_per_step, comm_source = (comm_end - comm_start) / timed_steps, "counters"
        comm_kinds_per_step = {k: (kinds_end[k] - kinds_start.get(k, 0)) / timed_steps for k in kinds_end}
    wire_per_step = None if wire_start is None else (wire_end - wire_start) / timed_steps
    median_s = statistics.median(timed)
    stats = None if peer(args) else opt.stats()

    summary = {
        "system": system,
        "stage": None if peer(args) else args.stage,
        "world_size": world_size,
        "dtype": args.dtype,
        "threads_per_rank": threads,
        "torch_version": torch.__version__,
        "isa": torch.backends.cpu.get_cpu_capability() if stats is None else stats["isa"],
        "num_params": num_params,
        "tokens_per_step": tokens_per_step,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "steps": args.steps,
        "timed_steps": timed_steps,
        "losses": losses,                                      # rank 0's training loss per step
        "final_train_loss": final["train"],
        "final_val_loss": final["val"],
        "step_time_ms": {"median": 1000 * median_s, "min": 1000 * min(timed), "max": 1000 * max(timed),
                         "mean": 1000 * statistics.mean(timed)},
        "tokens_per_s": tokens_per_step / median_s,
        "model_state_bytes": model_state,                      # rank 0
        "model_state_bytes_per_rank": model_state_per_rank,   # totals, by rank
        "buffer_bytes": buffer_bytes,
        "peak_rss_bytes_per_rank": peak_rss_per_rank,         # VmHWM at the end, by rank (whole process)
        "comm_bytes_per_step": comm_per_step,                  # per rank; all_reduce counted twice
        "comm_bytes_per_step_by_kind": comm_kinds_per_step,
        "comm_source": comm_source,
        "exposed_comm_ms_per_step": exposed_ms,                # rank 0 blocked in collective waits
        "comm_delay_ms": args.comm_delay_ms,                   # every collective delayed this much
        "wire_bytes_per_step": wire_per_step,                  # loopback, all ranks together
        "written_bytes_per_step": written_per_step,            # /proc/self/io wchar, all ranks together
        "zero_ext_stats": stats,
    }

    log(f"final | train loss {final['train']:.4f} | val loss {final['val']:.4f} | "
        f"median step {1000 * median_s:.1f} ms | {tokens_per_step / median_s:.0f} tokens/s")
    log(f"model-state bytes per rank: {model_state_per_rank} "
        f"({', '.join(f'{k} {v:,}' for k, v in model_state.items() if k != 'total')}); "
        f"buffer bytes: {buffer_bytes if buffer_bytes is not None else 'n/a'}")
    wire_text = "n/a" if wire_per_step is None else f"{wire_per_step:,.0f}"
    written_text = "n/a" if written_per_step is None else f"{written_per_step:,.0f}"
    comm_text = "n/a" if comm_per_step is None else f"{comm_per_step:,.0f}"
    log(f"peak RSS per rank (VmHWM): {peak_rss_per_rank}")
    log(f"communication per step: {comm_text} bytes per rank ({comm_source}; "
        f"{', '.join(f'{k} {v:,.0f}' for k, v in comm_kinds_per_step.items())}) | "
        f"all ranks: loopback {wire_text}, written by the ranks {written_text}")
    if args.sample_chars > 0:
        # Every rank generates the same sample: at stage 3 the module's forward gathers
        # parameters, a collective that all ranks must join.
        start = torch.tensor([data.encode("\n")], dtype=torch.long)
        sample_generator = torch.Generator().manual_seed(args.seed)
        out = getattr(model, "module", model).generate(start, args.sample_chars, generator=sample_generator)
        summary["sample"] = data.decode(out[0].tolist())
        log("sample:\n" + summary["sample"])
    if is_master and args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None):
    args = parse_args(argv)
    train(args)
    leave_together()                   # after rank 0's sample and JSON


if __name__ == "__main__":
    main()
