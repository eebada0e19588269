"""zeroify(): validates everything before any collective, checks once that all ranks agree,
then builds the C++ engine, the module wrapper and the optimizer wrapper."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _C, alone
from .adopt import PendingModel, become, install_step_guard
from .auto import choose_stage, free_memory
from .changes import ModelGuard, ZeroUsageError, is_retired, retire_optimizer
from .checkpoint.format import CheckpointError
from .comm import Comm, check_device, device_backend
from .config import ZeroConfig, make_config
from .gather import OWNER_ATTR
from .materialize import initialize_by_unit, is_meta, replace_meta
from .model import ZeroModel, cast_buffers
from .nodes import node_group, resolve_node_size
from .offload import check_host_memory, warn_unfused
from .optim import ELEMENTWISE, FUSED, ZeroOptimizer, ZeroOptimizerPart, Part
from .param_waits import ParamWaits
from .pretrained import load as pretrained
from .prior_state import capture as capture_prior_state, describe as describe_prior_state
from .prior_state import restore as restore_prior_state
from .sharded_grad import install as install_sharded_grads
from .units import assign_units, frozen_to_shard
from .whole import WHOLE, fill_state_sizes, update_kind


class ZeroInputError(ValueError):
    """A bad argument to zeroify(), detected before any collective."""


def _fail(msg: str) -> None:
    raise ZeroInputError("zero_ext: " + msg)


def _resolve_group(pg):
    """(process group or None, rank, world size)."""
    if pg is None:
        if dist.is_available() and dist.is_initialized():
            pg = dist.group.WORLD
        else:
            return None, 0, 1
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(f"zero_ext: process_group must be a torch.distributed.ProcessGroup, "
                        f"got {type(pg).__name__}; pass one that torch.distributed made (dist.new_group(...)), "
                        f"or leave process_group out for the default group")
    return pg, pg.rank(), pg.size()


def _optimizer_parts(optimizers: list, cfg: ZeroConfig) -> list:
    """Rank-local checks of the torch optimizers; one Part per optimizer."""
    parts, first_group = [], 0
    for optimizer in optimizers:
        if isinstance(optimizer, (ZeroOptimizer, ZeroOptimizerPart)):
            _fail("optimizer is already a zero_ext optimizer; pass the plain torch optimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            _fail(f"optimizer must be a torch.optim.Optimizer or a list of them, got {type(optimizer).__name__}; "
                  f"build one over the model's parameters, e.g. torch.optim.AdamW(model.parameters())")
        cls = type(optimizer)
        whole = update_kind(cls) != 0
        if not whole and not issubclass(cls, ELEMENTWISE):
            _fail(f"{cls.__name__} is not an elementwise optimizer (its update of one element depends on "
                  f"others, e.g. through per-tensor norms or factored statistics), so it cannot run on a "
                  f"flat shard, and it is not one that zero_ext runs on whole tensors either. Supported: "
                  f"{', '.join(c.__name__ for c in ELEMENTWISE)} (elementwise); "
                  f"{', '.join(c.__name__ for c in WHOLE)} (whole tensors, each owned by one rank); "
                  f"build the optimizer as one of these instead")
        for g in optimizer.param_groups:
            for flag in ("capturable", "differentiable"):
                if g.get(flag):
                    _fail(f"{cls.__name__}({flag}=True) is not supported; construct it with {flag}=False")
        fused = issubclass(cls, FUSED) and cfg.fused != "never"
        if not fused and cfg.reduce_dtype != "fp32":
            _fail(f"reduce_dtype={cfg.reduce_dtype!r} needs a fused optimizer (Adam, AdamW, SGD): {cls.__name__} "
                  f"runs as a torch optimizer over fp32 shards and needs fp32 gradients; use reduce_dtype='fp32'")
        if cfg.state_dtype == "bf16" and not whole:   # Note [bf16 optimizer states] (csrc/engine/stepper.cpp)
            if not (fused and issubclass(cls, (torch.optim.Adam, torch.optim.AdamW))):
                _fail(f"state_dtype='bf16' is a mode of the fused Adam/AdamW kernels; {cls.__name__} keeps its state "
                      f"{'in the SGD kernel (fp32 momentum)' if issubclass(cls, torch.optim.SGD) else 'as a torch optimizer'}"
                      f"; use torch.optim.AdamW or Adam, or state_dtype='fp32'")
            for gi, g in enumerate(optimizer.param_groups):
                if g.get("amsgrad"):
                    _fail(f"state_dtype='bf16' has no bf16 form of amsgrad's max_exp_avg_sq ({cls.__name__}("
                          f"amsgrad=True), param group {gi}); build the optimizer with amsgrad=False, or pass "
                          f"state_dtype='fp32'")
        if cfg.fused == "always" and not fused and not whole:
            _fail(f"fused='always' but {cls.__name__} has no fused kernel (fused ones: "
                  f"{', '.join(c.__name__ for c in FUSED)}); use fused='auto'")
        if is_retired(optimizer):
            _fail(f"this torch optimizer ({cls.__name__}) was already wrapped by zeroify(); use the optimizer "
                  f"that zeroify() returned")
        n = len(optimizer.param_groups)
        parts.append(Part(cls, list(range(first_group, first_group + n)),
                           "whole" if whole else "fused" if fused else "shard"))
        first_group += n
    shard = [p.cls.__name__ for p in parts if p.kind == "shard"]
    if len(shard) > 1:   # one torch optimizer over the shard views keeps their state (zero_ext/local_shard.py)
        _fail(f"{' and '.join(shard)} would each run as a torch optimizer over this rank's flat shard, and zero_ext "
              f"runs one such optimizer; give their parameters to one optimizer as param groups (each group keeps "
              f"its hyperparameters), or use Adam, AdamW or SGD (fused kernels) for all but one of them")
    return parts


def _inspect(model, optimizers: list, cfg: ZeroConfig, meta: bool, weights: bool = False):
    """Rank-local checks: (trainable params, their group ids, frozen params, fused?, what the
    fingerprint hashes (see _first_difference), one Part per torch optimizer)."""
    if not isinstance(model, nn.Module):
        _fail(f"model must be a torch.nn.Module, got {type(model).__name__}; pass the module to train as "
              f"zeroify's first argument: zeroify(model, optimizer, ...)")
    if isinstance(model, (ZeroModel, nn.parallel.DistributedDataParallel)):
        _fail(f"model is already wrapped ({type(model).__name__}); pass the plain module"
              f"{' (model.module)' if hasattr(model, 'module') else ''} instead")
    if not optimizers:
        _fail("the list of optimizers is empty; pass one torch optimizer or a list of them")
    parts = _optimizer_parts(optimizers, cfg)
    fused = all(p.kind == "fused" for p in parts)
    names = {id(p): n for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        owner = getattr(p, OWNER_ATTR, None)
        wrapper = owner[0]() if owner is not None else None
        if wrapper is not None and wrapper.owns_parameter(p):
            _fail(f"the model was already zeroified (parameter {n!r} lives in a zero_ext model's buckets); use "
                  f"the model and optimizer that the first zeroify() returned")
    for m in model.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            _fail(f"{type(m).__name__} with sparse=True produces sparse gradients, which cannot be "
                  f"sharded; construct it with sparse=False")
    params, groups, seen = [], [], set()
    for gi, g in enumerate(g for o in optimizers for g in o.param_groups):
        for p in g["params"]:
            if id(p) not in names:
                _fail(f"a parameter of the optimizer (shape {tuple(p.shape)}, param group {gi}) is not a "
                      f"parameter of the model; build the optimizer from model.parameters()")
            if id(p) in seen:
                _fail(f"parameter {names[id(p)]!r} appears twice in the optimizer's param groups; list each "
                      f"parameter once, in one param group (tied weights are one parameter: pass it once)")
            seen.add(id(p))
            if p.requires_grad:
                params.append(p)
                groups.append(gi)
    if not params:
        _fail("the optimizer has no parameter with requires_grad=True, so there is nothing to train; build it "
              "over the trainable parameters ([p for p in model.parameters() if p.requires_grad]) or set "
              "requires_grad=True on those to train")
    devices = {p.device.type for p in model.parameters()}
    if len(devices) > 1:
        _fail(f"the model's parameters are on different device types {sorted(devices)}; move the "
              f"whole model to one device (model.to(device)) first")
    if meta and cfg.stage not in (3, "auto") and not weights:
        _fail(f"the model is on the meta device; building it sharded needs stage=3 (got stage={cfg.stage}), "
              f"pretrained weights to fill it (weights=...), or build it on the CPU")
    for p in params:
        if p.device.type == "cuda" and not hasattr(_C, "cuda_adam_step"):
            _fail(f"parameter {names[id(p)]!r} is on {p.device}, but this build of zero_ext has no CUDA "
                  f"kernels (it was built with a CPU-only torch or without nvcc); rebuild it where torch has "
                  f"CUDA and nvcc is on the PATH, or train on the CPU")
        if p.device.type not in ("cpu", "cuda", "meta"):
            _fail(f"parameter {names[id(p)]!r} is on {p.device}; zero_ext runs on CPU and CUDA tensors: move "
                  f"the model with model.to('cpu') or model.to('cuda') before zeroify")
        if p.dtype != torch.float32 and not (weights and p.is_meta):   # (filled as fp32: replace_meta)
            _fail(f"parameter {names[id(p)]!r} is {p.dtype}; give zeroify() the model in float32 "
                  f"(model.float()) and choose the compute precision with param_dtype='bf16' or 'fp16': "
                  f"the fp32 master weights are taken from it")
        if p.is_sparse or not p.is_contiguous() and p.layout != torch.strided:
            _fail(f"parameter {names[id(p)]!r} is not a dense strided tensor (layout {p.layout}), which "
                  f"cannot be flattened into a bucket; make it one before zeroify "
                  f"(p.data = p.data.to_dense().contiguous())")
    frozen = [p for p in model.parameters() if id(p) not in seen or not p.requires_grad]
    fingerprinted = ("+".join(type(o).__name__ for o in optimizers), cfg.to_dict(),
                     [(names[id(p)], tuple(p.shape), str(p.dtype), gi) for p, gi in zip(params, groups)],
                     [(tuple(p.shape), str(p.dtype)) for p in frozen])
    return params, groups, frozen, fused, fingerprinted, parts


PRIOR_STATE = "optimizer state given to zeroify"   # tags the summary the ranks also agree on (last item)


def _prior_summary(fingerprinted: tuple) -> tuple:
    """The summary of the optimizer state this rank carries (Note [State given to zeroify] in
    zero_ext/prior_state.py), from what the ranks agree on; () when none."""
    last = fingerprinted[-1] if len(fingerprinted) > 4 else None
    return last[1] if isinstance(last, tuple) and len(last) == 2 and last[0] == PRIOR_STATE else ()


def _first_difference(mine: tuple, theirs: tuple, r: int) -> str:
    """What differs between this rank's zeroify() inputs and rank r's (the tuples _inspect fingerprints)."""
    if mine[0] != theirs[0]:
        return f"the optimizer is {mine[0]} here, {theirs[0]} on rank {r}"
    opts = [k for k in mine[1] if mine[1][k] != theirs[1].get(k)]
    if opts:
        k = opts[0]
        return f"option {k}={mine[1][k]!r} here, {k}={theirs[1].get(k)!r} on rank {r}"
    state, state_there = _prior_summary(mine), _prior_summary(theirs)
    if state != state_there:
        return (f"the torch optimizer state given to zeroify() is {describe_prior_state(state)} here, "
                f"{describe_prior_state(state_there)} on rank {r}; zeroify() carries each rank's optimizer state "
                f"into its shard, so load the same state on every rank before zeroify() (as every rank of a DDP "
                f"job does), or after it with optimizer.load_state_dict(...) on every rank")
    if mine[4:] != theirs[4:]:
        return (f"the pretrained weights (weights=...) hold other tensors (names, shapes or dtypes) here than on rank "
                f"{r}; give every rank the same checkpoint files")
    here, there = {n: rest for n, *rest in mine[2]}, {n: rest for n, *rest in theirs[2]}
    for n, (shape, dtype, gi) in here.items():
        if n not in there:
            return f"parameter {n!r} is trained here but not on rank {r}"
        if there[n] != [shape, dtype, gi]:
            return (f"parameter {n!r} is {shape} {dtype} in param group {gi} here, {tuple(there[n][0])} "
                    f"{there[n][1]} in param group {there[n][2]} on rank {r}")
    extra = [n for n in there if n not in here]
    if extra:
        return f"parameter {extra[0]!r} is trained on rank {r} but not here"
    if [n for n, *_ in mine[2]] != [n for n, *_ in theirs[2]]:
        return f"the optimizer lists the parameters in another order on rank {r}"
    return f"the frozen parameters differ ({len(mine[3])} here, {len(theirs[3])} on rank {r}, or their shapes)"


def _verify_across_ranks(comm: Comm, fingerprint: int, error: Exception | None, free: int,
                         fingerprinted: tuple | None) -> int:
    """One small all-gather: whether every rank accepted its inputs and wraps the same parameters
    and config. Raises on all ranks or none; returns the least `free` over the ranks."""
    everyone = comm.all_gather_int64([0 if error is None else 1, fingerprint, free])
    world, rank = comm.world, comm.rank
    failed = [r for r in range(world) if everyone[r, 0] != 0]
    if failed:   # every rank exchanges the messages, naming the first failing rank's
        notes = comm.gather_object(None if error is None else (type(error).__name__, str(error)), dst=None)
        if error is not None:
            raise error
        kind, note = notes[failed[0]]
        cls = CheckpointError if kind == CheckpointError.__name__ else ZeroInputError
        raise cls(f"zero_ext: rank(s) {failed} rejected their zeroify() inputs; no training collective was started "
                  f"on any rank. Rank {failed[0]} raised {kind}: {note.rstrip('.')}. Fix the error those ranks raised "
                  f"(it is in their own log too) and run again")
    differ = [r for r in range(world) if everyone[r, 1] != fingerprint]
    if len(set(everyone[:, 1].tolist())) > 1:      # every rank sees it, so every rank exchanges
        theirs = comm.gather_object(fingerprinted, dst=None)
        raise ZeroInputError(f"zero_ext: rank(s) {differ} wrap different parameters, param groups, optimizer "
                             f"(or optimizer state) or config than rank {rank}: "
                             f"{_first_difference(fingerprinted, theirs[differ[0]], differ[0])}; "
                             f"every rank must build the same model and call zeroify() with the same options")
    return int(everyone[:, 2].min())


def _device_of(model) -> torch.device:
    """The parameters' device (a meta-device build materializes on the CPU)."""
    p = next(model.parameters(), None) if isinstance(model, nn.Module) else None
    return p.device if p is not None and p.device.type != "meta" else torch.device("cpu")


_SIDE_GROUPS: dict = {}   # id(process group) -> (it, its side group)


def _side_group(pg):
    """The digests' own gloo group over pg's ranks, made once per process group."""
    c10d = dist.distributed_c10d
    known = _SIDE_GROUPS.get(id(pg))
    if known is not None and known[0] is pg and pg in c10d._world.pg_map and known[1] in c10d._world.pg_map:
        return known[1]
    side = dist.new_group(ranks=dist.get_process_group_ranks(pg), backend="gloo", use_local_synchronization=True)
    _SIDE_GROUPS[id(pg)] = (pg, side)
    return side


# each sequence-checked engine's key in the store: the same on every rank (they build engines alike)
_SEQUENCE_IDS = itertools.count()


def _enable_sequence_check(engine, pg, cfg: ZeroConfig, gloo: bool) -> int:
    """Note [Collective sequence check] (csrc/engine/sequence.h); without the group's store
    (NCCL) the digests are exchanged at every phase."""
    try:
        meet = dist.distributed_c10d._world.pg_map[pg][1]   # Note [Reading alone] (csrc/engine/away.h)
    except (AttributeError, KeyError, IndexError, TypeError):
        meet = None
    store = meet if gloo else None       # without one: digests at every phase only
    side = _side_group(pg)
    engine_id = next(_SEQUENCE_IDS)
    engine.enable_sequence_check(store, float(cfg.sequence_timeout), side,
                                 store is None or cfg.check_sequence == "every_phase", engine_id, meet)
    return engine_id


def zeroify(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, stage: int | str | None = None,
            config: ZeroConfig | dict | str | None = None, init_fn=None, weights=None, **options):
    """Wrap `model` and `optimizer` for ZeRO data parallelism; returns (model, optimizer).

    optimizer: a torch optimizer, or a list of them over disjoint parameters ([Muon(matrices),
        AdamW(the rest)]: a list comes back). None: zeroify returns the model alone, and the
        torch optimizer(s) over its parameters become zero_ext's at its first forward with
        autograd (Note [Adopted optimizers]).
    stage: 0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters, gathered
        per unit), or "auto" (the stage fitting memory_budget with the least communication).
    config: a ZeroConfig, a dict or a JSON file path; **options override its fields.
    init_fn: stage 3 on the meta device: called on each module after its reset_parameters()
        (a Hugging Face model: init_fn=model._init_weights); anything left uninitialized raises.
    weights: a safetensors checkpoint path or zero_ext.Weights(path, ...), each rank reading
        what it holds; model.weights_report says what was read (Note [Pretrained weights
        into shards]).
    Every rank of the process group must call zeroify with the same model and options.
    """
    if optimizer is None:
        make_config(config, stage, dict(options))   # a bad option is named now, before any collective
        if not isinstance(model, nn.Module):
            _fail(f"model must be a torch.nn.Module, got {type(model).__name__}")
        return PendingModel(model, functools.partial(_build, stage=stage, config=config, init_fn=init_fn,
                                                     weights=weights, **options))
    return _build(model, optimizer, None, None, stage=stage, config=config, init_fn=init_fn, weights=weights,
                  **options)


@dataclasses.dataclass
class _Inputs:
    """What zeroify()'s checks found, agreed on by every rank, before anything is built."""
    cfg: ZeroConfig
    backend: str          # the group's backend; "none" for one process
    comm: Comm            # its pg: the process group (None for one process), rank and world
    optimizers: list      # the torch optimizers given
    params: list          # trainable parameters, in the optimizers' order
    groups: list          # each one's param group, counted over all optimizers
    frozen: list          # the model's other parameters
    fused: bool           # every optimizer steps with the C kernels
    parts: list           # one Part per torch optimizer
    fingerprint: int      # of the inputs the ranks agreed on (sharded state dicts carry it)
    plan: Any             # the pretrained weights' plan, or None
    prior: list           # the optimizer state captured (Note [State given to zeroify])
    node_size: int | None

    @property
    def gloo(self) -> bool:   # "gloo", "cuda:gloo", "cpu:gloo,cuda:gloo"
        return device_backend(self.backend, self.comm.device.type) == "gloo"


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def _checked_inputs(model, optimizer, problem: str | None, weights, stage, config, options: dict) -> _Inputs:
    """Every rank-local check, then the agreement check: raises on every rank or on none."""
    error = None if problem is None else ZeroInputError("zero_ext: " + problem)
    cfg = None
    try:
        cfg = make_config(config, stage, options)
    except (ValueError, TypeError) as e:
        error = error or e
    pg, rank, world = _resolve_group(cfg.process_group if cfg is not None else options.get("process_group"))
    backend = dist.get_backend(pg) if pg is not None else "none"
    comm = Comm(pg if world > 1 else None, _device_of(model))   # Note [One communication layer]
    if world > 1:
        wrong_device = check_device(pg, comm.device, backend)
        if wrong_device is not None:    # no collective could carry the agreement check: every rank raises
            raise ZeroInputError("zero_ext: " + wrong_device)
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    auto = error is None and cfg.stage == "auto"
    if auto and isinstance(optimizer, (list, tuple)):
        error = ZeroInputError("zero_ext: stage='auto' takes one torch optimizer; with several (e.g. Muon + "
                               "AdamW) pass stage=1, 2 or 3")
    free = None
    params = groups = frozen = parts = fingerprinted = plan = node_size = None
    fused, prior, prior_summary = False, [], ()
    if error is None:
        try:
            meta = isinstance(model, nn.Module) and is_meta(model)
            params, groups, frozen, fused, fingerprinted, parts = _inspect(model, optimizers, cfg, meta,
                                                                           weights is not None)
            if weights is not None:   # Note [Pretrained weights into shards]
                plan = pretrained.make_plan(model, pretrained.as_weights(weights))
                fingerprinted = fingerprinted + (plan.digest,)
            # Note [State given to zeroify] (zero_ext/prior_state.py)
            prior, prior_summary = capture_prior_state(optimizers, parts, params,
                                                       {id(p): n for n, p in model.named_parameters()})
            if auto and cfg.memory_budget is None:
                free = free_memory(model)
            if cfg.offload is not None:   # Note [Optimizer offload] (csrc/engine/offload.h)
                check_host_memory(model, optimizer, cfg, world, backend)
            if cfg.step_in_backward and not (len(parts) == 1 and parts[0].kind == "fused"):
                raise ValueError("zero_ext: step_in_backward=True needs one optimizer with a fused kernel (Adam, "
                                 "AdamW or SGD, fused='auto') and no tensor-atomic ones; got "
                                 + ", ".join(f"{p.cls.__name__} ({p.kind})" for p in parts)
                                 + "; use torch.optim.AdamW/Adam/SGD, or step_in_backward=False")
            node_size = resolve_node_size(cfg.node_size, world)
        except (ValueError, TypeError, ZeroUsageError) as e:
            error = e
    text = repr(fingerprinted) if fingerprinted is not None else ""
    fingerprint = agreement = _hash(text)
    agreed_on = fingerprinted
    if prior_summary:   # the ranks also agree on the optimizer state they carry
        agreement = _hash(text + repr(prior_summary))
        agreed_on = fingerprinted + ((PRIOR_STATE, prior_summary),)
    verify = cfg.verify_across_ranks if cfg is not None else True
    if world > 1 and verify and backend != "fake":   # fake moves no data
        least = _verify_across_ranks(comm, agreement, error, free[0] if free else -1, agreed_on)
        if free is not None:   # every rank budgets with the least free memory, so all choose one stage
            free = (least, f"{free[1]}, the least over {world} ranks")
    elif error is not None:
        raise error
    if auto:   # after the agreement check, on inputs every rank shares: every rank decides alike
        cfg.stage, why = choose_stage(model, optimizer, cfg, world, backend, meta=is_meta(model), free=free)
        if rank == 0:
            print(why, flush=True)
    return _Inputs(cfg, backend, comm, optimizers, params, groups, frozen, fused, parts,
                   fingerprint, plan, prior, node_size)


def _engine_options(ins: _Inputs):
    """The engine's options: ZeroConfig.engine_fields and what the optimizers decide per param group."""
    cfg, params, parts, groups = ins.cfg, ins.params, ins.parts, ins.groups
    opts = _C.EngineOptions()
    trainable_bytes = sum(p.numel() * p.element_size() for p in params)
    for name, value in cfg.engine_fields(ins.comm.world, ins.gloo, trainable_bytes).items():
        setattr(opts, name, value)
    opts.group_update_kind = [update_kind(part.cls) for part in parts for _ in part.groups]
    state_sizes = fill_state_sizes(parts, [g for o in ins.optimizers for g in o.param_groups], params, groups,
                                   cfg.stage, ins.comm.world)
    if cfg.state_dtype == "bf16":   # the fused Adam/AdamW's states take 2 bytes per element, not 4
        fused_groups = {gi for part in parts if part.kind == "fused" for gi in part.groups}
        state_sizes = [b / 2 if g in fused_groups else b for b, g in zip(state_sizes, groups)]
    opts.param_state = state_sizes
    return opts


def _materialize_or_broadcast(model, ins: _Inputs, opts) -> set:
    """A meta-device model gets CPU storage (returns the new tensors' ids, for initialize_by_unit);
    otherwise every rank takes rank 0's values, as DDP."""
    if is_meta(model):   # with weights, parameters as fp32: the checkpoint's are read into fp32 masters
        born = replace_meta(model, ins.optimizers, torch.float32 if ins.plan is not None else None)
        ins.params = [p for o in ins.optimizers for g in o.param_groups for p in g["params"] if p.requires_grad]
        ins.frozen = [p for p in model.parameters() if not p.requires_grad]
        opts.copy_params = False
        return born
    if ins.comm.world > 1:   # (what the checkpoint will not fill)
        filled = ins.plan.filled(model) if ins.plan is not None else set()
        ins.comm.broadcast_([t for t in list(model.parameters()) + list(model.buffers()) if id(t) not in filled])
    return set()


def _build(model, optimizer, into, problem: str | None, *, stage=None, config=None, init_fn=None, weights=None,
           **options):
    """zeroify's work. into: (PendingModel, the user's optimizers) to turn in place into what
    it returns (Note [Adopted optimizers]); problem: why adoption failed, raised on every rank."""
    ins = _checked_inputs(model, optimizer, problem, weights, stage, config, options)
    cfg, comm, world, optimizers, meta = ins.cfg, ins.comm, ins.comm.world, ins.optimizers, is_meta(model)
    opts = _engine_options(ins)
    born = _materialize_or_broadcast(model, ins, opts)
    params, units, unit_modules, root_holders = ins.params, [], [model], []
    sharded_frozen, frozen_units = frozen_to_shard(ins.frozen, cfg.stage, cfg.param_dtype), []
    if cfg.stage == 3:   # units over trainable and frozen parameters alike (LoRA: layers, not adapters)
        units, unit_modules, root_holders = assign_units(model, params + sharded_frozen, cfg.unit_modules,
                                                         cfg.unit_numel, cfg.min_unit_numel)
        units, frozen_units = units[:len(params)], units[len(params):]
    # Note [Parameter names in messages] (csrc/engine/layout.cpp): the engine's errors name parameters
    names = {id(p): n for n, p in model.named_parameters()}
    opts.param_names = [names.get(id(p), f"#{i}") for i, p in enumerate(params)]
    if opts.offload:
        warn_unfused(ins.parts)
    shapes = [tuple(p.shape) for p in params]   # stage 3 empties them
    frozen_shapes = [tuple(p.shape) for p in sharded_frozen]
    engine = _C.Engine(params, ins.groups, units, comm.pg, opts)
    if sharded_frozen:   # Note [Stage 3 frozen parameters] (csrc/engine/frozen.cpp)
        engine.add_frozen(sharded_frozen, frozen_units,
                          [names.get(id(p), f"#{i}") for i, p in enumerate(sharded_frozen)])
    if ins.node_size is not None:   # Note [Hierarchical partitioning] (csrc/engine/secondary.h)
        engine.enable_hierarchy(node_group(comm.pg, ins.node_size))
    in_engine = {id(p) for p in sharded_frozen}
    replicated = [p for p in ins.frozen if id(p) not in in_engine]
    if meta and ins.plan is None:   # (with weights: pretrained.fill below initializes what they leave out)
        unit_of = {id(p): u for p, u in zip(params + sharded_frozen, units + frozen_units)}
        initialize_by_unit(model, engine, unit_of, comm, init_fn, born)
        comm.broadcast_(replicated + list(model.buffers()))
    if cfg.param_dtype != "fp32":   # the frozen parameters outside the engine and buffers compute in it too
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.param_dtype]
        for p in replicated:
            p.data = p.data.to(low)
        cast_buffers(model, low, cfg.cast_buffers)
    wrapped = _made(ZeroModel, into and into[0], model, engine, cfg, [b for b in model.buffers() if b.numel() > 0],
                    unit_modules, root_holders)
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(wrapped.grad_hook(i))
        setattr(p, OWNER_ATTR, (weakref.ref(wrapped), units[i] if units else 0))
    for p, u in zip(sharded_frozen, frozen_units):
        setattr(p, OWNER_ATTR, (weakref.ref(wrapped), u))
    guard = ModelGuard(wrapped, model, params, shapes, sharded_frozen, frozen_shapes)
    frozen_bytes = sum(p.numel() * p.element_size() for p in replicated) + engine.frozen_shard_bytes
    zopt = _made(ZeroOptimizer, into[1][0] if into and len(optimizers) == 1 else None, optimizers, engine, cfg,
                 ins.fused, ins.fingerprint, comm, parts=ins.parts, param_groups_of=ins.groups, params=params,
                 param_shapes=shapes, units=wrapped.units, frozen_bytes=frozen_bytes, guard=guard)
    for o in optimizers:
        retire_optimizer(o)
    waits = (ParamWaits(wrapped, model, engine, params)
             if cfg.overlap_param_gather and cfg.stage in (1, 2) and world > 1 else None)
    wrapped.attach(guard, zopt, waits)   # Note [torch's clipping utilities] (torch_utils.py): the optimizer
    if ins.plan is not None:             # Note [Pretrained weights into shards]
        wrapped.weights_report = pretrained.fill(wrapped, ins.plan, comm, init_fn, initialize=meta)
    restore_prior_state(zopt, optimizers, ins.prior)   # Note [State given to zeroify]: no collective
    if cfg.stage >= 1 and not cfg.step_in_backward:   # Note [Sharded gradients]: p.grad answers as DDP's
        install_sharded_grads(zopt, names)
    if world > 1 and cfg.check_sequence is not False and ins.backend != "fake":   # fake moves no data
        engine_id = _enable_sequence_check(engine, comm.pg, cfg, ins.gloo)
        if cfg.stage >= 1:   # Note [Shard server]: a rank reading alone is served the others' pieces
            zopt.serving = alone.serve(comm.pg, zopt, engine_id, comm.device)
    if cfg.log_plan and comm.rank == 0:
        print(engine.describe_plan(), flush=True)
    install_step_guard()   # Note [Adopted optimizers]: a torch optimizer zeroify was not given is named
    if isinstance(optimizer, (list, tuple)):   # one returned optimizer per given one (zero_ext/whole.py)
        return wrapped, [_made(ZeroOptimizerPart, into and into[1][k], zopt, o, k) for k, o in enumerate(optimizers)]
    return wrapped, zopt


def _made(cls, into, *args, **kwargs):
    """cls(*args, **kwargs), or `into` turned into it in place (Note [Adopted optimizers])."""
    return cls(*args, **kwargs) if into is None else become(into, cls, *args, **kwargs)
