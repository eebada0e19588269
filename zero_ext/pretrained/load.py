"""Pretrained weights into shards: the plan, the ranks' agreement, the init of what the
checkpoint leaves out, and the reads.

Note [Pretrained weights into shards]
  zeroify(model, opt, weights=...) on a meta build, or load_weights on a zeroified model:
  1. Plan, each rank alone: read the files' headers (files.py) and match the model's
     state-dict names to the checkpoint's. A tied parameter is one tensor under several
     names. A prefix on either side (HF's "model.") is found by trying candidates; PEFT
     names lose "base_model.model." and ".base_layer". Shapes, missing and unexpected
     names and truncated files make one CheckpointError.
  2. Agree, before any other collective: the plan's verdict and digest (names, shapes,
     dtypes) ride zeroify's agreement all-gather (api.py), or load_weights' own. A rank with
     missing or other files makes every rank raise, naming it.
  3. Initialize what the checkpoint leaves out (Note [Initializing what weights leave out]).
  4. Read: each rank reads its fragments' element ranges (pieces of an fp32 master, or of a
     stage-3 frozen shard) straight from the files (Note [Safetensors by byte range]), and
     tensors it holds whole, in file and offset order. The masters are then cast into what
     is gathered next (Note [Loading into a zeroified model]). A read failing on one rank
     raises on every rank (a last all-reduce).
  Peak memory beyond the stage's own: the conversion chunk, and step 3's tensors.

Note [Initializing what weights leave out]
  Allowed-missing tensors and non-persistent buffers a meta build left empty (RoPE's
  inv_freq) get the model's own init, as from_pretrained does: init_fn, by default HF's
  _init_weights, with PEFT's LoRA init on LoRA layers.
  - reset_parameters() runs on the modules holding them; init_fn on those and their
    ancestors (a parent may initialize a child: HF's GPT-2, PEFT's LoRA layers).
  - Every other tensor carries HF's `_is_hf_initialized` flag meanwhile, so transformers'
    init functions skip it.
  - Stage 3 opens the units an init touches (Note [Meta builds lose nothing]) but commits
    no unit: rank 0's values of the initialized tensors are broadcast, each rank writes its
    pieces. Stages 0-2 initialize fp32 tensors of their own, broadcast, and write them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.format import CheckpointError
from ..gather import OWNER_ATTR
from ..materialize import initialize_by_unit
from .._C import PHASE_CHECKPOINT
from ..model import ZeroModel
from .files import Reader, read_entries

HF_FLAG = "_is_hf_initialized"   # transformers' init functions skip a tensor that has it


@dataclasses.dataclass
class Weights:
    """A safetensors checkpoint for zeroify(weights=...) and load_weights(): a directory, one
    .safetensors file or an index .json.

    allow_missing: regexes (re.search) of model names the checkpoint may lack, or True; zeroify
        initializes them with the model's init (and warns), load_weights leaves them.
    allow_unexpected: regexes of checkpoint names the model may lack, or True; not read.
    prefix: a prefix only the checkpoint's names carry ("model."); None finds one.
    """
    path: str
    allow_missing: object = ()
    allow_unexpected: object = ()
    prefix: str | None = None


@dataclasses.dataclass
class WeightsReport:
    """What a load did on this rank (ZeroModel.weights_report)."""
    path: str
    files: list
    loaded: int               # model tensors filled from the checkpoint
    missing: list             # model names the checkpoint lacks (allowed): initialized, or kept by load_weights
    ignored: list             # checkpoint names not read (allowed unexpected)
    bytes_read: int           # by this rank
    seconds: float


def as_weights(weights, **options) -> Weights:
    if isinstance(weights, Weights):
        return dataclasses.replace(weights, **options) if options else weights
    if isinstance(weights, (str, bytes)) or hasattr(weights, "__fspath__"):
        return Weights(os.fsdecode(weights), **options)   # str(b"dir") would be "b'dir'"
    raise TypeError(f"zero_ext: weights must be a checkpoint path or zero_ext.Weights(path, ...), got "
                    f"{type(weights).__name__}")


@dataclasses.dataclass
class Plan:
    """Which checkpoint tensor fills which model tensor (model names: the first of a tied group)."""
    weights: Weights
    files: list
    entries: dict             # checkpoint name -> Entry
    keys: dict                # model name -> checkpoint name
    initialize: list          # model names to initialize: allowed missing, then meta non-persistent buffers
    missing: list             # the allowed missing ones (state-dict names the checkpoint lacks)
    ignored: list             # checkpoint names left unread
    digest: int               # of what every rank must read alike

    def filled(self, module: nn.Module) -> set:
        """ids of the tensors of `module` the checkpoint fills."""
        return {id(tensor_of(module, n)) for n in self.keys}


def is_peft(module: nn.Module) -> bool:
    return type(module).__module__.startswith("peft") and hasattr(module, "peft_config")


def tied_names(module: nn.Module) -> tuple[dict, list]:
    """(state_dict(keep_vars=True), [the names of each tensor, tied ones together])."""
    state, groups = module.state_dict(keep_vars=True), {}
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    return state, list(groups.values())


def _patterns(allow) -> list:
    if allow is True:
        return [re.compile("")]
    if isinstance(allow, str):
        allow = [allow]
    try:
        return [re.compile(p) for p in (allow or ())]
    except (re.error, TypeError) as e:
        raise ValueError(f"zero_ext: Weights(allow_missing=..., allow_unexpected=...) take regular expressions "
                         f"(or True), got {allow!r}: {e}") from None


def _head(names) -> str:
    """The first name component every name shares ("model."), or ""."""
    heads = {n.split(".", 1)[0] + "." if "." in n else "" for n in names}
    return heads.pop() if len(heads) == 1 else ""


def _match(model_names: set, ckpt: list, base_prefix: str, prefix: str | None) -> tuple[dict, str]:
    """(model name -> checkpoint name, how): the prefix rule that matches the most names."""
    if prefix is not None:
        rules = [(prefix, "")]
    else:
        rules = [("", "")]
        if base_prefix:
            rules += [(base_prefix + ".", ""), ("", base_prefix + ".")]
        rules += [(h, "") for h in [_head(ckpt)] if h] + [("", h) for h in [_head(model_names)] if h]
    best, how = {}, ""
    for strip, add in rules:
        mapped = {add + k[len(strip):]: k for k in ckpt if k.startswith(strip)}
        if len(model_names & mapped.keys()) > len(model_names & best.keys()):
            best = mapped
            how = (f"stripping {strip!r} from the checkpoint's names" if strip else
                   f"adding {add!r} to the checkpoint's names" if add else "as they are")
    return best, how or "as they are"


def make_plan(module: nn.Module, weights: Weights, logical: dict | None = None) -> Plan:
    """The plan for `module`, rank-local; raises CheckpointError. logical: id(tensor) -> its
    logical shape where it differs (stage 3 parameters are empty outside a gather)."""
    files, entries = read_entries(weights.path)
    base = module.get_base_model() if is_peft(module) else module
    # a PEFT model's names as the base model's checkpoint has them
    norm = ((lambda n: n.removeprefix("base_model.model.").replace(".base_layer.", ".")) if is_peft(module)
            else str)
    state, groups = tied_names(module)
    mapped, how = _match({norm(n) for n in state}, list(entries), getattr(base, "base_model_prefix", ""),
                         weights.prefix)
    # and the names HF's from_pretrained ignores too
    allow_missing = _patterns(weights.allow_missing) + _patterns(getattr(base, "_keys_to_ignore_on_load_missing", None))
    allow_unexpected = (_patterns(weights.allow_unexpected)
                        + _patterns(getattr(base, "_keys_to_ignore_on_load_unexpected", None)))
    keys, initialize, missing, shapes, used = {}, [], [], [], set()
    for names in groups:
        t = state[names[0]]
        found = [mapped[norm(n)] for n in names if norm(n) in mapped]
        used.update(found)
        if not found:
            (initialize if any(p.search(n) for p in allow_missing for n in names) else missing).append(names[0])
            continue
        e = entries[found[0]]
        shape = tuple((logical or {}).get(id(t), t.shape))
        if e.shape != shape or e.dtype.is_floating_point != t.dtype.is_floating_point:
            shapes.append(f"{names[0]}: {list(e.shape)} {e.dtype} in the checkpoint, {list(shape)} {t.dtype} in the "
                          f"model")
            continue
        keys[names[0]] = found[0]
    ignored = [k for k in entries if k not in used and any(p.search(k) for p in allow_unexpected)]
    used.update(ignored)
    unexpected = [k for k in entries if k not in used]
    if missing or unexpected or shapes:
        raise CheckpointError(_mismatch_message(weights.path, module, missing, unexpected, shapes, how))
    text = repr(sorted((n, k, str(entries[k].dtype), entries[k].shape) for n, k in keys.items()))
    text += repr((sorted(initialize), sorted(ignored)))
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
    # meta buffers are no checkpoint names: the model's init computes them, silently
    buffers = [name for name, b in module.named_buffers() if b.is_meta and name not in state]
    return Plan(weights, files, entries, keys, initialize + buffers, initialize, ignored, digest)


def _listed(names: list) -> str:
    more = f" and {len(names) - 6} more" if len(names) > 6 else ""
    return ", ".join(names[:6]) + more


def _mismatch_message(path, module, missing, unexpected, shapes, how) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} tensor(s) of the model are not in the checkpoint: {_listed(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} tensor(s) of the checkpoint are not in the model: {_listed(unexpected)}")
    if shapes:
        parts.append(f"shapes differ: {'; '.join(shapes[:4])}{' ...' if len(shapes) > 4 else ''}")
    hint = ""   # how transformers rewrites this model's checkpoints while loading
    if type(module).__module__.startswith("transformers"):
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import PrefixChange
            hint = "; ".join([str(c) for c in get_model_conversion_mapping(module, add_legacy=False)
                              if not isinstance(c, PrefixChange)][:2])
        except Exception:  # noqa: BLE001 - an older or newer transformers: no hint
            pass
    hint = (f" transformers converts this model's checkpoints while loading ({hint}), which zero_ext does not: "
            f"pass a checkpoint in the model's own names and shapes (zero_ext.save_pretrained writes one)." if hint
            else "")
    return (f"zero_ext: the checkpoint {path!r} does not fit {type(module).__name__} (names compared {how}): "
            f"{'; '.join(parts)}.{hint} Let the model's init fill tensors the checkpoint lacks with "
            f"Weights(path, allow_missing=[patterns]) (a new head, LoRA weights: allow_missing=['lora_']), skip "
            f"checkpoint tensors with allow_unexpected=[patterns], or pass prefix='...' when the names differ by a "
            f"prefix")


def agree(comm, error: Exception | None, digest: int) -> None:
    """Raise on every rank unless every rank's plan succeeded and reads the same tensors."""
    everyone = comm.all_gather_int64([0 if error is None else 1, digest])
    failed = [r for r in range(comm.world) if everyone[r, 0] != 0]
    if failed:
        notes = comm.gather_object(None if error is None else str(error), dst=None)   # every rank exchanges
        if error is not None:
            raise error
        raise CheckpointError(f"zero_ext: rank(s) {failed} cannot read the pretrained weights; nothing was read "
                              f"on any rank. Rank {failed[0]}: {notes[failed[0]]}")
    differ = [r for r in range(comm.world) if everyone[r, 1] != everyone[0, 1]]
    if differ:
        raise CheckpointError(f"zero_ext: rank(s) {differ} would read other tensors (names, shapes or dtypes) from "
                              f"their checkpoint files than rank 0; give every rank the same files")


def tensor_of(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer `name` of `module` as it is now."""
    owner, _, attr = name.rpartition(".")
    m = module.get_submodule(owner)
    return m._parameters[attr] if attr in m._parameters else m._buffers[attr]


def default_init(module: nn.Module):
    """HF's _init_weights (what from_pretrained runs on missing keys), PEFT's own init on LoRA
    layers, or None (reset_parameters() only)."""
    base = module.get_base_model() if is_peft(module) else module
    hf = getattr(base, "_init_weights", None) if hasattr(base, "config") else None
    if not is_peft(module):
        return hf
    configs = module.peft_config

    def init(m):
        if hasattr(m, "reset_lora_parameters") and hasattr(m, "lora_A"):
            for name in list(m.lora_A.keys()) + list(m.lora_embedding_A.keys()):
                m.reset_lora_parameters(name, configs[name].init_lora_weights if name in configs else True)
        elif hf is not None:
            hf(m)
    return init


@torch.no_grad()
def _initialize(model: ZeroModel, plan: Plan, comm, init_fn) -> None:
    """Note [Initializing what weights leave out]."""
    module, guard, engine = model.module, model.guard, model.engine
    targets = [tensor_of(module, n) for n in plan.initialize]
    only = {id(t) for t in targets}
    init_fn = init_fn if init_fn is not None else default_init(module)
    flagged = [t for t in list(module.parameters()) + list(module.buffers())
               if id(t) not in only and not hasattr(t, HF_FLAG)]
    for t in flagged:
        setattr(t, HF_FLAG, True)
    try:
        if guard.stage3:
            unit_of = {id(p): getattr(p, OWNER_ATTR)[1] for p in guard.params}
            pieces = guard.master_pieces(engine)
            initialize_by_unit(module, engine, unit_of, comm, init_fn, only=only,
                               pieces={id(p): pieces[i] for i, p in enumerate(guard.params) if id(p) in only})
            comm.broadcast_([t for t in targets if id(t) not in unit_of])    # buffers, replicated frozen ones
            return
        # stages 0-2: fp32 tensors of their own (parameters are views of bf16 or shared buckets)
        params = [t for t in targets if isinstance(t, nn.Parameter)]
        homes = [t.data for t in params]
        for t in params:
            t.data = torch.empty(t.shape, dtype=torch.float32, device=t.device)
        try:
            initialize_by_unit(module, None, {}, comm, init_fn, only=only)
            comm.broadcast_(targets)                                       # rank 0's draws
        finally:
            values = [t.data for t in params]
            for t, home in zip(params, homes):
                t.data = home
        for t, v in zip(params, values):
            if id(t) in guard.index:
                guard.write(engine, guard.index[id(t)], t, v)
            else:
                t.data.copy_(v)
    finally:
        for t in flagged:
            delattr(t, HF_FLAG)


@torch.no_grad()
def _read(model: ZeroModel, plan: Plan, comm) -> tuple[int, int]:
    """Step 4 of Note [Pretrained weights into shards]: (tensors filled, bytes this rank read)."""
    module, guard, engine = model.module, model.guard, model.engine
    pieces = guard.master_pieces(engine, fresh=engine.split_master)
    reads = []
    for name, key in plan.keys.items():
        t, e = tensor_of(module, name), plan.entries[key]
        i = guard.index.get(id(t))
        if i is None:
            reads.append((e, 0, t.data))
            continue
        whole = t.numel() == guard.shapes[i].numel()
        reads += [(e, poff, view) for poff, view in pieces[i]
                  if not (whole and view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr())]
        if whole:
            reads.append((e, 0, t.data))
    reads.sort(key=lambda r: (r[0].file, r[0].offset + r[1] * r[0].dtype.itemsize))
    reader, error = Reader(), None
    try:
        for e, first, out in reads:
            reader.read(e, first, out)
    except (OSError, CheckpointError) as ex:
        error = ex
    finally:
        reader.close()
    if comm.all_reduce([1.0 if error is not None else 0.0], op=dist.ReduceOp.MAX)[0]:
        how = f"failed: {error}" if error is not None else "failed on another rank (its error names the file)"
        raise CheckpointError(f"zero_ext: reading {plan.weights.path!r} {how}; the model is partly loaded: "
                              f"load again") from error
    # what is gathered next (Note [Loading into a zeroified model])
    if guard.stage3:
        engine.publish_params()
    else:
        engine.cast_masters()
    guard.accept()
    return len(plan.keys), reader.bytes_read


def fill(model: ZeroModel, plan: Plan, comm, init_fn=None, initialize: bool = False) -> WeightsReport:
    """Steps 3 (when `initialize`: a meta build) and 4; every rank calls it."""
    t0 = time.perf_counter()
    if initialize and plan.initialize:
        _initialize(model, plan, comm, init_fn)
        if comm.rank == 0 and plan.missing:
            warnings.warn(f"zero_ext: {len(plan.missing)} tensor(s) of the model are not in the checkpoint "
                          f"{plan.weights.path!r} and were initialized by the model's init: {_listed(plan.missing)}",
                          stacklevel=3)
    loaded, nbytes = _read(model, plan, comm)
    return WeightsReport(plan.weights.path, plan.files, loaded, list(plan.missing), list(plan.ignored), nbytes,
                         time.perf_counter() - t0)


def settled_comm(model: ZeroModel):
    """The model's Comm, once its engine has finished its collectives for a load or save that
    every rank calls."""
    opt = model.optimizer
    if opt is None:
        raise RuntimeError("zero_ext: the optimizer zeroify() returned with this model no longer exists; keep a "
                           "reference to it while you load or save the model")
    model.engine.sequence_mark(PHASE_CHECKPOINT)   # collective: a rank calling it alone is named
    model.engine.wait_reductions()
    model.engine.flush_params()
    return opt.comm


def load_weights(model, weights, **options) -> WeightsReport:
    """Load a safetensors checkpoint into a zeroified model, on every rank; `weights`: a path
    or a Weights (`options` override its fields). Note [Pretrained weights into shards].
    Allowed-missing tensors keep their values (zeroify(weights=...) on a meta build initializes
    them). Returns this rank's WeightsReport."""
    if not isinstance(model, ZeroModel):
        raise TypeError(f"zero_ext: load_weights takes the model zeroify() returned, got {type(model).__name__}; "
                        f"to load before wrapping, pass weights= to zeroify()")
    spec = as_weights(weights, **options)
    guard, comm = model.guard, settled_comm(model)
    guard.check_edits()                      # earlier edits reach the master before the load
    error, plan = None, None
    try:
        plan = make_plan(model.module, spec, dict(zip(map(id, guard.params), guard.shapes)))
    except CheckpointError as e:
        error = e
    agree(comm, error, plan.digest if plan is not None else 0)
    model.weights_report = fill(model, plan, comm)
    return model.weights_report
