"""ZeroOptimizer: the torch.optim.Optimizer that zeroify() returns.

It keeps the user's param_groups live (LR schedulers work) and drives the C++ engine.
Each torch optimizer given (Muon + AdamW: two) is a Part of it (see Part).
"""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.optim.optimizer as _optim_module

from . import _C, alone, optim_state
from .amp import check_scaler
from .changes import ADD_GROUP_FIX, ZeroUsageError
from ._C import PHASE_CLIP, PHASE_STEP
from .step_control import StepControl
from .whole import owned_states

# Optimizers whose update is elementwise: they may run over a flat shard.
FUSED = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
ELEMENTWISE = FUSED + tuple(getattr(torch.optim, n) for n in (
    "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop") if hasattr(torch.optim, n))

STATE_FORMAT = 1


class Part:
    """One wrapped torch optimizer, its param groups (indices into param_groups) and its kind:
    'fused' (C kernels over the shard), 'shard' (it over 1-D shard views) or 'whole' (it over
    this rank's whole tensors, zero_ext/whole.py)."""

    def __init__(self, cls, groups: list, kind: str):
        self.cls, self.groups, self.kind = cls, groups, kind
        self.opt = None               # the inner torch optimizer ('shard', 'whole'), if this rank has any
        self.inner_ids: list = []     # inner param group k = param_groups[inner_ids[k]]
        self.owned: list = []         # 'whole': (engine param index, master view) in inner order
        self.adam = issubclass(cls, (torch.optim.Adam, torch.optim.AdamW))   # 'fused': Adam(W), else SGD
        self.adamw = issubclass(cls, torch.optim.AdamW)


class ZeroOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose state is sharded across ranks (see zeroify)."""

    def __init__(self, optimizer, engine, config, fused: bool, fingerprint: int, comm, parts: list,
                 param_groups_of: list, *, params: list, param_shapes: list, units, frozen_bytes: int, guard):
        """param_shapes[i]: engine parameter i's logical shape (stage 3 empties the tensor);
        units: the stage-3 unit hooks; frozen_bytes: what this rank holds of frozen parameters."""
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        groups = [g for o in optimizers for g in o.param_groups]
        # copies: torch's __init__ would set the first optimizer's defaults into every group
        torch.optim.Optimizer.__init__(self, [dict(g) for g in groups], dict(optimizers[0].defaults))
        self.param_groups = optimizers[0].param_groups if len(optimizers) == 1 else groups
        self.state = defaultdict(dict)                  # the state lives in the engine
        self.wrapped_class = type(optimizers[0])
        self.parts = parts                              # the wrapped torch optimizers (Part), in the order given
        self.param_group_of = param_groups_of           # engine parameter i -> its param group
        self._done: set | None = None                   # parts stepped in the open iteration
        self._iter_scale, self._iter_skip = 1.0, False
        self._tensor_updates = 0                        # whole tensors this rank updated
        self._engine, self._config, self._guard, self._units = engine, config, guard, units
        self._params, self.param_shapes = list(params), list(param_shapes)
        self._frozen_bytes, self._fused, self._fingerprint = frozen_bytes, fused, fingerprint
        self.comm = comm                                # Note [One communication layer]
        self._host_steps = [0] * len(self.param_groups)  # optimizer steps taken, per group
        self._clip_coef = 1.0                           # folded into the next step
        self.shard_optimizer, self._shard_group_ids = None, []   # the torch optimizer over 1-D shard views
        self._found_inf = None                          # this step's inf/nan verdict, once known
        self.loss_scaler = self._make_scaler(config)
        self._host_skipped = 0
        for part in self.parts:
            if part.kind == "shard":   # over 1-D shard views, one per bucket
                self._build_inner(part, zip(engine.bucket_groups(part.groups), engine.param_shards(part.groups),
                                            engine.grad_shards(part.groups)))
                self.shard_optimizer, self._shard_group_ids = part.opt, part.inner_ids   # one: api refuses two
            elif part.kind == "whole":   # over this rank's fp32 master views of whole tensors
                owned = [(self.param_group_of[i], i, m, g) for i, m, g in engine.owned_tensors(part.groups)]
                part.owned = [(i, m) for _, i, m, _ in sorted(owned, key=lambda t: t[0])]   # in inner order
                self._build_inner(part, [(gi, m, g) for gi, _, m, g in owned])
        if config.master_remainder_applies(len(self.parts) == 1 and self.parts[0].kind == "fused"):
            engine.enable_split_master()   # Note [Split master in the engine] (csrc/engine/master_split.h)
        self._ctl = self._make_step_control(config)

    @staticmethod
    def _make_scaler(config):
        mode = config.resolved_loss_scale()
        if mode is None:
            return None
        dynamic = mode == "dynamic"
        scale = float(config.initial_loss_scale if dynamic else mode)
        return _C.LossScaler(
            scale=scale, growth_factor=float(config.loss_scale_growth_factor),
            backoff_factor=float(config.loss_scale_backoff_factor),
            growth_interval=int(config.loss_scale_growth_interval), hysteresis=int(config.loss_scale_hysteresis),
            min_scale=min(float(config.min_loss_scale), scale), max_scale=max(float(config.max_loss_scale), scale),
            dynamic=dynamic)

    def _make_step_control(self, config):
        """Note [Step control] (csrc/core/zx_step_control.h); "auto" turns it on for CUDA parameters."""
        if config.step_in_backward:   # Note [Step in backward]: the steps run inside backward
            return None
        device = self._engine.shard_device
        want = config.step_control
        fused_only = len(self.parts) == 1 and self.parts[0].kind == "fused"
        if want is True and not fused_only:
            raise ValueError("zero_ext: step_control=True needs one fused optimizer (Adam, AdamW or SGD); "
                             "pass step_control='auto' (or False) with "
                             + ", ".join(p.cls.__name__ for p in self.parts))
        if not fused_only or want is False or (want == "auto" and device.type != "cuda"):
            return None
        return StepControl(self._engine, len(self.param_groups), self.loss_scaler, device)

    @property
    def _clip_coef(self) -> float:
        """The clip factor pending for the next step; 1 once the gradients it came from change."""
        return self._clip_value if self._clip_at == self._engine.grad_generation else 1.0

    @_clip_coef.setter
    def _clip_coef(self, coef: float) -> None:
        self._clip_value, self._clip_at = float(coef), self._engine.grad_generation

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """What GradScaler.step reads first (Note [GradScaler on sharded gradients] in zero_ext/amp.py)."""
        check_scaler(self._config)
        return False

    @property
    def group_steps(self) -> list[int]:
        """Optimizer steps taken, per group (read from the device under step control)."""
        return self._ctl.host_steps() if self._ctl is not None else self._host_steps

    @group_steps.setter
    def group_steps(self, steps) -> None:
        if self._ctl is not None:
            self._ctl.load_steps(steps)
        else:
            self._host_steps = list(steps)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for an inf/nan gradient under loss scaling."""
        if self._ctl is not None and self.loss_scaler is not None:
            return int(self._ctl.host_scaler(self.loss_scaler).skipped)
        return self._host_skipped

    @skipped_steps.setter
    def skipped_steps(self, n: int) -> None:
        if self._ctl is not None and self.loss_scaler is not None:
            host = self._ctl.host_scaler(self.loss_scaler)
            host.skipped = int(n)
            self._ctl.load_scaler(host)
        self._host_skipped = int(n)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without loss scaling)."""
        if self.loss_scaler is None:
            return 1.0
        return float(self._ctl.scale) if self._ctl is not None else self.loss_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss times the current loss scale; call .backward() on the result."""
        if self.loss_scaler is None:
            return loss
        return loss * (self._ctl.scale if self._ctl is not None else self.loss_scaler.scale)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """scale_loss(loss).backward(**kwargs): use it in place of loss.backward()."""
        self.scale_loss(loss).backward(**kwargs)

    def grad_scale(self) -> float:
        """What shard gradients are multiplied by to become the averaged unscaled ones."""
        return 1.0 / (self._engine.grad_divisor() * self.loss_scale)

    def grad_multiplier(self) -> float:
        """grad_scale() times the pending clip factor: the next step's multiplier."""
        return self._clip_coef * self.grad_scale()

    def _build_inner(self, part: Part, tensors) -> None:
        """part's torch optimizer over (param group, tensor, its gradient), one inner group per
        param group (none when this rank holds no tensor of the part)."""
        by_group: dict[int, list] = {}
        for gi, t, g in tensors:
            t.grad = g
            by_group.setdefault(gi, []).append(t)
        part.inner_ids = sorted(by_group)
        groups = [dict(self._hyper(gi), params=by_group[gi]) for gi in part.inner_ids]
        part.opt = part.cls(groups) if groups else None

    def add_param_group(self, param_group: dict) -> None:
        if self._engine is None:                         # Optimizer.__init__ adds the groups
            return super().add_param_group(param_group)
        raise ZeroUsageError("zero_ext: add_param_group after zeroify() is not supported: the bucket layout of "
                             "the parameters is fixed when zeroify() runs; " + ADD_GROUP_FIX)

    def _hyper(self, gi: int) -> dict:
        return {k: v for k, v in self.param_groups[gi].items() if k != "params"}

    # Note [Step hooks]
    #   torch wraps a subclass's step() in profile_hook_step, whose record_function costs ~38 of
    #   our ~85 us (benchmarks/bench_step_glue.py) even with no profiler. So step is marked hooked
    #   and runs torch's wrapper (_hooked_step) only when a hook is registered or a profiler is on.
    #   _step turns gradients off itself: the torch.no_grad() decorator costs ~15 us a call.
    def step(self, closure=None):
        if (_optim_module._global_optimizer_pre_hooks or _optim_module._global_optimizer_post_hooks
                or self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks
                or torch._C._autograd._profiler_enabled()):
            return self._hooked_step(closure)
        out = self._step(closure)
        self._optimizer_step_code()
        return out

    step.hooked = True

    def _step(self, closure=None):
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            if self._ctl is None and not self._config.step_in_backward:
                out = self._step_parts(range(len(self.parts)), closure)
            else:
                out = self._begin_step_call(closure)
                if self._ctl is not None:   # Note [Step control]: one fused part, its scalars in device memory
                    self._ctl.before_step()
                    self._fused_step(1.0, self.parts[0], control=True)
                else:                       # Note [Step in backward]: the buckets stepped in backward
                    self._host_steps = [self._engine.backward_steps] * len(self.param_groups)
                self._engine.all_gather_params()
                if not self._config.overlap_param_gather:
                    self._engine.wait_params()
        finally:
            torch._C._set_grad_enabled(grad)
        if self.serving is not None:   # Note [Shard server]
            self.serving.step_done()
        return out

    _hooked_step = torch.optim.Optimizer.profile_hook_step(_step)   # Note [Step hooks]

    def arm_backward_step(self) -> None:
        """Note [Step in backward] (csrc/engine/backward_step.cpp), with the param groups as they are now."""
        part = self.parts[0]
        scale = 1.0 / self._engine.grad_divisor()
        if part.adam:   # Note [Hyperparameters] (csrc/kernels_binding.h)
            self._engine.set_backward_step_adam(self.param_groups, part.groups, scale, part.adamw)
        else:
            self._engine.set_backward_step_sgd(self.param_groups, part.groups, scale)

    def _no_whole_gradient(self, what: str) -> None:
        if self._config.step_in_backward:
            raise ZeroUsageError(f"zero_ext: {what} needs the whole gradient before the step, but with "
                                 f"step_in_backward=True each bucket steps as its gradient lands in backward; "
                                 f"remove the call, or pass step_in_backward=False to zeroify()")

    def _begin_step_call(self, closure):
        """The closure, the sequence check's phase mark, the check for edits."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine.sequence_mark(PHASE_STEP)
        if self._guard is not None:
            self._guard.check_edits()   # Note [Edits outside gathered_parameters] (changes.py)
        return loss

    def _begin_iteration(self) -> None:
        """The first step() after a backward: one clip factor and inf/nan verdict for every part."""
        self._done = set()
        self._iter_scale = self.grad_multiplier()
        self._clip_coef = 1.0
        self._iter_skip = False
        if self.loss_scaler is not None:
            # one all-reduce (or clip_grad_norm_'s): an inf/nan anywhere skips the step everywhere
            found = self._found_inf if self._found_inf is not None else self._engine.grad_sumsq(1.0)[1] > 0
            self._found_inf = None
            if self.loss_scaler.update(bool(found)):
                self._host_skipped += 1
                self._iter_skip = True
        if not self._iter_skip:
            # Note [Unused parameters] (csrc/engine/unused.cpp)
            if self._engine.world_size > 1 and not self._engine.agrees_unused and self._engine.grads_since_step:
                self._refuse_missing_grads(self._engine.locally_unused())
            self._engine.begin_step(len(self.parts) == 1)

    def _refuse_missing_grads(self, missing: list) -> None:
        if not missing:
            return
        # a rank that alone skipped its backward waits here and is named on every rank
        self._engine.sequence_sync()
        model = self._guard.model if self._guard is not None else None
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        listed = [repr(names.get(id(self._params[i]), f"#{i}")) for i in missing[:8]]
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        why = ("find_unused_parameters=False" if self._config.find_unused_parameters is False else
               "every parameter got a gradient on every rank at the first step, so the ranks stopped "
               "agreeing on unused parameters (find_unused_parameters='auto')")
        raise ZeroUsageError(
            f"zero_ext: rank {self._engine.rank}: parameter(s) {', '.join(listed)}{more} got no gradient in this "
            f"step, but {why}. Pass find_unused_parameters=True to zeroify() (one small all-reduce per step, as "
            f"DDP(find_unused_parameters=True)) for a model whose parameters are not all used in every step")

    def _step_parts(self, which, closure=None):
        loss = self._begin_step_call(closure)
        which = list(which)
        if self._done is None or any(k in self._done for k in which):
            self._begin_iteration()
        if not self._iter_skip:
            for k in which:
                self._step_part(self.parts[k], self._iter_scale)
        self._done.update(which)
        if len(self._done) == len(self.parts):
            self._done = None
        if not self._iter_skip and not self._config.overlap_param_gather:
            self._engine.wait_params()
        return loss

    def _step_part(self, part: Part, scale: float) -> None:
        for gi in part.groups:
            self._host_steps[gi] += 1
        # Note [Groups as an argument] (csrc/engine/groups.h): one optimizer passes no list
        one = len(self.parts) == 1
        groups = [] if one else part.groups
        if not one:
            self._engine.advance_steps(groups)
        if part.kind == "fused":
            self._fused_step(scale, part)
        else:
            self._engine.scale_grads(scale, groups)
            if part.opt is not None:
                for inner, gi in zip(part.opt.param_groups, part.inner_ids):
                    inner.update(self._hyper(gi))
                if part.kind == "shard":
                    with self._keep_unstepped(groups):
                        part.opt.step()
                else:
                    self._whole_step(part)
            self._engine.cast_masters(groups)   # low precision: the copy that is gathered next
        self._engine.all_gather_params(groups)

    def _whole_step(self, part: Part) -> None:
        """The torch optimizer over this rank's whole tensors, the gradients of those no rank
        stepped (Note [Unused parameters]) hidden so that torch skips them."""
        stepped = self._engine.stepped_params()
        hidden = [(m, m.grad) for i, m in part.owned if not stepped[i]]
        for m, _ in hidden:
            m.grad = None
        try:
            part.opt.step()
        finally:
            for m, g in hidden:
                m.grad = g
        self._tensor_updates += len(part.owned) - len(hidden)

    def bucket_views(self, groups=()) -> list:
        """The shard optimizer's tensor of each bucket of these groups (all: none given), in
        param_shards() order (Note [Fragment views]: a fragment's `bucket` indexes it)."""
        inner = {gi: list(g["params"]) for gi, g in zip(self._shard_group_ids, self.shard_optimizer.param_groups)}
        return [inner[gi].pop(0) for gi in self._engine.bucket_groups(groups)]

    @contextlib.contextmanager
    def _keep_unstepped(self, groups):
        """The shard optimizer steps whole bucket views: the elements (values and per-element
        states) of parameters no rank stepped (Note [Unused parameters]) are put back after it."""
        stepped = self._engine.stepped_params()
        if all(stepped):
            yield
            return
        views = self.bucket_views(groups)
        saved = []
        for f in self._engine.fragment_views(masters=False, groups=groups):
            if stepped[f.param] or f.numel == 0:
                continue
            v, lo, n = views[f.bucket], f.slice_offset, f.numel
            st = self.shard_optimizer.state.get(v, {})
            per_elem = {k: t[lo:lo + n].clone() for k, t in st.items() if torch.is_tensor(t) and t.shape == v.shape}
            saved.append((v, lo, n, v[lo:lo + n].clone(), per_elem))
        yield
        for v, lo, n, vals, per_elem in saved:
            v[lo:lo + n].copy_(vals)
            for k, t in self.shard_optimizer.state.get(v, {}).items():
                if k in per_elem:
                    t[lo:lo + n].copy_(per_elem[k])
                elif torch.is_tensor(t) and t.shape == v.shape:   # created by this step: as it starts
                    t[lo:lo + n].zero_()

    def _fused_step(self, scale: float, part: Part, control: bool = False) -> None:
        """control: the multiplier, skip verdict and step counts come from the step control's memory."""
        steps = [1] * len(self.param_groups) if control else self._host_steps
        ctl = dict(ctl=self._ctl.ctl, ctl_steps=self._ctl.steps) if control else {}
        if part.adam:
            self._engine.step_adam(self.param_groups, part.groups, steps, scale, part.adamw, **ctl)
        else:
            self._engine.step_sgd(self.param_groups, part.groups, steps, scale, **ctl)

    def synchronize(self) -> None:
        """Wait for every outstanding collective (overlap_param_gather=True: before reading parameters)."""
        self._engine.wait_reductions()
        self._engine.flush_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the averaged gradients, folded into the next step();
        returns the total norm before clipping."""
        self._no_whole_gradient("clip_grad_norm_")
        norm_type = float(norm_type)
        self._engine.sequence_mark(PHASE_CLIP)
        if norm_type == 2.0 and self._ctl is not None:
            return self._ctl.clip(max_norm)   # a device tensor: nothing read back
        if norm_type == 2.0:
            sumsq, nonfinite = self._engine.grad_sumsq(self.grad_scale())
            total = math.sqrt(sumsq) if nonfinite == 0 else math.inf
        elif norm_type == math.inf:
            self._engine.wait_reductions()
            local = max((g.abs().max().item() for g in self._engine.grad_shards() if g.numel()), default=0.0)
            total = local * self.grad_scale()
            if self._engine.partitions > 1:
                total = self.comm.all_reduce([total], op=dist.ReduceOp.MAX)[0]
            nonfinite = 0 if math.isfinite(total) else 1
        else:
            raise ValueError(f"zero_ext: clip_grad_norm_ supports norm_type 2.0 and inf, got {norm_type}; pass "
                             f"norm_type=2.0 (the default) or float('inf')")
        self._found_inf = nonfinite > 0
        self.clip_by_total_norm_(max_norm, total)
        return torch.tensor(total)

    def clip_by_total_norm_(self, max_norm: float, total_norm: float) -> None:
        """torch's clip_grads_with_norm_, folded into the next step."""
        self._no_whole_gradient("clip_by_total_norm_")
        coef = float(max_norm) / (float(total_norm) + 1e-6)
        if self._ctl is not None:
            self._ctl.clip_by(coef, not math.isfinite(float(total_norm)))
        elif coef < 1.0:
            self._clip_coef *= coef

    def clip_grad_value_(self, clip_value: float) -> None:
        """torch.nn.utils.clip_grad_value_ on the averaged gradients, in the reduced shards."""
        self._no_whole_gradient("clip_grad_value_")
        if self._ctl is not None:
            raise ZeroUsageError("zero_ext: clip_grad_value_ with the step control on the device (a GPU): the "
                                 "loss scale is not read back there; use clip_grad_norm_, or zeroify with "
                                 "step_control=False")
        self._engine.sequence_mark(PHASE_CLIP)
        self._engine.wait_reductions()
        bound = float(clip_value) / self.grad_scale()
        with torch.no_grad():
            for g in self._engine.grad_shards():
                g.clamp_(-bound, bound)

    def state_dict(self) -> dict:
        """The complete state in torch's format, as DDP's optimizer gives it (Note [Complete
        optimizer state] in zero_ext/optim_state.py); load_state_dict() takes it at any world size."""
        return optim_state.state_dict(self)

    def sharded_state_dict(self) -> dict:
        """This rank's sharded state (no collective), loaded back at the same stage, world size and rank."""
        self._engine.wait_reductions()
        groups = [dict(self._hyper(gi), params=list(range(len(g["params"]))))
                  for gi, g in enumerate(self.param_groups)]
        z = {"format": STATE_FORMAT, "stage": self._config.stage, "world_size": self._engine.world_size,
             "rank": self._engine.rank, "fingerprint": self._fingerprint, "optimizer": self.wrapped_class.__name__,
             "steps": list(self.group_steps), "param_steps": self.param_step_counts(),
             "flat_state": {k: v.clone() for k, v in self._engine.states().items()},
             "shard_optimizer": self.shard_optimizer.state_dict() if self.shard_optimizer is not None else None,
             "whole_optimizers": [p.opt.state_dict() if p.opt is not None else None
                                  for p in self.parts if p.kind == "whole"],
             "loss_scaler": self.scaler_state_dict(), "skipped_steps": self.skipped_steps}
        return {"state": {}, "param_groups": groups, "zero_ext": z}

    def load_state_dict(self, state_dict: dict) -> None:
        """A complete state dict (here or a plain torch optimizer's, any world size and stage), or
        this rank's own sharded_state_dict(); no collective."""
        z = state_dict.get("zero_ext") if isinstance(state_dict, dict) else None
        if z is None:
            return optim_state.load_state_dict(self, state_dict)
        if z.get("format") != STATE_FORMAT:
            raise ValueError(f"zero_ext: optimizer state format {z.get('format')} is not {STATE_FORMAT} (this "
                             f"zero_ext's); load it with the zero_ext version that saved it, or save the complete "
                             f"state with optimizer.state_dict() there")
        mine = (self._config.stage, self._engine.world_size, self._engine.rank, self.wrapped_class.__name__)
        theirs = (z["stage"], z["world_size"], z["rank"], z["optimizer"])
        if mine != theirs:
            shard = (f"; optimizer.state_dict() holds only the saving rank's shard (a checkpoint that rank "
                     f"{z['rank']} alone wrote holds no other rank's state)" if z["rank"] != self._engine.rank else "")
            raise ValueError(f"zero_ext: optimizer state saved at (stage, world_size, rank, optimizer) = "
                             f"{theirs} cannot load at {mine}{shard}; sharded_state_dict() round-trips only at "
                             f"the same stage, world size and rank. To checkpoint for any rank, world size or "
                             f"stage: optimizer.state_dict() on every rank (the complete state, as DDP's), or "
                             f"zero_ext.save(path, model, optimizer) / zero_ext.load(...) on every rank")
        saved_dtype = {str(t.dtype) for k, t in z["flat_state"].items() if k in ("exp_avg", "exp_avg_sq")}
        want = "torch.bfloat16" if self._config.state_dtype == "bf16" else "torch.float32"
        if saved_dtype and saved_dtype != {want}:
            raise ValueError(f"zero_ext: this sharded optimizer state holds {'/'.join(sorted(saved_dtype))} Adam "
                             f"states but this run has state_dtype={self._config.state_dtype!r}; build the run with "
                             f"the state_dtype it was saved with, or convert through optimizer.state_dict() / "
                             f"zero_ext.save (complete states in fp32, which load into either state_dtype)")
        if z["fingerprint"] != self._fingerprint:
            raise ValueError("zero_ext: optimizer state was saved for different parameters (shapes, groups or "
                             "config differ); build the same model and config before loading")
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"zero_ext: the saved state has {len(state_dict['param_groups'])} param groups, this "
                             f"optimizer {len(self.param_groups)}; build the optimizer with the same param groups "
                             f"as the one saved")
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
        for name, t in z["flat_state"].items():
            self._engine.state(name).copy_(t)
        self.group_steps = list(z["steps"])
        # (one saved before per-parameter step counts: its group's)
        self._engine.set_param_steps(list(z.get("param_steps") or self._group_steps_per_param()))
        if self.shard_optimizer is not None and z["shard_optimizer"] is not None:
            self.shard_optimizer.load_state_dict(z["shard_optimizer"])
        for part, saved in zip([p for p in self.parts if p.kind == "whole"], z.get("whole_optimizers", [])):
            if part.opt is not None and saved is not None:
                part.opt.load_state_dict(saved)
        self.load_scaler_state_dict(z.get("loss_scaler"))
        self.skipped_steps = int(z.get("skipped_steps", 0))

    def _group_steps_per_param(self) -> list[int]:
        steps = self.group_steps
        return [steps[gi] for gi in self.param_group_of]

    def param_step_counts(self) -> list[int]:
        """Optimizer steps each trainable parameter took (Note [Unused parameters]); under step
        control, its group's."""
        if self._ctl is not None:
            self._engine.set_param_steps(self._group_steps_per_param())
        return list(self._engine.param_steps())

    def scaler_state_dict(self) -> dict | None:
        """The loss scaler's state (None without loss scaling)."""
        if self.loss_scaler is None:
            return None
        return (self._ctl.host_scaler(self.loss_scaler) if self._ctl is not None else self.loss_scaler).state_dict()

    def load_scaler_state_dict(self, d: dict | None) -> None:
        if d is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(d)
            if self._ctl is not None:
                self._ctl.load_scaler(self.loss_scaler)

    def stats(self) -> dict:
        """A dict describing this rank (see README "stats()")."""
        s = self._engine.stats()
        comm = s["comm"]   # an all-reduce moves as much as a reduce-scatter and an all-gather
        s.update(optimizer="+".join(p.cls.__name__ for p in self.parts), fused=self._fused,
                 loss_scale=self.loss_scale if self.loss_scaler is not None else None,
                 skipped_steps=self.skipped_steps, steps=max(self.group_steps, default=0),
                 comm_bytes=comm["reduce_scatter"]["bytes"] + comm["all_gather"]["bytes"]
                 + 2 * comm["all_reduce"]["bytes"], frozen_parameter_bytes=self._frozen_bytes)
        msb = s["model_state_bytes"]
        for part in self.parts:
            if part.opt is not None:
                extra = sum(t.nbytes for st in part.opt.state.values() for t in st.values()
                            if torch.is_tensor(t) and t.dim() > 0)
                where = s["offload"] if s["offload"] else msb   # offload: they live on the host shards
                where["optimizer_states"] += extra
                where["total"] += extra
        s["atomic"]["tensors_owned"] = sum(len(p.owned) for p in self.parts)
        s["atomic"]["tensor_updates"] = self._tensor_updates
        if self._units is not None:
            s["unit_fetches"] = self._units.schedule.fetches
            s["out_of_order_fetches"] = self._units.schedule.out_of_order
        return s

    def whole_states(self) -> dict:
        """engine parameter index -> a CPU copy of the state of each whole tensor this rank owns."""
        return owned_states(self.parts)

    # what the rest of the package reads
    engine = property(lambda self: self._engine, doc="the C++ engine (zero_ext._C.Engine)")
    config = property(lambda self: self._config, doc="the ZeroConfig zeroify resolved")
    guard = property(lambda self: self._guard, doc="the model's ModelGuard (changes.py), or None")
    engine_params = property(lambda self: self._params, doc="engine parameter i (the model's trainable ones)")
    step_control = property(lambda self: self._ctl, doc="Note [Step control]'s StepControl, or None")

    def __del__(self):
        if self.serving is not None:
            alone.teardown(self)   # Note [Model's end]

    _engine = None         # (Optimizer.__init__ calls add_param_group)
    serving = None         # zeroify: this model at its shard server (alone/serving.py ServedModel), or None
    managed_by_zero_ext = True   # the step guard lets it through (Note [Adopted optimizers])

    def describe_plan(self) -> str:
        return self._engine.describe_plan()


def _shared(name: str) -> property:
    return property(lambda self: getattr(self._core, name), doc=f"The shared ZeroOptimizer's {name}.")


class ZeroOptimizerPart(torch.optim.Optimizer):
    """One of several torch optimizers given to zeroify() together: its own live param_groups
    and step(); the rest is the shared ZeroOptimizer's (one global norm over every part)."""

    managed_by_zero_ext = True   # the step guard lets it through (Note [Adopted optimizers])

    def __init__(self, core, optimizer: torch.optim.Optimizer, index: int):
        self._core = None
        torch.optim.Optimizer.__init__(self, [dict(g) for g in optimizer.param_groups], dict(optimizer.defaults))
        self.param_groups = optimizer.param_groups
        self._core = core
        self._index = index
        self.wrapped_class = type(optimizer)

    def add_param_group(self, param_group: dict) -> None:
        if self._core is None:                           # Optimizer.__init__ adds the groups
            return super().add_param_group(param_group)
        return self._core.add_param_group(param_group)   # raises, naming the fix

    @torch.no_grad()
    def step(self, closure=None):
        out = self._core._step_parts([self._index], closure)
        if self._core.serving is not None:   # Note [Shard server]
            self._core.serving.step_done()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """This optimizer's gradients only (the other parts may still step with theirs)."""
        self._core.engine.zero_grad(set_to_none, self._core.parts[self._index].groups)

    # the shared ZeroOptimizer's (_step_supports_amp_scaling: Note [GradScaler on sharded gradients])
    clip_grad_norm_, sharded_state_dict, stats, synchronize, _step_supports_amp_scaling = map(_shared, (
        "clip_grad_norm_", "sharded_state_dict", "stats", "synchronize", "_step_supports_amp_scaling"))

    def state_dict(self) -> dict:
        """The plain torch optimizer's state dict, on every rank (collective; Note [Complete
        optimizer state] in zero_ext/optim_state.py)."""
        return optim_state.state_dict(self._core, self._index)

    def load_state_dict(self, state_dict: dict) -> None:
        """This optimizer's complete state, or the shared sharded_state_dict()."""
        if isinstance(state_dict, dict) and "zero_ext" in state_dict:
            return self._core.load_state_dict(state_dict)
        optim_state.load_state_dict(self._core, state_dict, self._index)

    @property
    def zero_optimizer(self):
        """The ZeroOptimizer shared by every part."""
        return self._core
