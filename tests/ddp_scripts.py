"""Three DDP training scripts in the shapes users copy, each run as written under DDP and
with the DDP line replaced by zeroify (tests/test_ddp_scripts.py compares them):

- tutorial(): PyTorch's DDP tutorial model and loop with the AMP recipe of torch's
  docs (autocast, GradScaler: scale(loss).backward(), step, update; no unscale_).
- gpt(): nanoGPT's train.py: AdamW over decay / no-decay param groups, a warmup +
  cosine LR written into param_groups, gradient accumulation through
  require_backward_grad_sync, GradScaler with unscale_ + torch's clip_grad_norm_;
  resumes by loading the checkpoint into the bare model and the torch optimizer
  *before* the wrapper line.
- built_after(): the DDP tutorial's and FSDP2's order: the model is wrapped first and the
  optimizer (any of OPTIMIZERS) is built over what the wrapper returned, then its scheduler.
- imagenet(): pytorch/examples' ImageNet main.py: SGD with momentum and weight decay,
  StepLR per epoch, cross-entropy, an optional GradScaler whose state rides in the
  checkpoint; resumes by loading model, optimizer, scheduler (and scaler) state *after*
  the wrapper line.

Each checkpoints the DDP way: state_dict() on every rank, rank 0 saves.
Each returns what it logged per step, (loss, GradScaler scale or None), and the final weights;
tutorial() and gpt() run on `device` (tests/test_gpu_multirank.py runs them on a GPU).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

FP16 = torch.float16


def wrap(model, optimizer, how):
    """The wrapper line: DDP for how=None, else zeroify(model, optimizer, **how); with
    how["optimizer"] == "unpassed", `model = zeroify(model, **rest)`: the script goes on
    stepping the optimizer it built, which zeroify was never given (Note [Adopted optimizers])."""
    if how is None:
        return nn.parallel.DistributedDataParallel(model), optimizer
    import zero_ext
    how = dict(how)
    if how.pop("optimizer", None) == "unpassed":
        return zero_ext.zeroify(model, **how), optimizer
    return zero_ext.zeroify(model, optimizer, **how)


def run_scripts(rank, tmp: str, hows: dict, runs: list) -> dict:
    """(tag, key) -> what each script logged: every (key, script, kwargs) of `runs` under every
    wrapper line `hows[tag]`, each with checkpoint files of its own under tmp."""
    import os
    out = {}
    for tag, how in hows.items():
        for key, script, kw in runs:
            kw = dict(kw)
            if "ckpt" in kw:
                kw["ckpt"] = os.path.join(tmp, f"{tag}-{kw['ckpt']}")
            out[(tag, key)] = globals()[script](rank, how, **kw)
    return out


def model_state(model) -> dict:
    """nanoGPT's raw_model.state_dict(), raw_model = model.module (DDP's and zeroify's alike)."""
    return model.module.state_dict()


def save(obj, path: str) -> None:
    if dist.get_rank() == 0:
        torch.save(obj, path)
    dist.barrier()


# a GradScaler whose first steps overflow on every rank (fp16 gradients at a scale of 2^40)
HUGE_SCALE = dict(init_scale=2.0 ** 40, backoff_factor=2.0 ** -6, growth_interval=3)


def worst_loss_rel(got: list, ref: list) -> float:
    """Largest relative difference between two runs' logged losses."""
    return max(abs(g - r) / max(abs(r), 1e-30) for (g, _), (r, _) in zip(got, ref))


def worst_weight_rel(got: dict, want: dict) -> float:
    """Largest relative difference of a weight tensor (max |a - b| / max |b|)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max(((got[k].double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30)).item()
               for k, w in want.items())


def _scale(scaler):
    return scaler.get_scale() if scaler.is_enabled() else None


def _result(log: list, model, how) -> dict:
    return {"log": log, "weights": {k: v.detach().cpu().clone() for k, v in model_state(model).items()}}


# ------------------------------------------------------------------ the DDP tutorial, AMP recipe
class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 11)     # 181 parameters: no world size 2-3 divides them
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(11, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def tutorial(rank, how, steps: int, amp: bool, scaler_kw: dict | None = None, poison=None,
             device: str = "cpu") -> dict:
    """poison=(rank, step): that rank makes one element of net2.weight's gradient inf at
    that step, before the gradients are reduced."""
    torch.manual_seed(0)
    model = ToyModel().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler(device, enabled=amp, **(scaler_kw or {}))
    if poison is not None and poison[0] == rank:
        state = {"step": -1}
        at = (torch.tensor([3], device=device), torch.tensor([7], device=device))
        model.net2.weight.register_hook(
            lambda g: g.index_put(at, torch.tensor(math.inf, device=device)) if state["step"] == poison[1] else g)
    ddp_model, optimizer = wrap(model, optimizer, how)
    loss_fn = nn.MSELoss()
    log = []
    for step in range(steps):
        if poison is not None and poison[0] == rank:
            state["step"] = step
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, labels = torch.randn(20, 10, generator=g).to(device), torch.randn(20, 5, generator=g).to(device)
        optimizer.zero_grad()
        with torch.autocast(device, dtype=FP16, enabled=amp):
            outputs = ddp_model(x)
            loss = loss_fn(outputs.float(), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        log.append((loss.item(), _scale(scaler)))
    return _result(log, ddp_model, how)


# ------------------------------------------------------------------ the optimizer built after the wrapper
def _decay_groups(model, **kw):
    """nanoGPT's weight decay on the matrices only, over what the wrapper returned."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def _muon_recipe(model) -> list:
    """Muon over the first matrix (hidden), AdamW over the rest: two optimizers."""
    hidden = next(p for p in model.parameters() if p.dim() == 2)
    return [torch.optim.Muon([hidden], lr=2e-2),
            torch.optim.AdamW([p for p in model.parameters() if p is not hidden], lr=1e-2)]


OPTIMIZERS = {
    "adamw-groups": lambda m: [torch.optim.AdamW(_decay_groups(m), lr=1e-2)],
    "sgd-nesterov": lambda m: [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                                               weight_decay=1e-4)],
    "adagrad": lambda m: [torch.optim.Adagrad(m.parameters(), lr=0.05)],
    "rmsprop": lambda m: [torch.optim.RMSprop(m.parameters(), lr=1e-2, momentum=0.5)],
    "muon+adamw": lambda m: _muon_recipe(m),
}


def built_after(rank, how, optimizer: str, steps: int = 5, device: str = "cpu") -> dict:
    """how=None: DDP; else `model = zeroify(model, **how)` (no optimizer given), or with
    how["optimizer"] == "passed" the same optimizer built first and given to zeroify."""
    torch.manual_seed(0)
    model = ToyModel().to(device)
    how = dict(how) if how is not None else None
    if how is not None and how.pop("optimizer", None) == "passed":
        import zero_ext
        opts = OPTIMIZERS[optimizer](model)
        model, opts = zero_ext.zeroify(model, opts if len(opts) > 1 else opts[0], **how)
        opts = opts if isinstance(opts, list) else [opts]
    else:
        if how is None:
            model = nn.parallel.DistributedDataParallel(model)
        else:
            import zero_ext
            model = zero_ext.zeroify(model, **how)
        opts = OPTIMIZERS[optimizer](model)
    schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps) for o in opts]
    log = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, labels = torch.randn(20, 10, generator=g).to(device), torch.randn(20, 5, generator=g).to(device)
        for o in opts:
            o.zero_grad()
        loss = nn.functional.mse_loss(model(x), labels)
        loss.backward()
        for o, s in zip(opts, schedulers):
            o.step()
            s.step()
        log.append((loss.item(), None))
    out = _result(log, model, how)
    out["types"] = [type(o).__name__ for o in opts] + [type(model).__name__]
    return out


# ------------------------------------------------------------------ nanoGPT's train.py
GPT_CONFIG = dict(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=24, bias=False)


def configure_optimizers(model, weight_decay, learning_rate, betas):
    """nanoGPT's GPT.configure_optimizers: weight decay on the matrices only."""
    param_dict = {pn: p for pn, p in model.named_parameters() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    optim_groups = [{"params": decay_params, "weight_decay": weight_decay},
                    {"params": nodecay_params, "weight_decay": 0.0}]
    return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


def gpt(rank, how, max_iters: int, amp: bool, ckpt: str | None = None, save_at: int | None = None,
        resume: bool = False, scaler_kw: dict | None = None, grad_clip: float = 1.0, device: str = "cpu") -> dict:
    from gpt import GPT, GPTConfig

    learning_rate, warmup_iters, lr_decay_iters, min_lr = 3e-3, 2, 12, 3e-4
    gradient_accumulation_steps, batch_size = 2, 4
    torch.manual_seed(1337)
    model = GPT(GPTConfig(**GPT_CONFIG)).to(device)
    iter_num = 0
    checkpoint = None
    if resume:
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(checkpoint["model"])
        iter_num = checkpoint["iter_num"]
    optimizer = configure_optimizers(model, 0.1, learning_rate, (0.9, 0.95))
    if resume:
        optimizer.load_state_dict(checkpoint["optimizer"])
    checkpoint = None
    scaler = torch.amp.GradScaler(device, enabled=amp, **(scaler_kw or {}))
    model, optimizer = wrap(model, optimizer, how)     # nanoGPT: model = DDP(model, device_ids=[...])

    def get_lr(it):
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

    def get_batch(it, micro):
        g = torch.Generator().manual_seed(10_000 * it + 100 * micro + rank)
        data = torch.randint(0, GPT_CONFIG["vocab_size"], (batch_size, GPT_CONFIG["block_size"] + 1), generator=g)
        return data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)

    log = []
    while iter_num < max_iters:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if ckpt is not None and save_at is not None and iter_num == save_at:
            checkpoint = {"model": model_state(model), "optimizer": optimizer.state_dict(),
                          "iter_num": iter_num}
            save(checkpoint, ckpt)
        for micro_step in range(gradient_accumulation_steps):
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
            X, Y = get_batch(iter_num, micro_step)
            with torch.autocast(device, dtype=FP16, enabled=amp):
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        log.append((loss.item() * gradient_accumulation_steps, _scale(scaler)))
        iter_num += 1
    return _result(log, model, how)


# ------------------------------------------------------------------ pytorch/examples' ImageNet main.py
class SmallNet(nn.Module):
    def __init__(self, num_classes=7):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                                      nn.Conv2d(6, 5, 3, padding=1), nn.ReLU(inplace=True))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(5, num_classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def imagenet(rank, how, epochs: int, amp: bool, ckpt: str | None = None, save_after: int | None = None,
             resume: bool = False, batches: int = 3) -> dict:
    torch.manual_seed(0)
    model = SmallNet()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    model, optimizer = wrap(model, optimizer, how)     # main.py: model = DDP(model, device_ids=[args.gpu])
    start_epoch = 0
    if resume:
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
        start_epoch = checkpoint["epoch"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        scaler.load_state_dict(checkpoint["scaler"])
    log = []
    for epoch in range(start_epoch, epochs):
        model.train()
        for i in range(batches):
            g = torch.Generator().manual_seed(1000 * epoch + 10 * i + rank)
            images, target = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 7, (4,), generator=g)
            with torch.autocast("cpu", dtype=FP16, enabled=amp):
                output = model(images)
                loss = criterion(output.float(), target)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            log.append((loss.item(), _scale(scaler)))
        scheduler.step()
        if epoch + 1 == save_after:
            save({"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict()}, ckpt)
    return _result(log, model, how)
