"""ZeroOptimizer: the torch.optim.Optimizer that zeroify() returns.

It keeps the user's param_groups live (LR schedulers work) and drives the C++
engine: fused C kernels for Adam/AdamW/SGD, the user's own torch optimizer
class run over 1-D views of this rank's shard for any other elementwise one, or
(Muon, Adafactor: optimizers that need whole tensors) the user's torch optimizer
run by each tensor's owner over its whole tensors (zero_ext/whole.py). Several
torch optimizers given together (Muon + AdamW) are parts of one ZeroOptimizer.
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
from .comm import Comm
from ._C import PHASE_CLIP, PHASE_STEP
from .step_control import StepControl
from .whole import build_whole_optimizer, owned_states

# Optimizers whose update is elementwise: they may run over a flat shard.
FUSED = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
ELEMENTWISE = FUSED + tuple(getattr(torch.optim, n) for n in (
    "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop") if hasattr(torch.optim, n))

STATE_FORMAT = 1


class Part:
    """One wrapped torch optimizer: its class, its param groups (indices into the
    ZeroOptimizer's param_groups) and how it runs: 'fused' (C kernels over the
    shard), 'shard' (the torch optimizer over 1-D shard views) or 'whole' (the torch
    optimizer over this rank's whole tensors)."""

    def __init__(self, cls, groups: list, kind: str):
        self.cls, self.groups, self.kind = cls, groups, kind
        self.opt = None               # the inner torch optimizer ('shard', 'whole'), if this rank has any
        self.inner_ids: list = []     # inner param group k = param_groups[inner_ids[k]]
        self.owned: list = []         # 'whole': (engine param index, master view) in inner order
        self.adam = issubclass(cls, (torch.optim.Adam, torch.optim.AdamW))   # 'fused': Adam(W), else SGD
        self.adamw = issubclass(cls, torch.optim.AdamW)   # decoupled_weight_decay's default


class ZeroOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose state is sharded across ranks (see zeroify)."""

    def __init__(self, optimizer, engine, config, fused: bool, fingerprint: int,
                 comm=None, parts: list | None = None, param_groups_of: list | None = None, *,
                 params: list = (), param_shapes: list = (), units=None, frozen_bytes: int = 0, guard=None):
        """params[i]: engine parameter i, param_shapes[i] its logical shape (stage 3 empties
        the tensor); units: the model's stage-3 unit hooks (fetch counters); frozen_bytes:
        what this rank holds of frozen parameters; guard: the model's ModelGuard (changes.py)."""
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        groups = [g for o in optimizers for g in o.param_groups]
        # copies: torch's __init__ would set the first optimizer's defaults into every group (Muon's
        # momentum into AdamW's) and its own into the defaults; the groups are the user's, set below
        torch.optim.Optimizer.__init__(self, [dict(g) for g in groups], dict(optimizers[0].defaults))
        # the user's own dicts: live (one optimizer: its very list)
        self.param_groups = optimizers[0].param_groups if len(optimizers) == 1 else groups
        self.state = defaultdict(dict)                  # per-parameter state lives in the engine
        self.wrapped_class = type(optimizers[0])
        self.wrapped_classes = [type(o) for o in optimizers]
        if parts is None:
            parts = [Part(type(optimizers[0]), list(range(len(groups))), "fused" if fused else "shard")]
        self._parts = parts
        self._param_group_of = param_groups_of or []    # engine parameter i -> its param group
        self._done: set | None = None                   # parts stepped in the open iteration
        self._iter_scale = 1.0
        self._iter_skip = False
        self._tensor_updates = 0                        # whole tensors this rank updated
        self._engine = engine
        self._config = config
        self._params = list(params)
        self._param_shapes = list(param_shapes)
        self._units = units
        self._frozen_bytes = frozen_bytes
        self._guard = guard
        self._fused = fused
        self._fingerprint = fingerprint
        self._comm = comm if comm is not None else Comm(None, torch.device("cpu"))   # Note [One communication layer]
        self._host_steps = [0] * len(self.param_groups)  # optimizer steps taken, per group
        self._clip_coef = 1.0                           # folded into the next step (while the gradients last)
        self._shard_opt = None
        self._shard_group_ids: list[int] = []
        self._found_inf = None                          # this step's inf/nan verdict, once known
        self.loss_scaler = self._make_scaler(config)
        self._host_skipped = 0
        for part in self._parts:
            if part.kind == "shard":
                self._build_shard_optimizer(part)
            elif part.kind == "whole":
                build_whole_optimizer(part, engine.owned_tensors(part.groups), self._param_group_of, self._hyper)
        if config.master_remainder_applies(len(self._parts) == 1 and self._parts[0].kind == "fused"):
            engine.enable_split_master()   # Note [Split master in the engine] (csrc/engine/master_split.h)
        self._ctl = self._make_step_control(config)

    # ------------------------------------------------------------------ loss scaling
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
        """Note [Step control] (csrc/core/zx_step_control.h; zero_ext/step_control.py): the fused step's scalars in
        the parameters' memory; "auto" turns it on for CUDA parameters."""
        if config.step_in_backward:   # Note [Step in backward]: the steps run inside backward
            return None
        device = self._engine.shard_device   # where the master and states are stepped
        want = config.step_control
        fused_only = len(self._parts) == 1 and self._parts[0].kind == "fused"
        if want is True and not fused_only:
            raise ValueError("zero_ext: step_control=True needs one fused optimizer (Adam, AdamW or SGD); "
                             "pass step_control='auto' (or False) with "
                             + ", ".join(c.__name__ for c in self.wrapped_classes))
        if not fused_only or want is False or (want == "auto" and device.type != "cuda"):
            return None
        return StepControl(self._engine, len(self.param_groups), self.loss_scaler, device)

    @property
    def _clip_coef(self) -> float:
        """The clip factor pending for the next step. It belongs to the gradients it was
        computed from: once they change (zero_grad, a new backward) it is 1 again, as after
        a step GradScaler skipped (Note [GradScaler on sharded gradients] in zero_ext/amp.py)."""
        return self._clip_value if self._clip_at == self._engine.grad_generation else 1.0

    @_clip_coef.setter
    def _clip_coef(self, coef: float) -> None:
        self._clip_value, self._clip_at = float(coef), self._engine.grad_generation

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """What torch's GradScaler.step reads first: False (it unscales p.grad, which answers
        it in stages 1-3), or a ZeroUsageError naming the options a GradScaler cannot drive
        (Note [GradScaler on sharded gradients] in zero_ext/amp.py)."""
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
        """loss times the current loss scale (loss itself without loss scaling);
        call .backward() on the result. Under step control the scale is a device
        tensor: nothing is read back."""
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
        """grad_scale() times the clip factor pending for the next step: what makes the
        shard gradients DDP's p.grad after clipping (the next step's multiplier)."""
        return self._clip_coef * self.grad_scale()

    # ------------------------------------------------------------------ step
    def _build_shard_optimizer(self, part: Part) -> None:
        eng, groups = self._engine, part.groups
        shards, grads, gids = eng.param_shards(groups), eng.grad_shards(groups), eng.bucket_groups(groups)
        by_group: dict[int, list] = {}
        for s, g, gi in zip(shards, grads, gids):
            s.grad = g
            by_group.setdefault(gi, []).append(s)
        part.inner_ids = sorted(by_group)
        groups = [dict(self._hyper(gi), params=by_group[gi]) for gi in part.inner_ids]
        part.opt = part.cls(groups) if groups else None
        self._shard_opt, self._shard_group_ids = part.opt, part.inner_ids   # (zero_ext/checkpoint/ reads these)

    def add_param_group(self, param_group: dict) -> None:
        if self._engine is None:                         # Optimizer.__init__ adds the groups
            return super().add_param_group(param_group)
        raise ZeroUsageError("zero_ext: add_param_group after zeroify() is not supported: the bucket layout of "
                             "the parameters is fixed when zeroify() runs; " + ADD_GROUP_FIX)

    def _hyper(self, gi: int) -> dict:
        return {k: v for k, v in self.param_groups[gi].items() if k != "params"}

    # Note [Step hooks]
    #   torch.optim.Optimizer.__init__ wraps a subclass's step() in profile_hook_step: a
    #   record_function, and the global and per-optimizer step pre/post hooks. The
    #   record_function alone costs about as much as the rest of our glue (~38 of ~85 us,
    #   benchmarks/bench_step_glue.py), even with no profiler running. So step is marked
    #   hooked (torch leaves it alone) and dispatches itself: where a hook is registered
    #   or a profiler is on, torch's own wrapper runs (_hooked_step); otherwise the step
    #   runs directly. Hooks and the profiler's range stay torch's
    #   (tests/test_after_zeroify.py). For the same reason _step turns gradients off
    #   itself: the torch.no_grad() decorator costs ~15 us a call.
    def step(self, closure=None):
        if (_optim_module._global_optimizer_pre_hooks or _optim_module._global_optimizer_post_hooks
                or self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks
                or torch._C._autograd._profiler_enabled()):
            return self._hooked_step(closure)
        out = self._step(closure)   # (no_grad itself)
        self._optimizer_step_code()
        return out

    step.hooked = True

    def _step(self, closure=None):
        # no_grad without torch.no_grad()'s decorator, which costs more than the rest of the
        # Python glue together (Note [Step hooks])
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            if self._config.step_in_backward:
                out = self._step_published(closure)
            elif self._ctl is not None:
                out = self._step_controlled(closure)
            else:
                out = self._step_parts(range(len(self._parts)), closure)
        finally:
            torch._C._set_grad_enabled(grad)
        if self.serving is not None:   # Note [Shard server]: what it serves is as of this step now
            self.serving.step_done()
        return out

    _hooked_step = torch.optim.Optimizer.profile_hook_step(_step)   # Note [Step hooks]

    def arm_backward_step(self) -> None:
        """Note [Step in backward] (csrc/engine/backward_step.cpp): the step each bucket of
        this backward takes as its gradient lands, with the param groups as they are now."""
        part = self._parts[0]
        scale = 1.0 / self._engine.grad_divisor()
        if part.adam:   # Note [Hyperparameters] (csrc/kernels_binding.h)
            self._engine.set_backward_step_adam(self.param_groups, part.groups, scale, part.adamw)
        else:
            self._engine.set_backward_step_sgd(self.param_groups, part.groups, scale)

    def _step_published(self, closure):
        """step_in_backward: the buckets stepped in backward; publish the parameters."""
        loss = self._begin_step_call(closure)
        self._host_steps = [self._engine.backward_steps] * len(self.param_groups)
        self._publish()
        return loss

    def _publish(self) -> None:
        self._engine.all_gather_params()
        if not self._config.overlap_param_gather:
            self._engine.wait_params()

    def _no_whole_gradient(self, what: str) -> None:
        if self._config.step_in_backward:
            raise ZeroUsageError(f"zero_ext: {what} needs the whole gradient before the step, but with "
                                 f"step_in_backward=True each bucket steps as its gradient lands in backward; "
                                 f"remove the call, or pass step_in_backward=False to zeroify()")

    def _begin_step_call(self, closure):
        """What every step() call does first: the closure, the phase mark of the
        sequence check, the check for edits made outside gathered_parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine.sequence_mark(PHASE_STEP)
        if self._guard is not None:
            self._guard.check_edits()   # Note [Edits outside gathered_parameters] (changes.py)
        return loss

    def _step_controlled(self, closure):
        """Note [Step control]: one fused part; the verdict, the multiplier, the loss
        scale and the step counts are advanced in the parameters' memory."""
        loss = self._begin_step_call(closure)
        self._ctl.before_step()
        self._fused_step(1.0, self._parts[0], control=True)
        self._publish()
        return loss

    def _begin_iteration(self) -> None:
        """The first step() after a backward: one clipping factor and one inf/nan
        verdict for every part of this iteration."""
        self._done = set()
        self._iter_scale = self.grad_multiplier()
        self._clip_coef = 1.0
        self._iter_skip = False
        if self.loss_scaler is not None:
            # One all-reduce decides for every rank (shared with the norm when
            # clip_grad_norm_ ran): an inf/nan anywhere skips the step everywhere.
            found = self._found_inf
            if found is None:
                found = self._engine.grad_sumsq(1.0)[1] > 0
            self._found_inf = None
            if self.loss_scaler.update(bool(found)):
                self._host_skipped += 1
                self._iter_skip = True
        if not self._iter_skip:
            # Note [Unused parameters] (csrc/engine/unused.cpp): the ranks agree which
            # parameters got a gradient on some rank (the others are skipped), or, once
            # find_unused_parameters says they need not, each rank checks it had them all.
            # Several optimizers: each advances its parameters' step counts when it steps.
            if self._engine.world_size > 1 and not self._engine.agrees_unused and self._engine.grads_since_step:
                self._refuse_missing_grads(self._engine.locally_unused())
            self._engine.begin_step(len(self._parts) == 1)

    def _refuse_missing_grads(self, missing: list) -> None:
        if not missing:
            return
        # every rank that missed them meets here; a rank that alone skipped its backward
        # waits here and is named on every rank (Note [Unused parameters])
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
                self._step_part(self._parts[k], self._iter_scale)
        self._done.update(which)
        if len(self._done) == len(self._parts):
            self._done = None
        if not self._iter_skip and not self._config.overlap_param_gather:
            self._engine.wait_params()
        return loss

    def _step_part(self, part: Part, scale: float) -> None:
        for gi in part.groups:
            self._host_steps[gi] += 1
        # Note [Groups as an argument] (csrc/engine/groups.h): the engine calls for this
        # optimizer cover its groups; one wrapped optimizer covers every group (no list)
        one = len(self._parts) == 1
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
        """The torch optimizer over this rank's whole tensors. As torch skips a
        parameter whose .grad is None (Note [Unused parameters]: no rank gave it a
        gradient), those tensors' gradients are hidden for the step: no weight decay,
        no momentum or step-count update for them."""
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
        """Generic path: the shard optimizer's tensor of each bucket of these groups (all:
        none given), in param_shards() order (Note [Fragment views]: a fragment's `bucket`
        indexes this list)."""
        inner = {gi: list(g["params"]) for gi, g in zip(self._shard_group_ids, self._shard_opt.param_groups)}
        return [inner[gi].pop(0) for gi in self._engine.bucket_groups(groups)]

    @contextlib.contextmanager
    def _keep_unstepped(self, groups):
        """Generic path: the shard optimizer steps whole bucket views, so the
        elements of parameters that no rank gave a gradient (Note [Unused
        parameters]) are saved before the step and put back after it: their values
        and per-element states stay untouched. (Their step count is the bucket
        view's, unlike torch's per-parameter one.)"""
        stepped = self._engine.stepped_params()
        if all(stepped):
            yield
            return
        views = self.bucket_views(groups)
        saved = []
        for f in self._engine.fragment_views(masters=False, groups=groups):   # positions only (no master joined)
            if stepped[f.param] or f.numel == 0:
                continue
            v, lo, n = views[f.bucket], f.slice_offset, f.numel
            st = self._shard_opt.state.get(v, {})
            per_elem = {k: t[lo:lo + n].clone() for k, t in st.items() if torch.is_tensor(t) and t.shape == v.shape}
            saved.append((v, lo, n, v[lo:lo + n].clone(), per_elem))
        yield
        for v, lo, n, vals, per_elem in saved:
            v[lo:lo + n].copy_(vals)
            st = self._shard_opt.state.get(v, {})
            for k, t in st.items():
                if not (torch.is_tensor(t) and t.shape == v.shape):
                    continue
                if k in per_elem:
                    t[lo:lo + n].copy_(per_elem[k])
                else:                    # created by this step: the state it starts from
                    t[lo:lo + n].zero_()

    def _fused_step(self, scale: float, part: Part, control: bool = False) -> None:
        """control: the multiplier, the skip verdict and the step counts come from the
        step control's device memory (scale and the host step counts are not used).
        The engine reads the param groups themselves (Note [Hyperparameters] in
        csrc/kernels_binding.h)."""
        steps = [1] * len(self.param_groups) if control else self._host_steps
        ctl = dict(ctl=self._ctl.ctl, ctl_steps=self._ctl.steps) if control else {}
        if part.adam:
            self._engine.step_adam(self.param_groups, part.groups, steps, scale, part.adamw, **ctl)
        else:
            self._engine.step_sgd(self.param_groups, part.groups, steps, scale, **ctl)

    def synchronize(self) -> None:
        """Wait for every outstanding collective (reductions, the parameter gather);
        only needed with overlap_param_gather=True before reading parameters directly."""
        self._engine.wait_reductions()
        self._engine.flush_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad(set_to_none)

    def _zero_grad_part(self, k: int, set_to_none: bool) -> None:
        self._engine.zero_grad(set_to_none, self._parts[k].groups)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm, as torch.nn.utils.clip_grad_norm_ would on the
        full averaged gradients; returns the total norm (before clipping). The clipping
        factor is folded into the next step() rather than applied in a separate pass."""
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
                total = self._comm.all_reduce([total], op=dist.ReduceOp.MAX)[0]
            nonfinite = 0 if math.isfinite(total) else 1
        else:
            raise ValueError(f"zero_ext: clip_grad_norm_ supports norm_type 2.0 and inf, got {norm_type}; pass "
                             f"norm_type=2.0 (the default) or float('inf')")
        self._found_inf = nonfinite > 0
        self.clip_by_total_norm_(max_norm, total)
        return torch.tensor(total)

    def clip_by_total_norm_(self, max_norm: float, total_norm: float) -> None:
        """Scale the gradients by max_norm / (total_norm + 1e-6) when below 1, as torch's
        clip_grads_with_norm_ (folded into the next step)."""
        self._no_whole_gradient("clip_by_total_norm_")
        coef = float(max_norm) / (float(total_norm) + 1e-6)
        if self._ctl is not None:
            self._ctl.clip_by(coef, not math.isfinite(float(total_norm)))
        elif coef < 1.0:
            self._clip_coef *= coef

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every averaged gradient element to [-clip_value, clip_value], as
        torch.nn.utils.clip_grad_value_ on DDP's gradients: the reduced gradient shards,
        in place (their values times the averaging and loss-scale factor are the gradients)."""
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
                if g.numel():
                    g.clamp_(-bound, bound)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The wrapped torch optimizer's complete state in torch's format, as DDP's optimizer
        gives it (Note [Complete optimizer state] in zero_ext/optim_state.py): every rank
        calls it, or one alone, served by the others. load_state_dict() takes it at any world
        size and stage; zero_ext.save / load checkpoint without assembling it anywhere."""
        return optim_state.state_dict(self)

    def sharded_state_dict(self) -> dict:
        """This rank's sharded state (no collective); load_state_dict() takes it back at the
        same stage, world size and rank only."""
        self._engine.wait_reductions()
        groups = []
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(len(g["params"])))
            groups.append(d)
        return {
            "state": {},
            "param_groups": groups,
            "zero_ext": {
                "format": STATE_FORMAT,
                "stage": self._config.stage,
                "world_size": self._engine.world_size,
                "rank": self._engine.rank,
                "fingerprint": self._fingerprint,
                "optimizer": self.wrapped_class.__name__,
                "steps": list(self.group_steps),
                "param_steps": self.param_step_counts(),
                "flat_state": {k: v.clone() for k, v in self._engine.states().items()},
                "shard_optimizer": self._shard_opt.state_dict() if self._shard_opt is not None else None,
                # whole-tensor parts: the torch optimizer over this rank's own tensors
                "whole_optimizers": [p.opt.state_dict() if p.opt is not None else None
                                     for p in self._parts if p.kind == "whole"],
                "loss_scaler": self.scaler_state_dict(),
                "skipped_steps": self.skipped_steps,
            },
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """A complete state dict (state_dict() here, or a plain torch or DDP optimizer's),
        each rank taking its shard, at any world size and stage (no collective); or this
        rank's own sharded_state_dict()."""
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
        if "param_steps" in z:
            self._engine.set_param_steps(list(z["param_steps"]))
        else:                                   # saved before per-parameter step counts
            self._engine.set_param_steps(self._group_steps_per_param())
        if self._shard_opt is not None and z["shard_optimizer"] is not None:
            self._shard_opt.load_state_dict(z["shard_optimizer"])
        for part, saved in zip([p for p in self._parts if p.kind == "whole"], z.get("whole_optimizers", [])):
            if part.opt is not None and saved is not None:
                part.opt.load_state_dict(saved)
        self.load_scaler_state_dict(z.get("loss_scaler"))
        self.skipped_steps = int(z.get("skipped_steps", 0))

    def _group_steps_per_param(self) -> list[int]:
        steps = self.group_steps
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        return [steps[group_of[id(p)]] for p in self._params]

    def param_step_counts(self) -> list[int]:
        """Optimizer steps each trainable parameter took (Note [Unused parameters]).
        Under step control (Note [Step control]) the counts live on the device per
        group, and every parameter of a group is stepped: its group's count."""
        if self._ctl is not None:
            self._engine.set_param_steps(self._group_steps_per_param())
        return list(self._engine.param_steps())

    def scaler_state_dict(self) -> dict | None:
        """The loss scaler's state (None without loss scaling)."""
        if self.loss_scaler is None:
            return None
        if self._ctl is not None:
            return self._ctl.host_scaler(self.loss_scaler).state_dict()
        return self.loss_scaler.state_dict()

    def load_scaler_state_dict(self, d: dict | None) -> None:
        if d is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(d)
            if self._ctl is not None:
                self._ctl.load_scaler(self.loss_scaler)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """A dict describing this rank (see README "stats()")."""
        s = self._engine.stats()
        s["optimizer"] = self.wrapped_class.__name__
        s["fused"] = self._fused
        s["loss_scale"] = self.loss_scale if self.loss_scaler is not None else None
        s["skipped_steps"] = self.skipped_steps
        s["steps"] = max(self.group_steps) if self.group_steps else 0
        comm = s["comm"]
        # Ring-cost equivalent: an all-reduce moves as much as reduce-scatter + all-gather.
        s["comm_bytes"] = (comm["reduce_scatter"]["bytes"] + comm["all_gather"]["bytes"]
                           + 2 * comm["all_reduce"]["bytes"])
        s["frozen_parameter_bytes"] = self._frozen_bytes
        msb = s["model_state_bytes"]
        for part in self._parts:          # torch optimizers' states over shard views / whole tensors
            if part.opt is not None:
                extra = sum(t.nbytes for st in part.opt.state.values() for t in st.values()
                            if torch.is_tensor(t) and t.dim() > 0)
                where = s["offload"] if s["offload"] else msb   # offload: they live on the host shards
                where["optimizer_states"] += extra
                where["total"] += extra
        if len(self._parts) > 1:
            s["optimizer"] = "+".join(c.__name__ for c in self.wrapped_classes)
        s["atomic"]["tensors_owned"] = sum(len(p.owned) for p in self._parts)
        s["atomic"]["tensor_updates"] = self._tensor_updates
        if self._units is not None:
            s["unit_fetches"] = self._units.schedule.fetches
            s["out_of_order_fetches"] = self._units.schedule.out_of_order
        return s

    def whole_states(self) -> dict:
        """engine parameter index -> a CPU copy of the state of each whole tensor this rank owns."""
        return owned_states(self._parts)

    # What the rest of the package reads (zero_ext/checkpoint/, zero_ext/alone/, ...), read-only.
    engine = property(lambda self: self._engine, doc="the C++ engine (zero_ext._C.Engine)")
    comm = property(lambda self: self._comm, doc="the Python-side collectives (zero_ext/comm.py)")
    config = property(lambda self: self._config, doc="the ZeroConfig zeroify resolved")
    guard = property(lambda self: self._guard, doc="the model's ModelGuard (changes.py), or None")
    parts = property(lambda self: self._parts, doc="the wrapped torch optimizers (Part), in the order given")
    engine_params = property(lambda self: self._params, doc="engine parameter i (the model's trainable ones)")
    param_shapes = property(lambda self: self._param_shapes, doc="engine parameter i's logical shape")
    param_group_of = property(lambda self: self._param_group_of, doc="engine parameter i's param group")
    step_control = property(lambda self: self._ctl, doc="Note [Step control]'s StepControl, or None")
    shard_optimizer = property(lambda self: self._shard_opt,
                               doc="the torch optimizer over 1-D shard views (a 'shard' part), or None")

    def __del__(self):
        # Note [Model's end]: the other ranks may still read this rank's shard
        if self.serving is not None:
            alone.teardown(self)

    _engine = None
    serving = None         # zeroify: this model at its shard server (alone/serving.py ServedModel), or None
    managed_by_zero_ext = True   # the step guard lets it through (Note [Adopted optimizers])
    _guard = None          # the model's ModelGuard (changes.py)
    _frozen_bytes = 0
    _units = None          # stage 3: the model's unit hooks (fetch counters)

    def describe_plan(self) -> str:
        return self._engine.describe_plan()


class ZeroOptimizerPart(torch.optim.Optimizer):
    """One of several torch optimizers given to zeroify() together: its own
    param_groups (the user's dicts, live for LR schedulers), step() over its own
    groups; zero_grad, clip_grad_norm_ (one global norm over every part), stats()
    and the state dicts are the shared ZeroOptimizer's."""

    managed_by_zero_ext = True   # the step guard lets it through (Note [Adopted optimizers])

    def __init__(self, core, optimizer: torch.optim.Optimizer, index: int):
        self._core = None
        # copies, as ZeroOptimizer's: the user's groups and defaults stay as they were
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
        """This optimizer's gradients only, as torch's zero_grad (the other parts'
        optimizers may still step with theirs)."""
        self._core._zero_grad_part(self._index, set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self._core.clip_grad_norm_(max_norm, norm_type)

    @property
    def _step_supports_amp_scaling(self) -> bool:   # Note [GradScaler on sharded gradients] (zero_ext/amp.py)
        return self._core._step_supports_amp_scaling

    def state_dict(self) -> dict:
        """This optimizer's complete state in torch's format, on every rank (collective;
        Note [Complete optimizer state] in zero_ext/optim_state.py): the state dict the
        plain torch optimizer would hold."""
        return optim_state.state_dict(self._core, self._index)

    def load_state_dict(self, state_dict: dict) -> None:
        """This optimizer's complete state (state_dict() or a plain torch optimizer's), or
        the shared ZeroOptimizer's sharded_state_dict()."""
        if isinstance(state_dict, dict) and "zero_ext" in state_dict:
            return self._core.load_state_dict(state_dict)
        optim_state.load_state_dict(self._core, state_dict, self._index)

    def sharded_state_dict(self) -> dict:
        """This rank's state of every part (the shared ZeroOptimizer's sharded_state_dict)."""
        return self._core.sharded_state_dict()

    def stats(self) -> dict:
        return self._core.stats()

    def synchronize(self) -> None:
        self._core.synchronize()

    @property
    def zero_optimizer(self):
        """The ZeroOptimizer shared by every part (for checkpoints: save/load take it or a part)."""
        return self._core
