"""What users do to a model after zeroify() reaches the fp32 masters or raises naming the fix:
loads, in-place edits and moves (the Notes below); the wrapped torch optimizer refuses step().
"""
from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn


class ZeroUsageError(RuntimeError):
    """Something done to a zeroified model or its optimizer that would be silently lost."""


# Note [Loading into a zeroified model]
#   Every module gets a load_state_dict pre-hook and post-hook. The pre-hook writes this
#   rank's fragments of each trainable parameter's value into its fp32 master: no
#   collective, so a memory-mapped state dict costs about the shard. A whole parameter is
#   copied too. It then puts the parameter itself in the state dict: torch's copy is a
#   no-op, its key bookkeeping stays torch's. The post-hook recasts the master into the
#   copy gathered next. Stage 3's frozen parameters are written alike into their shard;
#   other frozen ones and buffers are torch's. Every rank loads the same state dict.

# Note [Edits outside gathered_parameters]
#   An edit is an in-place change to a parameter (nn.init.*, p.mul_() under no_grad).
#   - Stages 0-2 in fp32: a parameter is its bucket view, the master: nothing to do.
#   - A low param_dtype: once per step (and before a load) the version counters are
#     compared with the last snapshot; engine.absorb_param_edits() folds changed
#     elements into the master. A bf16 split master (Note [Split master in the engine],
#     csrc/engine/master_split.h) keeps its remainder: off by below half a bf16 ulp.
#   - Stage 3: outside forward a parameter is empty; the next step refuses the edit.
#   Reading 1,202 version counters costs 0.3% of a stage-2 step
#   (benchmarks/bench_edit_detection.py). Edits through `p.data` are not seen.

# Note [Moves after zeroify]
#   Module._apply (behind .to(), .half(), .cuda(), .to_empty(), ...) would detach each
#   parameter from its bucket. So every module gets an instance-level _apply: it tries fn
#   on an empty tensor of each parameter's and buffer's dtype and device, refusing any
#   change, and afterwards puts back and refuses a replaced parameter (to_empty()).

MOVE_FIX = ("choose the compute precision with zeroify(..., param_dtype='bf16' or 'fp16') and move the model "
            "to its device before zeroify(); to change either now, zero_ext.save() a checkpoint, rebuild and "
            "zeroify() the model again with the new settings, and zero_ext.load() it")


class ModelGuard:
    """The load hooks, the per-step edit check and the move guard of a zeroified model."""

    def __init__(self, wrapper, model: nn.Module, params: list, shapes: list, frozen: list = (),
                 frozen_shapes: list = ()):
        self._wrapper = weakref.ref(wrapper)   # Note [No cycles through C++] (zero_ext/model.py)
        self._model = weakref.ref(model)
        # engine parameter i = params[i]; stage 3's sharded frozen one j = params[n_trainable + j]
        self.n_trainable = len(params)
        self.params = list(params) + list(frozen)
        self.shapes = [torch.Size(s) for s in list(shapes) + list(frozen_shapes)]  # logical (stage 3 empties them)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.stage3 = wrapper.units is not None
        # fp32 stages 0-2 keep edits, but for cut parameters (Note [Cut parameters] in csrc/engine/fill.cpp)
        self.track = self.stage3 or wrapper.compute_dtype is not None or bool(wrapper.engine.cut_params())
        self.versions = self._versions()
        self._pieces = None                          # master_pieces
        self._loading = None                         # the module whose load_state_dict is running
        self._released = None                        # stage 3: the sharded parameters' state_dict keys
        if self.stage3:
            model.register_state_dict_post_hook(self._released_state_hook())
        for m in model.modules():
            m.register_load_state_dict_pre_hook(self._pre_load)
            m.register_load_state_dict_post_hook(self._post_load)
            m._apply = _GuardedApply(self, m)

    def owns(self, p: torch.Tensor) -> bool:
        return id(p) in self.index and self.params[self.index[id(p)]] is p

    wrapper = property(lambda self: self._wrapper(), doc="the ZeroModel, or None once it is gone")
    model = property(lambda self: self._model(), doc="the user's module, or None once it is gone")

    def _wrapper_engine(self):
        w = self._wrapper()
        return None if w is None else w.engine

    def name_of(self, t: torch.Tensor) -> str:
        model = self._model()
        named = () if model is None else itertools.chain(model.named_parameters(remove_duplicate=False),
                                                         model.named_buffers(remove_duplicate=False))
        return next((name for name, x in named if x is t), f"of shape {tuple(t.shape)}")

    def _released_state_hook(self):
        """Stage 3: model.module.state_dict() fills the released (empty) parameters with their full
        values, as model.state_dict(); keep_vars=True reads (zero_ext's own) are let through."""
        ref = weakref.ref(self)

        def hook(module, state_dict, prefix, local_metadata):
            guard = ref()
            wrapper = guard._wrapper() if guard is not None else None
            if wrapper is None:
                return
            if guard._released is None:   # (without prefix)
                guard._released = [name for name, p in module.named_parameters(remove_duplicate=False)
                                   if (i := guard.index.get(id(p))) is not None and guard.shapes[i].numel() > 0]
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
        """The parameters (default: all) as they are now are the model's (after a load or a commit)."""
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

    def master_pieces(self, engine, fresh: bool = False) -> list:
        """Per engine parameter: [(offset in it, view of this rank's master)] (Note [Fragment views]
        in csrc/engine/fragment_view.h); fresh: read them again (a split master joined for a load)."""
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
        """Guarded parameter i := value in this rank's pieces, and in itself where whole. No collective."""
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
            engine.cast_masters()   # what is gathered next
        self.accept()

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
    """The torch optimizer zeroify() wrapped: its step() and add_param_group() now raise."""
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
