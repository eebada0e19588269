"""ZeroConfig: every option of zeroify(), from keywords, a dict (from_dict) or a JSON file
(from_json), validated before any collective."""
from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any

_DTYPES = ("fp32", "bf16", "fp16")
_DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16",
                  "fp16": "fp16", "float16": "fp16", "half": "fp16"}


def dtype_name(v: Any) -> Any:
    """'fp32' / 'bf16' / 'fp16' for a torch dtype or any usual spelling; v unchanged otherwise."""
    if not isinstance(v, str) and hasattr(v, "is_floating_point"):   # a torch.dtype
        v = str(v).replace("torch.", "")
    return _DTYPE_ALIASES.get(v, v) if isinstance(v, str) else v


def read_json(path: str, what: str, instead: str, shape: str, invalid=ValueError):
    """The JSON object in file `path`, or an error naming it as `what`, with the fixes."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"zero_ext: {what} {path!r} does not exist; pass the path of {instead}") from None
    except json.JSONDecodeError as e:
        raise invalid(f"zero_ext: {what} {path!r} is not valid JSON: {e}; fix the file ({shape})") from None


@dataclasses.dataclass
class ZeroConfig:
    """Options of zeroify(); docs/guide/options.md is generated from this table.

    stage: 0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters, gathered per
        unit), or "auto": the stage whose estimate_memory fits memory_budget with the least traffic.
    memory_budget: stage="auto": bytes a rank may hold; None = free memory, the smallest over ranks.
    accumulation_steps: stage="auto": micro-steps per step (they multiply stages 2-3's traffic).
    process_group: the group to shard over; None = the default group, else one process.
    bucket_bytes: bucket size; "auto" = an eighth of the trainable bytes, in [1 MiB, 16 MiB].
    first_bucket_bytes: size of the first bucket (small, so communication starts early).
    align: slice alignment in elements (a bucket pads to world_size * align); "auto" = 16 up to
        64 ranks, else 1. Pieces stay 16-byte aligned (Note [Aligned pieces] in csrc/core/zx_core.h).
    reduce_scatter: "auto" (all-to-all + local sum on gloo, else native), "native" or "alltoall".
    grad_ring_buckets: stage 2: bucket-sized staging buffers in the gradient ring.
    overlap_param_gather: stages 1-2: the post-step all-gather runs until the next forward.
    broadcast_buffers: broadcast module buffers from rank 0 before every forward (as DDP).
    verify_across_ranks: check once that all ranks wrap the same parameters and config.
    fused: "auto" (C kernels for Adam/AdamW/SGD), "never" (torch's on the shard) or "always" (raise if none).
    isa: CPU kernel instruction set: "auto" (best available), "scalar", "avx2", "avx512".
    log_plan: print the bucket plan on rank 0.
    unit_modules: stage 3: class names whose instances form units (["Block"]); None = by
        parameter count. Units must be called modules (name a ModuleList's elements).
    unit_numel: stage 3, automatic units: most trainable elements per unit (None = a quarter).
    min_unit_numel: stage 3: smaller units join the root unit, gathered all forward and backward.
    prefetch_depth: stage 3: units all-gathered ahead of the one computing.
    compile_units: stage 3 under torch.compile: "per_unit" (graph breaks at units) or "whole" (one
        graph, stage 2's parameter memory: Note [Stage 3 compiled whole] in zero_ext/compiled.py).
    coalesce_numel: stage 3: small units share one gather up to this many elements; 0 = off.
    param_dtype: what parameters compute and gather in: "fp32", "bf16", "fp16" (or a torch
        dtype). Give the model in fp32; fp32 masters and states live only in the shard.
    step_control: where the fused step keeps its scalars (norm, inf/nan, loss scale, steps):
        True = device memory (no host sync), False = host; "auto" = True for CUDA and fused.
    cast_buffers: with a low param_dtype, which float buffers are cast: "auto" = only norm
        layers' running stats (RoPE's inv_freq keeps fp32); True all; False none.
    reduce_dtype: what gradients accumulate and reduce in; "bf16"/"fp16" halve the bytes.
    loss_scale: "auto" (dynamic with fp16, else none), "dynamic", None, or a static number.
        With a scale call opt.backward(loss); an inf/nan gradient on any rank skips the step.
    initial_loss_scale, loss_scale_growth_factor, loss_scale_backoff_factor,
    loss_scale_growth_interval, loss_scale_hysteresis, min_loss_scale, max_loss_scale:
        dynamic scaling: start at initial_loss_scale; times growth_factor (up to max) after
        growth_interval clean steps, times backoff_factor (down to min) after `hysteresis`
        overflowing steps in a row.
    grad_quant: None (exact), "int8" or "int4": stages 1-3 send gradients by all-to-all as
        blockwise codes (one fp32 scale per quant_block_numel); owners sum in fp32.
    grad_quant_error_feedback: with grad_quant, add what quantization lost to the next step.
    param_quant: None (exact) or "int8": stages 1-3 gather parameters as blockwise int8 codes;
        all ranks compute with the same values and the fp32 master stays exact.
    quant_block_numel: elements per quantization block (one fp32 scale); even, >= 2.
    node_size: None (off), an int L dividing N, or "auto" (LOCAL_WORLD_SIZE): stage 3 keeps 1/L of each
        unit per rank after forward (up to parameters / L), so backward gathers inside the node.
    offload: None or "cpu": stages 1-3 keep master, states and gradient shard in host memory
        and step there, the same bits (docs/guide/memory.md). Not with stage 0, grad_quant,
        param_quant or step_control=True.
    step_in_backward: stages 1-3, one fused Adam/AdamW/SGD: each bucket steps as its gradient
        lands, no gradient shard kept; opt.step() only publishes. Clipping raises; not with
        fp16 scaling, offload or step_control=True.
    state_dtype: "fp32" or "bf16": fused Adam/AdamW's exp_avg and exp_avg_sq, "bf16" rounded
        stochastically (4 bytes per parameter less). Not with amsgrad, SGD or fused="never".
    master_remainder: bf16 params, stages 0-2, one fused optimizer: keep the fp32 master as a
        16-bit remainder and a tie bit, the same bits (docs/guide/memory.md). False: fp32.
    check_sequence: True ("auto" alike): ranks whose collectives diverge raise, naming where, not hang
        (Note [Collective sequence check] in csrc/engine/sequence.h); "every_phase": each phase
        on gloo too. It serves a rank reading alone (Note [Reading alone] in csrc/engine/away.h).
    sequence_timeout: seconds a collective waits before ranks compare positions (check_sequence).
    find_unused_parameters: how ranks agree on parameters without a gradient (Note [Unused parameters]
        in csrc/engine/unused.cpp). True: an all-reduce each step (DDP's); False: none, a
        missing gradient raises; "auto": the all-reduce at step one, kept only if a rank missed one.
    """

    stage: int | str = 2
    process_group: Any = None
    bucket_bytes: int | str = "auto"
    first_bucket_bytes: int = 1 << 20
    align: int | str = "auto"
    reduce_scatter: str = "auto"
    grad_ring_buckets: int = 2
    overlap_param_gather: bool = False
    broadcast_buffers: bool = True
    verify_across_ranks: bool = True
    fused: str = "auto"
    isa: str = "auto"
    log_plan: bool = False
    unit_modules: list | None = None
    unit_numel: int | None = None
    min_unit_numel: int = 1024
    prefetch_depth: int = 1
    compile_units: str = "per_unit"
    coalesce_numel: int = 16384
    param_dtype: Any = "fp32"
    reduce_dtype: Any = "fp32"
    cast_buffers: bool | str = "auto"
    step_control: bool | str = "auto"
    loss_scale: Any = "auto"
    initial_loss_scale: float = 2.0 ** 16
    loss_scale_growth_factor: float = 2.0
    loss_scale_backoff_factor: float = 0.5
    loss_scale_growth_interval: int = 2000
    loss_scale_hysteresis: int = 1
    min_loss_scale: float = 1.0
    max_loss_scale: float = 2.0 ** 24
    memory_budget: int | float | None = None
    accumulation_steps: int = 1
    grad_quant: str | None = None
    grad_quant_error_feedback: bool = False
    param_quant: str | None = None
    quant_block_numel: int = 256
    node_size: int | str | None = None
    check_sequence: bool | str = True
    sequence_timeout: float = 3.0
    find_unused_parameters: bool | str = "auto"
    offload: str | None = None
    step_in_backward: bool = False
    state_dtype: Any = "fp32"
    master_remainder: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_dict(cls, d: dict) -> "ZeroConfig":
        if not isinstance(d, dict):
            raise TypeError(f"zero_ext: a config must be a dict, got {type(d).__name__}; pass a dict of "
                            f"ZeroConfig options, e.g. {{'stage': 2}}")
        check_keys(d)
        return cls(**d)

    @classmethod
    def from_json(cls, path: str) -> "ZeroConfig":
        return cls.from_dict(read_json(path, "config file", "a JSON file of ZeroConfig options, or the options "
                                       "as a dict", "one JSON object of ZeroConfig options"))

    def resolved_bucket_bytes(self, trainable_bytes: int) -> int:
        if self.bucket_bytes == "auto":
            return min(16 << 20, max(1 << 20, trainable_bytes // 8))
        return self.bucket_bytes

    def resolved_align(self, world_size: int) -> int:
        if self.align == "auto":
            return 16 if world_size <= 64 else 1
        return self.align

    def engine_fields(self, world_size: int, gloo: bool, trainable_bytes: int) -> dict:
        """The fields of the engine's options (_C.EngineOptions) that this config sets."""
        return dict(
            stage=self.stage, bucket_bytes=self.resolved_bucket_bytes(trainable_bytes),
            first_bucket_bytes=self.first_bucket_bytes, align=self.resolved_align(world_size),
            alltoall_reduce_scatter=self.reduce_scatter == "alltoall" or self.grad_quant is not None or (
                self.reduce_scatter == "auto" and gloo),
            grad_quant_bits={None: 0, "int8": 8, "int4": 4}[self.grad_quant],
            grad_quant_error_feedback=self.grad_quant_error_feedback, quant_block_numel=self.quant_block_numel,
            param_quant_bits={None: 0, "int8": 8}[self.param_quant],
            agree_unused={False: 0, True: 1, "auto": 2}[self.find_unused_parameters],
            grad_ring_buckets=self.grad_ring_buckets, isa=self.isa, param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype, offload=self.offload == "cpu", step_in_backward=self.step_in_backward,
            state_dtype=self.state_dtype,             # Note [bf16 optimizer states] (csrc/engine/stepper.cpp)
            coalesce_numel=self.coalesce_numel)       # Note [Coalesced gradient reductions] (csrc/engine/reducer.cpp)

    def master_remainder_applies(self, fused: bool) -> bool:
        """Note [Split master in the engine] (csrc/engine/master_split.h): whether the fp32
        master shard is kept as the bf16 parameters' remainder; fused: one optimizer, stepped
        by the C kernels."""
        return (self.master_remainder and fused and self.param_dtype == "bf16" and self.stage in (0, 1, 2)
                and self.param_quant is None and self.offload is None)

    def resolved_loss_scale(self):
        """None (no scaling), "dynamic", or a static number."""
        if self.loss_scale == "auto":
            return "dynamic" if self.param_dtype == "fp16" else None
        return self.loss_scale

    def to_dict(self) -> dict:
        d = {name: getattr(self, name) for name in _FIELDS if name != "process_group"}   # a group is not copied
        if d["unit_modules"] is not None:
            d["unit_modules"] = [c if isinstance(c, str) else c.__name__ for c in d["unit_modules"]]
        return d

    def validate(self) -> None:
        """Raise for the first bad option of _RULES, in their order; dtypes are normalized first."""
        for name in ("param_dtype", "reduce_dtype", "state_dtype"):
            setattr(self, name, dtype_name(getattr(self, name)))
        for name, skip, ok, message, error in _RULES:
            v = getattr(self, name)
            if v not in skip and not ok(v, self):
                raise error("zero_ext: " + message(v, self))


_FIELDS = tuple(f.name for f in dataclasses.fields(ZeroConfig))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ZeroConfig)}


def _fix(name: str) -> str:
    """The fix for a bad value of option `name`: its default (ZeroConfig's docstring has the rest)."""
    return f"pass a valid {name} or leave it out for its default, {name}={_DEFAULTS[name]!r}"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(name: str, lo: int, *skip) -> list:
    return [(name, skip, lambda v, c: _is_int(v),
             lambda v, c: f"{name} must be an int, got {type(v).__name__} ({v!r}); {_fix(name)}", TypeError),
            (name, skip, lambda v, c: v >= lo,
             lambda v, c: f"{name} must be >= {lo}, got {v}; {_fix(name)}", ValueError)]


def _number(name: str, ok, what: str) -> list:
    return [(name, (), lambda v, c: _is_number(v) and ok(v, c), lambda v, c: f"{name} must be {what}, got {v!r}; "
             f"{_fix(name)}", ValueError)]


def _choice(name: str, options: tuple, *skip) -> list:
    return [(name, skip, lambda v, c: v in options, lambda v, c: f"{name} must be one of "
             f"{', '.join(map(repr, options))}; got {v!r}; {_fix(name)}", ValueError)]


def _flag(name: str, *words: str) -> list:   # True, False, or one of the words
    return [(name, (), lambda v, c: isinstance(v, bool) or v in words, lambda v, c: f"{name} must be "
             f"{''.join(repr(w) + ', ' for w in words)}True or False, got {v!r}; {_fix(name)}", ValueError)]


def _bool(name: str) -> list:
    return [(name, (), lambda v, c: isinstance(v, bool),
             lambda v, c: f"{name} must be True or False, got {v!r}; {_fix(name)}", TypeError)]


def _rule(name: str, ok, message, *skip, error=ValueError) -> list:
    """ok(value, config) or raise error(message(value, config)), a message naming the fix."""
    return [(name, skip, ok, message if callable(message) else lambda v, c: message, error)]


_STAGE_FIX = "pass stage=0 (DDP), 1, 2 or 3 (the most memory saved), or stage='auto' to choose by memory"
# (option, values let through, ok(value, config), message(value, config), error), checked in this order
_RULES = (
    _rule("stage", lambda v, c: not isinstance(v, str),
          lambda v, c: f"stage must be 0, 1, 2 or 3 (or 'auto'), got {v!r}; {_STAGE_FIX}", "auto")
    + _rule("stage", lambda v, c: _is_int(v), lambda v, c: f"stage must be an int, got {type(v).__name__} "
            f"({v!r}); {_STAGE_FIX}", "auto", error=TypeError)
    + _rule("stage", lambda v, c: 0 <= v <= 3,
            lambda v, c: f"stage must be 0, 1, 2 or 3 (or 'auto'), got {v}; {_STAGE_FIX}", "auto")
    + _rule("memory_budget", lambda v, c: _is_number(v) and v > 0, lambda v, c: f"memory_budget must be a number "
            f"of bytes > 0 or None, got {v!r}; pass e.g. memory_budget=8 * 2**30 (8 GiB), or None for what is free",
            None)
    + _int("accumulation_steps", 1) + _int("bucket_bytes", 1024, "auto") + _int("first_bucket_bytes", 1024)
    + _int("align", 1, "auto") + _int("grad_ring_buckets", 1) + _int("min_unit_numel", 0)
    + _int("prefetch_depth", 0) + _int("coalesce_numel", 0) + _int("unit_numel", 1, None)
    + _rule("unit_modules", lambda v, c: isinstance(v, (list, tuple)) and all(isinstance(k, (str, type)) for k in v),
            lambda v, c: f"unit_modules must be a list of module class names (or classes), got {v!r}; pass e.g. "
            f"unit_modules=['Block'], or None to choose units by parameter count", None)
    + _rule("state_dtype", lambda v, c: v in ("fp32", "bf16"), lambda v, c: f"state_dtype must be 'fp32' or "
            f"'bf16' (the optimizer states' dtype), got {v!r}; pass state_dtype='fp32' (exact, the default) or "
            f"'bf16' (stochastically rounded, 4 bytes per parameter less)")
    + _rule("state_dtype", lambda v, c: c.fused != "never", "state_dtype='bf16' is a mode of the fused "
            "Adam/AdamW kernels, and fused='never' runs the torch optimizer (fp32 states); pass fused='auto' "
            "(or 'always'), or state_dtype='fp32'", "fp32")
    + _flag("master_remainder") + _flag("step_control", "auto") + _flag("cast_buffers", "auto")
    + _choice("param_dtype", _DTYPES) + _choice("reduce_dtype", _DTYPES)
    + _rule("loss_scale", lambda v, c: not isinstance(v, str) or v in ("auto", "dynamic"),
            lambda v, c: f"loss_scale must be one of 'auto', 'dynamic'; got {v!r}; {_fix('loss_scale')}")
    + _rule("loss_scale", lambda v, c: isinstance(v, str) or _is_number(v) and v > 0, lambda v, c: f"loss_scale "
            f"must be 'auto', 'dynamic', None or a positive number, got {v!r}; {_fix('loss_scale')}", None)
    + _number("initial_loss_scale", lambda v, c: v > 0, "> 0")
    + _number("loss_scale_growth_factor", lambda v, c: v > 1, "> 1")
    + _number("loss_scale_backoff_factor", lambda v, c: 0 < v < 1, "in (0, 1)")
    + _number("min_loss_scale", lambda v, c: v > 0, "> 0")
    + _number("max_loss_scale", lambda v, c: v >= c.min_loss_scale, ">= min_loss_scale")
    + _int("loss_scale_growth_interval", 1) + _int("loss_scale_hysteresis", 1)
    + _flag("check_sequence", "auto", "every_phase") + _flag("find_unused_parameters", "auto")
    + _number("sequence_timeout", lambda v, c: v > 0, "a number of seconds > 0")
    + _choice("reduce_scatter", ("auto", "native", "alltoall")) + _choice("compile_units", ("per_unit", "whole"))
    + _choice("fused", ("auto", "always", "never")) + _choice("isa", ("auto", "scalar", "avx2", "avx512"))
    + [row for b in ("overlap_param_gather", "broadcast_buffers", "verify_across_ranks", "log_plan",
                     "grad_quant_error_feedback") for row in _bool(b)]
    # communication quantization
    + _int("quant_block_numel", 2)
    + _rule("quant_block_numel", lambda v, c: v % 2 == 0, lambda v, c: f"quant_block_numel must be even (int4 "
            f"codes are packed two per byte), got {v}; {_fix('quant_block_numel')}")
    + _rule("grad_quant", lambda v, c: v in (None, "int8", "int4"), lambda v, c: f"grad_quant must be None, 'int8' "
            f"or 'int4' (the supported bit widths); got {v!r}; pass grad_quant='int8', 'int4' or None (exact)")
    + _rule("grad_quant", lambda v, c: c.stage != 0, lambda v, c: f"grad_quant={v!r} needs stage 1, 2 or 3 (stage "
            f"0 reduces with an all-reduce, which has no quantized form); use stage=1 or grad_quant=None", None)
    + _rule("grad_quant", lambda v, c: c.reduce_scatter != "native", lambda v, c: f"grad_quant={v!r} reduces by "
            f"all-to-all; reduce_scatter='native' contradicts it; pass reduce_scatter='auto' or 'alltoall', or "
            f"grad_quant=None", None)
    + _rule("grad_quant_error_feedback", lambda v, c: not v or c.grad_quant is not None, "grad_quant_error_feedback"
            "=True needs grad_quant='int8' or 'int4'; pass one of them, or grad_quant_error_feedback=False")
    + _rule("param_quant", lambda v, c: v in (None, "int8"), lambda v, c: f"param_quant must be None or 'int8' (the "
            f"supported bit width for parameter gathers); got {v!r}; pass param_quant='int8' or None (exact)")
    + _int("node_size", 1, None, "auto")
    + _rule("node_size", lambda v, c: c.stage == 3, lambda v, c: f"node_size={v!r} (hierarchical partitioning) is "
            f"for stage 3 (got stage={c.stage!r}); use stage=3 or node_size=None", None)
    + _rule("param_quant", lambda v, c: c.stage != 0, lambda v, c: f"param_quant={v!r} needs stage 1, 2 or 3 "
            f"(stage 0 keeps full replicas and gathers no parameters); use stage=1 or param_quant=None", None)
    # step_in_backward and offload
    + _flag("step_in_backward")
    + _rule("step_in_backward", lambda v, c: c.stage in (1, 2, 3), lambda v, c: f"step_in_backward=True needs "
            f"stage 1, 2 or 3 (got stage={c.stage!r}); use stage=1, 2 or 3, or step_in_backward=False", False)
    + _rule("step_in_backward", lambda v, c: c.offload is None,
            "step_in_backward=True with offload='cpu' is not supported; pass one of them", False)
    + _rule("step_in_backward", lambda v, c: c.resolved_loss_scale() is None, "step_in_backward=True steps before "
            "any rank could see an inf/nan gradient, so it cannot work with loss scaling (fp16); use "
            "param_dtype='bf16' (no loss scaling) or step_in_backward=False", False)
    + _rule("step_in_backward", lambda v, c: c.step_control is not True, "step_in_backward=True steps inside "
            "backward; pass step_control='auto' (or False) with it, or step_in_backward=False", False)
    + _rule("offload", lambda v, c: v in (None, "cpu"), lambda v, c: f"offload must be None or 'cpu', got {v!r}; "
            f"pass offload='cpu' (optimizer state in host memory) or offload=None")
    + _rule("offload", lambda v, c: c.stage in (1, 2, 3, "auto"), lambda v, c: f"offload={v!r} needs stage 1, 2 "
            f"or 3 (got stage={c.stage!r}; stage 0 shards nothing); use stage=2 or 3, or offload=None", None)
    + _rule("offload", lambda v, c: c.grad_quant is None and c.param_quant is None, lambda v, c: f"offload={v!r} "
            f"keeps exact gradients and parameters; pass grad_quant=None and param_quant=None, or offload=None", None)
    + _rule("offload", lambda v, c: c.step_control is not True, lambda v, c: f"offload={v!r} steps on the host, so "
            f"the step control cannot live in device memory; pass step_control='auto' (or False), or offload=None",
            None)
)


def check_keys(d: dict) -> None:
    """Raise for option names ZeroConfig does not know, suggesting the closest one."""
    for k in d:
        if k not in _FIELDS:
            close = difflib.get_close_matches(str(k), _FIELDS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"zero_ext: unknown config option {k!r}.{hint} Remove it or use one of the known "
                             f"options: {', '.join(_FIELDS)}")


def make_config(config: ZeroConfig | dict | str | None, stage: int | None, overrides: dict) -> ZeroConfig:
    """Merge a base config (object, dict or JSON path) with keyword overrides."""
    if config is None:
        base: dict = {}
    elif isinstance(config, ZeroConfig):
        base = {name: getattr(config, name) for name in _FIELDS}   # not asdict: it deep-copies the group
    elif isinstance(config, dict):
        check_keys(config)
        base = dict(config)
    elif isinstance(config, str):
        base = ZeroConfig.from_json(config).to_dict()
    else:
        raise TypeError(f"zero_ext: config must be a ZeroConfig, dict or JSON path, got {type(config).__name__}; "
                        f"pass config=ZeroConfig(...), a dict of options or a JSON file's path (or the options as "
                        f"keyword arguments)")
    check_keys(overrides)
    base.update(overrides)
    if stage is not None:
        base["stage"] = stage
    return ZeroConfig(**base)
