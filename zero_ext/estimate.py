"""Per-rank memory of a zero_ext run, predicted before launch: what opt.stats() reports after
the first step, byte for byte (EngineStats::of in csrc/engine/stats.cpp), with the engine's own
bucket planner. Activations and framework memory are not included (loss_fn adds a "peak").

    est = zero_ext.estimate_memory(model, world_size=64, stage=2, param_dtype="bf16", optimizer=opt)
    python -m zero_ext.estimate --params 7.5e9 --world 64 --param-dtype bf16 --reduce-dtype bf16

The model may be on the meta device, or be a parameter count: then one tensor per bucket
(stage 3: units of unit_numel, by default a quarter of the model, and no root unit).

Note [What estimate_memory counts]
  The shard is this rank's 1/N of the padded elements; units are stage 3's gathered modules.
  - parameters: stages 0-2 every bucket, padded, in param_dtype; stage 3 the fp32 shard when
    param_dtype is fp32 (it is the master), else none.
  - gradients: stages 0-1 every bucket in reduce_dtype; stages 2-3 the shard.
  - master_weights: an fp32 shard with bf16/fp16 params, or with param_quant in stages 1-2;
    with master_remainder 2 bytes and a bit per element (Note [Split master in the engine]).
  - optimizer_states: states per element x the shard, 4 bytes (2 with state_dtype bf16).
    Adam keeps 2 (3 with amsgrad), SGD with momentum 1; others are counted by one tiny step.
  - buffer_bytes: the gradient ring; stage 3 also the most units whole at once (root,
    computing and prefetched: replay_peak, csrc/engine/unit_schedule.h). A meta build holds
    at least the root and one unit in fp32 while initialized.
  - offload: host memory, outside "total": master, states, gradient shard, pinned rings.
  - frozen: untrained parameters in param_dtype, whole in stages 0-2; stage 3 shards them per
    unit (each unit padded to N * align).
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

from . import peak
from ._C import buffer_bytes, model_state_bytes, plan_alignments, plan_layout
from .comm import device_backend
from .config import ZeroConfig, make_config

_SIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
_ZX_DTYPE = {"fp32": 0, "bf16": 1, "fp16": 2}
_FUSED_NAMES = ("AdamW", "Adam", "SGD")


def _optimizer_class_and_groups(optimizer):
    """(class, [each param group's hyperparameters]) from an optimizer, its class or its name."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer), [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if isinstance(optimizer, str):
        names = {n.lower(): n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)}
        if optimizer.lower() not in names:
            raise ValueError(f"zero_ext: unknown optimizer {optimizer!r}; give a torch.optim class, an "
                             f"instance, or one of {', '.join(sorted(names))}; pass e.g. optimizer='AdamW'")
        optimizer = getattr(torch.optim, names[optimizer.lower()])
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer, [{}]
    raise TypeError(f"zero_ext: optimizer must be a torch.optim.Optimizer, its class or its name, "
                    f"got {type(optimizer).__name__}; pass e.g. optimizer=torch.optim.AdamW or 'AdamW'")


def states_per_element(cls, hyper: dict) -> int:
    """Per-element state tensors `cls(**hyper)` keeps, counted after one step on a tiny tensor."""
    p = nn.Parameter(torch.zeros(7))
    p.grad = torch.full((7,), 0.5)
    hyper = {k: v for k, v in hyper.items() if k not in ("foreach", "fused", "capturable", "differentiable")}
    opt = cls([dict(hyper, params=[p])])
    opt.step()
    return sum(1 for t in opt.state[p].values() if torch.is_tensor(t) and t.numel() == p.numel() and t.dim() > 0)


def _model_layout(model_or_numel, optimizer, cfg: ZeroConfig):
    """(trainable numels, their groups, stage 3's unit ids or None, replicated frozen numel,
    [(unit, numel)] of the frozen parameters stage 3 shards)."""
    if isinstance(model_or_numel, nn.Module):
        model = model_or_numel
        first: dict = {}   # id -> (parameter, its group), the first time it is listed
        for gi, g in enumerate(optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer)
                               else [{"params": model.parameters()}]):
            for p in g["params"]:
                if p.requires_grad:
                    first.setdefault(id(p), (p, gi))
        params, groups = [p for p, _ in first.values()], [gi for _, gi in first.values()]
        if not params:
            raise ValueError("zero_ext: the model has no trainable parameter (none with requires_grad=True); "
                             "set requires_grad=True on those to train, or pass their parameter count instead")
        from .units import assign_units, frozen_to_shard
        ids = {id(p) for p in params}
        frozen = [p for p in model.parameters() if id(p) not in ids]
        sharded = frozen_to_shard(frozen, cfg.stage, cfg.param_dtype)
        replicated = sum(p.numel() for p in frozen) - sum(p.numel() for p in sharded)
        units, frozen_units = None, []
        if cfg.stage == 3:
            units = assign_units(model, params + sharded, cfg.unit_modules, cfg.unit_numel, cfg.min_unit_numel)[0]
            frozen_units = [(u, p.numel()) for u, p in zip(units[len(params):], sharded)]
            units = units[:len(params)]
        return [p.numel() for p in params], groups, units, replicated, frozen_units
    numel = int(model_or_numel)
    if numel < 1:
        raise ValueError(f"zero_ext: the parameter count must be >= 1, got {model_or_numel!r}; pass the model "
                         f"or its number of trainable parameters")
    if cfg.stage == 3:   # units of unit_numel (validated >= 1), else of a quarter
        per = cfg.unit_numel or max(numel // 4, 1)
    else:                # buckets of bucket_bytes
        per = max(1, cfg.resolved_bucket_bytes(4 * numel) // _SIZE[cfg.param_dtype])
    sizes = [per] * (numel // per) + ([numel % per] if numel % per else [])
    return sizes, [0] * len(sizes), list(range(1, len(sizes) + 1)) if cfg.stage == 3 else None, 0, []


def estimate_memory(model_or_numel, world_size: int, stage: int, *, param_dtype="fp32", reduce_dtype="fp32",
                    optimizer="adamw", backend: str = "gloo", config=None, loss_fn=None, **options) -> dict:
    """What one rank of a zero_ext run holds (see the module docstring): opt.stats()'s keys, plus
    "total", "comm_bytes_per_step" and the inputs. model_or_numel: a module (meta too) or a count;
    optimizer: an instance, a class or a name ("adamw"); backend: the process group's ("gloo" sizes
    all-to-all buffers); loss_fn(model) -> loss: adds "peak" (zero_ext/peak.py)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"zero_ext: world_size must be an int >= 1, got {world_size!r}; pass world_size=<the "
                         f"number of ranks>")
    options = dict(options, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    options.pop("process_group", None)
    cfg = make_config(config, stage, options)
    if not isinstance(cfg.stage, int):
        raise ValueError(f"zero_ext: estimate_memory needs a stage 0-3, got {cfg.stage!r}; pass stage=0, 1, 2 or "
                         f"3 (stage='auto' is decided from these estimates)")
    cls, hypers = _optimizer_class_and_groups(optimizer)
    numels, groups, units, frozen, frozen_units = _model_layout(model_or_numel, optimizer, cfg)
    pdt, rdt = cfg.param_dtype, cfg.reduce_dtype
    ps, rs = _SIZE[pdt], _SIZE[rdt]
    s = cfg.stage
    rows = plan_layout(numels, groups, units or [], s, 1 if s == 0 else world_size,   # csrc/plan_binding.cpp
                       cfg.resolved_bucket_bytes(4 * sum(numels)), cfg.first_bucket_bytes,
                       cfg.resolved_align(world_size), _ZX_DTYPE[pdt])
    fused = cls.__name__ in _FUSED_NAMES and issubclass(cls, tuple(getattr(torch.optim, n) for n in _FUSED_NAMES)) \
        and cfg.fused != "never"
    counts = [states_per_element(cls, h) for h in hypers]
    module = model_or_numel if isinstance(model_or_numel, nn.Module) else nn.Module()
    dev = next((p.device.type for p in module.parameters() if not p.is_meta), "cuda")   # a count, meta: "cuda"
    alltoall = cfg.reduce_scatter == "alltoall" or (cfg.reduce_scatter == "auto" and device_backend(backend) == "gloo")
    adam, bf16_states = issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)), cfg.state_dtype == "bf16"
    if bf16_states and not (fused and adam):   # Note [bf16 optimizer states] (csrc/engine/stepper.cpp)
        raise ValueError(f"zero_ext: state_dtype='bf16' is a mode of the fused Adam/AdamW kernels, not of "
                         f"{cls.__name__}; estimate with optimizer='adamw' (or 'adam'), or state_dtype='fp32'")
    if bf16_states and any(h.get("amsgrad") for h in hypers):
        raise ValueError("zero_ext: state_dtype='bf16' has no bf16 form of amsgrad's state; estimate with "
                         "amsgrad=False, or state_dtype='fp32'")
    m = model_state_bytes(   # csrc/engine/model_state.h
        [r[0] for r in rows], [r[3] for r in rows], [r[4] for r in rows], stage=s, world=world_size, param_bytes=ps,
        reduce_bytes=rs, state_bytes=2 if bf16_states else 4, states_per_group=counts, fused=fused, adam=adam,
        param_quant=cfg.param_quant is not None, grad_quant=cfg.grad_quant is not None, alltoall=alltoall,
        offload=cfg.offload is not None, master_remainder=cfg.master_remainder_applies(fused),
        on_gpu=dev == "cuda", step_in_backward=bool(cfg.step_in_backward))
    msb = m["model_state_bytes"]
    piece, slice_align = plan_alignments(cfg.resolved_align(world_size), _ZX_DTYPE[pdt])   # Note [Aligned pieces]
    b = buffer_bytes([r[1] for r in rows], [r[3] for r in rows], frozen_units, stage=s, world=world_size,
                     param_bytes=ps, reduce_bytes=rs, grad_ring_buckets=cfg.grad_ring_buckets, depth=cfg.prefetch_depth,
                     coalesce_numel=cfg.coalesce_numel, accum=cfg.accumulation_steps, piece_align=piece,
                     slice_align=slice_align, alltoall=alltoall, narrow_wire=dev == "cpu" and cfg.offload is
                     cfg.grad_quant is None, on_meta=any(p.is_meta for p in module.parameters()))
    buf = dict(grad_ring=b["grad_ring"], ring_slots=b["ring_slots"], grad_landing=m["grad_landing"],
               split_master_scratch=m["split_master_scratch"])
    buf.update({k: b[k] for k in ("gathered_root", "gathered_unit", "prefetch", "peak_gathered_params") if s == 3})
    buf["total"] = b["grad_ring"] + m["grad_landing"] + m["split_master_scratch"] + buf.get("peak_gathered_params", 0)
    frozen_b = frozen * ps + b["frozen_sharded"]
    est = {
        "stage": s, "world_size": world_size, "param_dtype": pdt, "reduce_dtype": rdt,
        "optimizer": cls.__name__, "fused": fused, "states_per_element": max(counts) if fused else counts,
        "num_params": sum(numels), "padded_numel": sum(r[3] for r in rows), "shard_numel": sum(r[4] for r in rows),
        "num_buckets": len(rows), "model_state_bytes": msb, "buffer_bytes": buf, "frozen_parameter_bytes": frozen_b,
        "total": msb["total"] + buf["total"] + frozen_b,
        "comm_bytes_per_step": b["comm"], "accumulation_steps": cfg.accumulation_steps, "offload": m["offload"],
    }
    if loss_fn is not None:
        kept = s <= 1 and (cfg.offload is not None or bool(cfg.step_in_backward))   # Note [Bucket gradient lifetime]
        grad_bytes = rs if s <= 1 and not kept else 0
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(pdt, torch.float32)
        act = peak.activation_peak(model_or_numel, loss_fn, dtype, grad_bytes, b["grad_ring"] if grad_bytes else 0)
        est["peak"] = peak.peak_bytes(est, cfg.prefetch_depth, act, dev != "cuda", kept)
    return est


def _table(a) -> str:
    """The table `python -m zero_ext.estimate` prints for its parsed arguments `a`."""
    numel, unit, offload = int(a.params), 2 ** 30 if a.gib else 1e9, "cpu" if a.offload else None
    unit_numel = None if a.unit_numel is None else int(a.unit_numel)
    head = (f"{'stage':>5} {'parameters':>11} {'gradients':>10} {'masters':>9} {'opt states':>11} "
            f"{'model state':>12} {'buffers':>9} {'comm/step':>10}" + (f" {'host':>9}" if offload else ""))
    lines = [f"Ψ = {numel:,.0f} trainable parameters, N = {a.world}, params {a.param_dtype}, reduce "
             f"{a.reduce_dtype}, {a.optimizer}{', bf16 states' if a.state_dtype == 'bf16' else ''}"
             f"{', offload=cpu' if offload else ''}{', step in backward' if a.step_in_backward else ''}"
             f"{', fp32 masters' if a.fp32_master else ''}; per rank, in "
             f"{'GiB (2^30' if a.gib else 'GB (10^9'} bytes)", head, "-" * len(head)]
    for stage in range(1 if offload or a.step_in_backward else 0, 4):   # neither shards anything in stage 0
        e = estimate_memory(numel, a.world, stage, param_dtype=a.param_dtype, reduce_dtype=a.reduce_dtype,
                            optimizer=a.optimizer, accumulation_steps=a.accum, unit_numel=unit_numel,
                            state_dtype=a.state_dtype, offload=offload, step_in_backward=a.step_in_backward,
                            master_remainder=not a.fp32_master)
        m, b = e["model_state_bytes"], e["buffer_bytes"]
        lines.append(f"{stage:>5} {m['parameters'] / unit:>11.2f} {m['gradients'] / unit:>10.2f} "
                     f"{m['master_weights'] / unit:>9.2f} {m['optimizer_states'] / unit:>11.2f} "
                     f"{m['total'] / unit:>12.1f} {b['total'] / unit:>9.2f} {e['comm_bytes_per_step'] / unit:>10.1f}"
                     + (f" {e['offload']['total'] / unit:>9.1f}" if offload else ""))
    lines.append("model state = parameters + gradients + masters + optimizer states (the ZeRO paper's "
                 "Table I); buffers = gradient ring and, stage 3, the gathered units (from a bare count: "
                 f"units of {'a quarter of the model' if unit_numel is None else f'{unit_numel:,} parameters'}); "
                 "comm/step = collective bytes per optimizer step"
                 + ("; host = what offload keeps in host memory (masters, states, gradient shard, pinned rings)"
                    if offload else ""))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m zero_ext.estimate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, required=True, help="trainable parameters, e.g. 7.5e9")
    ap.add_argument("--world", type=int, required=True, help="world size N")
    ap.add_argument("--param-dtype", default="bf16", help="fp32, bf16 or fp16 (default bf16)")
    ap.add_argument("--reduce-dtype", default="bf16", help="fp32, bf16 or fp16 (default bf16)")
    ap.add_argument("--optimizer", default="adamw", help="a torch.optim name (default adamw)")
    ap.add_argument("--accum", type=int, default=1, help="micro-steps per optimizer step (communication)")
    ap.add_argument("--unit-numel", type=float, default=None,
                    help="stage 3: parameters per unit (default a quarter of the model)")
    ap.add_argument("--state-dtype", default="fp32",
                    help="Adam/AdamW states: fp32 (default) or bf16 (stochastically rounded, 2 bytes each)")
    ap.add_argument("--offload", action="store_true", help="offload='cpu': optimizer state in host memory")
    ap.add_argument("--step-in-backward", action="store_true", help="step_in_backward=True: no gradient shard")
    ap.add_argument("--fp32-master", action="store_true",
                    help="master_remainder=False: stages 0-2 with bf16 keep a 4-byte fp32 master shard (the ZeRO "
                         "paper's accounting) instead of a 16-bit remainder and a tie bit")
    ap.add_argument("--gib", action="store_true", help="GiB (2^30 bytes) instead of GB (10^9, the paper's)")
    print(_table(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
