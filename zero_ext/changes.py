"""What users do to a model after zeroify(): each either reaches the fp32 master
weights or raises a zero_ext error naming the fix; none is silently lost.
- load_state_dict on the model, `.module` or any submodule (Note [Loading into a
  zeroified model]); in-place edits (Note [Edits outside gathered_parameters]);
  dtype/device moves, refused (Note [Moves after zeroify]).
- The torch optimizer that zeroify() wrapped refuses step() and add_param_group().
"""
from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn


class ZeroUsageError(RuntimeError):
    """Something done to a zeroified model or its optimizer that would be silently
    lost; the message names what to do instead."""


# Note [Loading into a zeroified model]
#   zeroify() registers a load_state_dict pre-hook and post-hook on every module, so
#   model.load_state_dict, model.module's and any submodule's pass through them.
#   - The pre-hook, for each trainable parameter in the state dict (shape checked as
#     torch checks it): writes this rank's fragments of the value into the fp32
#     master (engine.fragments). No collective, no gathered unit: a rank reads only
#     its 1/N, so a memory-mapped full state dict costs about its shard. Where the
#     parameter is whole (stages 0-2, a gathered stage-3 unit) it is copied too.
#   - It then puts the parameter itself in the state dict, so torch's own copy is a
#     no-op while its key bookkeeping (strict, missing/unexpected keys) stays torch's.
#   - The post-hook of the module the load was called on recasts the master into the
#     low-precision copy gathered next (with a low param_dtype).
#   Frozen parameters stage 3 shards are written the same way into their param_dtype
#   shard; other frozen parameters and buffers are torch's. Every rank loads the same
#   state dict, as with DDP.

# Note [Edits outside gathered_parameters]
#   An edit is an in-place change to a parameter (nn.init.*, p.mul_() under no_grad).
#   - Stages 0-2 in fp32: a parameter is its bucket view, and the owned slice is the
#     master. An edit made on every rank is simply kept; nothing is checked.
#   - A low param_dtype: the master is a separate fp32 shard. Once per step (and
#     before a load) the parameters' version counters are compared with the last
#     snapshot. On a change, engine.absorb_param_edits() folds the edits into the
#     master, as gathered_parameters(modifier_rank=...) does: only elements whose
#     low-precision value changed, each rank its own shard.
#   - A bf16 split master (Note [Split master in the engine], csrc/engine/master_split.h):
#     the parameter is the master's top half and keeps its remainder, so the fold is
#     off by below half a bf16 ulp.
#   - Stage 3: outside forward a parameter is a 0-element tensor, so an edit changes
#     nothing; the next step refuses it, pointing to gathered_parameters.
#   Reading 1,202 version counters costs 0.3% of a stage-2 step
#   (benchmarks/bench_edit_detection.py), so it stays in Python. Edits through
#   `p.data` bypass the version counter and are not seen.

# Note [Moves after zeroify]
#   Module._apply (behind .to(), .double(), .half(), .cuda(), .to_empty(), ...) replaces
#   each parameter's data with fn(parameter). That would detach it from its bucket,
#   and training would stop updating it. So every module of a zeroified model gets an
#   instance-level _apply. It first applies fn to an empty tensor of each parameter's
#   and buffer's dtype and device, refusing any change. Afterwards it checks that each
#   trainable parameter still is its bucket view, restoring it and refusing otherwise
#   (to_empty()). A move that changes nothing (model.cpu() on the CPU) passes.

MOVE_FIX = ("choose the compute precision with zeroify(..., param_dtype='bf16' or 'fp16') and move the model "
            "to its device before zeroify(); to change either now, zero_ext.save() a checkpoint, rebuild and "
            "zeroify() the model again with the new settings, and zero_ext.load() it")


def _released_names(guard, module) -> dict:
    """Stage 3: state_dict key (without prefix) -> logical shape, for the sharded parameters."""
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        i = guard.index.get(id(p))
        if i is not None and guard.shapes[i].numel() > 0:
            out[name] = guard.shapes[i]
    return out


class ModelGuard:
    """Installed by zeroify() on the model: load hooks, the per-step edit check and
    the move guard. Holds the wrapper weakly (Note [No cycles through C++] in model.py)."""

    def __init__(self, wrapper, model: nn.Module, params: list, shapes: list, frozen: list = (),
                 frozen_shapes: list = ()):
        self._wrapper = weakref.ref(wrapper)
        self._model = weakref.ref(model)
        # engine parameter i = params[i]; then the frozen ones stage 3 shards
        # (Note [Stage 3 frozen parameters]): frozen index j = params[n_trainable + j]
        self.n_trainable = len(params)
        self.params = list(params) + list(frozen)
        self.shapes = [torch.Size(s) for s in list(shapes) + list(frozen_shapes)]  # logical (stage 3 empties them)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.stage3 = wrapper.units is not None
        self.low = wrapper.compute_dtype is not None
        # fp32 stages 0-2 keep edits by themselves, except in a parameter cut into pieces
        # (Note [Cut parameters] in csrc/engine/fill.cpp), which owns its storage
        self.track = self.stage3 or self.low or bool(wrapper.engine.cut_params())
        self.versions = self._versions()
        self._pieces = None                          # per parameter: (offset in it, master view)
        self._loading = None                         # the module whose load_state_dict is running
        self._released = None                        # stage 3: see _released_state_hook
        if self.stage3:
            model.register_state_dict_post_hook(self._released_state_hook())
        for m in model.modules():
            m.register_load_state_dict_pre_hook(self._pre_load)
            m.register_load_state_dict_post_hook(self._post_load)
            m._apply = _GuardedApply(self, m)

    def owns(self, p: torch.Tensor) -> bool:
        return id(p) in self.index and self.params[self.index[id(p)]] is p

    # What other modules read (tests/test_privates.py): the wrapper and the model, while they live.
    wrapper = property(lambda self: self._wrapper(), doc="the ZeroModel, or None once it is gone")
    model = property(lambda self: self._model(), doc="the user's module, or None once it is gone")

    def _wrapper_engine(self):
        w = self._wrapper()
        return None if w is None else w.engine

    def name_of(self, t: torch.Tensor) -> str:
        model = self._model()
        if model is not None:
            for name, x in itertools.chain(model.named_parameters(remove_duplicate=False),
                                           model.named_buffers(remove_duplicate=False)):
                if x is t:
                    return name
        return f"of shape {tuple(t.shape)}"

    # ------------------------------------------------------------------ edits
    def _released_state_hook(self):
        """Stage 3: model.module.state_dict() outside a gather would hold the released
        parameters as empty tensors, so a checkpoint written from it would hold no
        weights (a Hugging Face save_pretrained too). Their entries are filled with the
        full values instead, gathered unit by unit as model.state_dict() does (collective,
        or served to a rank that calls it alone: Note [Reading alone] in csrc/engine/away.h).
        zero_ext's own reads use keep_vars=True, whose values are the Parameters, and are
        let through."""
        ref = weakref.ref(self)

        def hook(module, state_dict, prefix, local_metadata):
            guard = ref()
            wrapper = guard._wrapper() if guard is not None else None
            if wrapper is None:
                return
            if guard._released is None:
                guard._released = _released_names(guard, module)
            empty = [n for n in guard._released
                     if (t := state_dict.get(prefix + n)) is not None and not isinstance(t, nn.Parameter)
                     and t.numel() == 0]
            if empty:
                full = wrapper.units.full_state_dict()
                for n in empty:
                    state_dict[prefix + n] = full[n]

        return hook

    def _versions(self) -> list:
        return [p._version for p in self.params] if self.track else []

    def accept(self, params=None) -> None:
        """The parameters (default: all) as they are now are the model's: after a
        load, or an edit that gathered_parameters committed."""
        if not self.track:
            return
        if params is None:
            self.versions = self._versions()
            return
        for p in params:
            i = self.index.get(id(p))
            if i is not None:
                self.versions[i] = p._version

    def check_edits(self) -> None:
        """Once per step (Note [Edits outside gathered_parameters])."""
        if not self.track:
            return
        now = self._versions()
        if now == self.versions:
            return
        engine = self._wrapper_engine()
        if self.stage3:
            changed = [i for i, (a, b) in enumerate(zip(now, self.versions)) if a != b]
            self.versions = now
            names = ", ".join(repr(self.name_of(self.params[i])) for i in changed[:3])
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            raise ZeroUsageError(
                f"zero_ext: parameter(s) {names}{more} were modified in place outside gathered_parameters(); in "
                f"stage 3 a parameter is an empty tensor outside forward, so the edit changed nothing. Make it "
                f"inside `with zero_ext.gathered_parameters(module, modifier_rank=0):` (rank 0's values are then "
                f"written into every rank's shard), or load values with model.load_state_dict()")
        if engine is not None:
            engine.absorb_param_edits()
        self.versions = now

    # ------------------------------------------------------------------ loads
    def master_pieces(self, engine, fresh: bool = False) -> list:
        """Per engine parameter: [(offset in the flattened parameter, view of this
        rank's fp32 master shard)] for the fragments this rank owns (Note [Fragment
        views] in csrc/engine/fragment_view.h); stage-3 frozen ones: their param_dtype slices.
        fresh: read them again (a master joined for a load: Note [Split master in the engine])."""
        if self._pieces is None or fresh:
            pieces: list = [[] for _ in self.params]
            for f in engine.fragment_views():
                pieces[f.param].append((f.param_offset, f.master))
            for f in engine.frozen_fragment_views():
                pieces[self.n_trainable + f.param].append((f.param_offset, f.master))
            self._pieces = pieces
        return self._pieces

    def _pre_load(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                  error_msgs) -> None:
        engine = self._wrapper_engine()
        if engine is None:
            return
        if prefix == "" or self._loading is None:   # the module load_state_dict was called on
            engine.flush_params()
            self.check_edits()                 # earlier edits reach the master before any load
            self._loading = module
            if engine.split_master:            # a master joined for this load (Note [Split master in the engine])
                self._pieces = None
        for name, p in module._parameters.items():
            i = self.index.get(id(p)) if p is not None else None
            key = prefix + name
            if i is None or key not in state_dict:
                continue
            value = state_dict[key]
            if not torch.overrides.is_tensor_like(value):
                continue                       # torch reports it
            if local_metadata.get("assign_to_params_buffers", False):
                self._loading = None
                raise ZeroUsageError(
                    f"zero_ext: load_state_dict(assign=True) would replace {key!r}, which zero_ext keeps in its "
                    f"sharded buckets, and training would stop updating it; use assign=False (the default): the "
                    f"values are copied into the fp32 master weights")
            if torch.__future__.get_swap_module_params_on_conversion():
                self._loading = None
                raise ZeroUsageError(
                    "zero_ext: load_state_dict with torch.__future__.set_swap_module_params_on_conversion(True) "
                    "would swap out parameters that zero_ext keeps in its buckets; set it back to False")
            state_dict[key] = p                # torch's own copy becomes a no-op (Note [Loading into a zeroified model])
            shape = self.shapes[i]
            if len(shape) == 0 and value.dim() == 1 and value.shape[0] == 1:
                value = value[0]               # torch's 0.3 compatibility rule
            if value.shape != shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {value.shape} from "
                                  f"checkpoint, the shape in current model is {shape}.")
                continue
            try:
                self.write(engine, i, p, value)
            except Exception as ex:  # noqa: BLE001 - reported as torch reports a failed copy
                error_msgs.append(f'While copying the parameter named "{key}", whose dimensions in the model '
                                  f'are {shape} and whose dimensions in the checkpoint are {value.size()}, an '
                                  f'exception occurred : {ex.args}.')

    @torch.no_grad()
    def write(self, engine, i: int, p: torch.Tensor, value: torch.Tensor) -> None:
        """Guarded parameter i := value: this rank's pieces of its master (of its
        param_dtype shard, for a stage-3 frozen one), and the parameter itself where
        it is whole. No collective."""
        flat = value.detach().reshape(-1)
        for poff, master in self.master_pieces(engine)[i]:
            master.copy_(flat[poff:poff + master.numel()])
        if p.numel() == flat.numel():          # whole here: stages 0-2, or a gathered stage-3 unit
            p.data.copy_(value.detach().reshape(p.shape))

    def _post_load(self, module, incompatible_keys) -> None:
        if module is not self._loading:
            return
        self._loading = None
        engine = self._wrapper_engine()
        if engine is not None:
            # what is gathered next: the low-precision copy, or with offload the device's copy
            # (Note [Optimizer offload]); a no-op where the master itself is gathered
            engine.cast_masters()
        self.accept()

    # ------------------------------------------------------------------ moves
    def apply(self, module, fn, recurse=True):
        if self._wrapper() is None:            # the zeroified model is gone: plain torch
            return type(module)._apply(module, fn, recurse)
        for t in itertools.chain(module._parameters.values(), module._buffers.values()):
            if t is None:
                continue
            try:
                with torch.no_grad():
                    out = fn(torch.empty(0, dtype=t.dtype, device=t.device))
                moved = not isinstance(out, torch.Tensor) or out.dtype != t.dtype or out.device != t.device
                to = f"{out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
            except Exception as ex:  # noqa: BLE001 - e.g. .cuda() without CUDA
                moved, to = True, f"something else ({type(ex).__name__}: {ex})"
            if moved:
                raise ZeroUsageError(
                    f"zero_ext: this dtype/device change (model.to(), .double(), .half(), .float(), .cuda(), ...) "
                    f"after zeroify() would turn {self.name_of(t)!r} from {t.dtype} on {t.device} into {to}, "
                    f"detaching it from zero_ext's buckets (training would stop updating it); {MOVE_FIX}")
        params = [(k, p, p.data) for k, p in module._parameters.items() if p is not None]
        buffers = dict(module._buffers)
        result = type(module)._apply(module, fn, recurse)
        replaced = [k for k, p, data in params if module._parameters[k] is not p or p.data_ptr() != data.data_ptr()
                    or p.dtype != data.dtype or p.shape != data.shape]
        replaced += [k for k, b in buffers.items() if module._buffers[k] is not b]
        if replaced:
            for k, p, data in params:
                module._parameters[k] = p
                p.data = data
            module._buffers.update(buffers)
            raise ZeroUsageError(
                f"zero_ext: this call (e.g. to_empty()) replaced {self.name_of(getattr(module, replaced[0]))!r}, "
                f"which would detach it from what zero_ext manages; it was put back. "
                f"{MOVE_FIX[0].upper()}{MOVE_FIX[1:]}")
        return result


class _GuardedApply:
    """A zeroified model's module._apply (Note [Moves after zeroify])."""

    def __init__(self, guard: ModelGuard, module: nn.Module):
        self.guard, self.module = guard, weakref.ref(module)

    def __call__(self, fn, recurse=True):
        return self.guard.apply(self.module(), fn, recurse)

    def __deepcopy__(self, memo):
        # copy.deepcopy(model.module) is not zeroified: its copy moves as torch moves
        return _PlainApply(memo[id(self.module())])


class _PlainApply:
    def __init__(self, module: nn.Module):
        self.module = weakref.ref(module)

    def __call__(self, fn, recurse=True):
        m = self.module()
        return type(m)._apply(m, fn, recurse)


def retire_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """The torch optimizer zeroify() wrapped: its step() and add_param_group() now
    raise (it shares its param_groups with the returned optimizer)."""

    cls = type(optimizer).__name__

    def step(*args, **kwargs):
        raise ZeroUsageError(
            f"zero_ext: this torch optimizer ({cls}) was wrapped by zeroify(); step the optimizer zeroify() "
            f"returned instead: `model, opt = zero_ext.zeroify(model, opt, ...)` and call opt.step()")

    def add_param_group(*args, **kwargs):
        raise ZeroUsageError(
            f"zero_ext: this torch optimizer ({cls}) was wrapped by zeroify(), whose bucket layout is fixed; "
            + ADD_GROUP_FIX)

    optimizer.step = step
    optimizer.add_param_group = add_param_group
    optimizer._zero_ext_wrapped = True


def is_retired(optimizer) -> bool:
    """Whether zeroify() wrapped this torch optimizer (retire_optimizer)."""
    return getattr(optimizer, "_zero_ext_wrapped", False)


ADD_GROUP_FIX = ("put every param group in the torch optimizer before calling zeroify() (a group can start "
                 "with lr=0 until it should train, and an LR scheduler can raise it later)")
