"""ZeroConfig: every option of zeroify(), validated before any collective.

A config comes from keyword arguments, a dict, or a JSON file:

    ZeroConfig(stage=2, bucket_bytes=8 << 20)
    ZeroConfig.from_dict({"stage": 2})
    ZeroConfig.from_json("zero.json")
"""
from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any

_REDUCE_SCATTER = ("auto", "native", "alltoall")
_COMPILE_UNITS = ("per_unit", "whole")
_ISAS = ("auto", "scalar", "avx2", "avx512")
_FUSED = ("auto", "always", "never")
_DTYPES = ("fp32", "bf16", "fp16")
_GRAD_QUANT = (None, "int8", "int4")
_PARAM_QUANT = (None, "int8")
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
    """Options of zeroify(); docs/guide/options.md shows them as a table generated from here.

    stage: 0 (DDP semantics), 1 (optimizer state sharded), 2 (+ gradients sharded),
        3 (+ parameters sharded, gathered per unit on demand), or "auto": the stage
        whose estimated memory (zero_ext.estimate_memory) fits memory_budget with the
        fewest bytes communicated per step (zeroify says why on rank 0).
    memory_budget: stage="auto": bytes one rank may hold for model state, fixed
        buffers and frozen parameters; None = what is free (CUDA: free device memory;
        CPU: MemAvailable / the ranks on this machine), the smallest over ranks.
    accumulation_steps: stage="auto": micro-steps per optimizer step, which multiply
        stages 2-3's communication.
    process_group: the torch.distributed group to shard over; None = the default
        group if one is initialized, else a single process (world size 1).
    bucket_bytes: gradient/parameter bucket size in bytes; "auto" = an eighth of the
        trainable bytes, clamped to [1 MiB, 16 MiB] (the stage 1-2 ring holds two
        buckets' worth of staging and receive buffers, so small models get small ones).
    first_bucket_bytes: size of the first bucket (small, so communication starts early).
    align: slice alignment in elements (each bucket is padded to world_size*align);
        "auto" = 16 (64-byte slices) up to 64 ranks, 1 beyond, so that padding stays
        negligible at large N. Whatever it is, every parameter and every slice starts
        16-byte aligned (Note [Aligned pieces] in csrc/core/zx_core.h).
    reduce_scatter: "auto" (all-to-all + local sum on gloo, native otherwise),
        "native" (the backend's reduce_scatter), or "alltoall".
    grad_ring_buckets: stage 2: how many bucket-sized staging buffers the gradient ring holds.
    overlap_param_gather: stages 1-2: leave the post-step parameter all-gather running
        and wait for it at the next forward (or any zero_ext call that reads parameters).
    broadcast_buffers: broadcast module buffers from rank 0 before every forward (as DDP).
    verify_across_ranks: check once, with one small all-gather, that every rank wraps
        the same parameters and the same config.
    fused: "auto" uses the C kernels for Adam/AdamW/SGD; "never" runs the torch optimizer
        over the local shard; "always" raises if the optimizer has no fused kernel.
    isa: CPU kernel instruction set: "auto" (best available), "scalar", "avx2", "avx512".
    log_plan: print the bucket plan on rank 0.
    unit_modules: stage 3: module class names whose instances form units (e.g.
        ["Block"]); None = automatic, by parameter count along module boundaries.
        Units are modules that are called (not an nn.ModuleList: name its elements).
    unit_numel: stage 3, automatic units: most trainable elements in one unit
        (None = a quarter of the model).
    min_unit_numel: stage 3: smaller units join the root unit, which stays
        gathered from the start of forward to the end of backward.
    prefetch_depth: stage 3: how many units ahead to all-gather while one computes.
    compile_units: stage 3 under torch.compile: "per_unit" (default) gathers each unit around
        its own call, as in eager (stage 3's memory; the graph breaks at each unit), "whole"
        gathers every unit before one graph (fullgraph=True works; stage 2's parameter memory
        during the step). Note [Stage 3 compiled whole] (zero_ext/compiled.py).
    coalesce_numel: stage 3: small units are all-gathered (and in backward reduced)
        together in one collective while their total stays within this many elements, so
        many small units pay few latencies. 0 turns it off.
    param_dtype: what parameters compute in and are all-gathered as: "fp32", "bf16" or
        "fp16" (or the torch dtype). The model is given in fp32; the fp32 master weights
        and optimizer states live only in this rank's shard.
    step_control: where the fused step keeps its scalars (gradient norm, clip factor,
        inf/nan verdict, loss scale, step counts): True = in device memory, so a GPU step
        never waits for the device; False = on the host. "auto" (default): True for CUDA
        parameters with a fused optimizer.
    cast_buffers: with a low param_dtype, which floating-point buffers are cast to it:
        "auto" (default) only the running statistics of torch's BatchNorm/InstanceNorm
        layers (their kernels need their weight's dtype), so buffers such as RoPE's
        inv_freq keep their precision; True all; False none.
    reduce_dtype: what gradients accumulate and are reduced in (default "fp32", even with
        a bf16/fp16 param_dtype; "bf16"/"fp16" halve the reduce-scatter bytes).
    loss_scale: "auto" (dynamic with fp16 params, none otherwise), "dynamic", None (no
        scaling), or a number (a static scale). With a scale, call opt.backward(loss) (or
        opt.scale_loss(loss).backward()); an inf/nan gradient on any rank skips the step.
    initial_loss_scale, loss_scale_growth_factor, loss_scale_backoff_factor,
    loss_scale_growth_interval, loss_scale_hysteresis, min_loss_scale, max_loss_scale:
        dynamic scaling: start at initial_loss_scale; after growth_interval overflow-free
        steps multiply by growth_factor (up to max); after `hysteresis` consecutive
        overflowing steps multiply by backoff_factor (down to min).
    grad_quant: None (exact, the default), "int8" or "int4": stages 1-3 send gradients to
        their owners by all-to-all as blockwise symmetric codes, one fp32 scale per
        quant_block_numel elements; each owner sums the N dequantized slices in fp32.
    grad_quant_error_feedback: with grad_quant, each rank keeps what quantization lost
        (fp32, one value per gradient element it sends) and adds it to the next step's
        gradient before quantizing.
    param_quant: None (exact, the default) or "int8": stages 1-3 gather parameters as
        blockwise symmetric int8 codes, one fp32 scale per quant_block_numel elements,
        about 1/4 of the fp32 bytes. Every rank, the owner included, computes with the same
        dequantized values. The fp32 master stays exact (stages 1/2 with fp32 parameters
        then keep a separate master shard). One rank gathers nothing and stays exact.
    quant_block_numel: elements per quantization block (one fp32 scale each) of grad_quant
        and param_quant; even, >= 2.
    node_size: None (the default: off), an int L or "auto" (LOCAL_WORLD_SIZE, as torchrun
        sets it): stage 3 hierarchical partitioning. Nodes are L consecutive ranks. After
        a unit's forward each rank keeps its 1/L part of the unit, and the backward gather
        stays inside the node, bit-identical to the plain one. Costs up to the model's
        parameters / L per rank between forward and backward
        (stats()["buffer_bytes"]["secondary"]). L must divide the world size.
    offload: None (the default) or "cpu": stages 1-3 keep the fp32 master, the optimizer
        states and the gradient shard in host memory and step them there (ZeRO-Offload),
        pipelined per bucket (docs/guide/memory.md). The device keeps the parameters in
        param_dtype and the gradient buckets. The same bits as without offload. Other
        optimizers than Adam/AdamW/SGD run as torch optimizers on the host shards (a
        warning says so). Not with stage 0, grad_quant, param_quant or step_control=True.
    step_in_backward: False (the default) or True: stages 1-3 with one fused optimizer
        (Adam, AdamW or SGD). Each bucket steps as soon as its reduced gradient lands in
        backward, with the param groups as the backward starts, and no gradient shard is
        kept (docs/guide/memory.md). opt.step() then only publishes the parameters. Every
        parameter steps every reducing backward (without a gradient: with a zero one).
        Clipping raises; refused with loss scaling (fp16), offload or step_control=True.
    state_dtype: "fp32" (default) or "bf16": the dtype of the fused Adam/AdamW's exp_avg and
        exp_avg_sq. "bf16" rounds the fp32 step's states stochastically (the expected value
        stays exact): 4 bytes per trainable parameter less, not the same bits as fp32
        (docs/guide/memory.md). The fp32 master is unchanged. Fused Adam/AdamW only: not
        with amsgrad, SGD, other optimizers or fused="never" (beside Muon/Adafactor it
        applies to the AdamW part).
    master_remainder: True (default) or False. With param_dtype="bf16" in stages 0-2 and one
        fused optimizer (no param_quant, no offload), the fp32 master shard is kept as what
        the bf16 parameter lacks: a 16-bit remainder and a tie bit per element, the same
        fp32 trajectory bit for bit (docs/guide/memory.md). An in-place edit outside
        zero_ext keeps the old remainder (off by below half a bf16 ulp). False: a fp32 shard.
    check_sequence: True (default; "auto" is the same) or False: ranks whose collectives
        diverge (a skipped backward, step() on some ranks only, ...) raise on every rank,
        naming each rank's step, phase and bucket/unit and the fix, instead of hanging
        (Note [Collective sequence check] in csrc/engine/sequence.h). On gloo a step that
        repeats the last costs nothing (Note [Exchanges on deviation]); on NCCL one small
        CPU all-gather per phase. "every_phase": that all-gather on gloo too. It also lets
        a rank that reads alone (rank-0 evaluation) be served by the others (Note [Reading
        alone] in csrc/engine/away.h); with False such a rank waits.
    sequence_timeout: seconds an engine collective may wait before the ranks compare
        their positions through the process group's store (check_sequence); a divergence
        is named within about twice this.
    find_unused_parameters: how the ranks agree on parameters that got no gradient (Note
        [Unused parameters] in csrc/engine/unused.cpp); one no rank gave a gradient is left
        as torch leaves it. True: a small all-reduce every step, as DDP's. False: none; a
        parameter without a gradient on some rank raises ZeroUsageError. "auto" (default):
        the all-reduce runs at the first step and goes on only if a rank missed a parameter
        there; otherwise a later missing gradient raises as with False.
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

    # ------------------------------------------------------------------ build
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
        d = dataclasses.asdict(self)
        d.pop("process_group")
        if d["unit_modules"] is not None:
            d["unit_modules"] = [c if isinstance(c, str) else c.__name__ for c in d["unit_modules"]]
        return d

    # ------------------------------------------------------------------ check
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
    + _choice("reduce_scatter", _REDUCE_SCATTER) + _choice("compile_units", _COMPILE_UNITS)
    + _choice("fused", _FUSED) + _choice("isa", _ISAS)
    + [row for b in ("overlap_param_gather", "broadcast_buffers", "verify_across_ranks", "log_plan",
                     "grad_quant_error_feedback") for row in _bool(b)]
    # communication quantization
    + _int("quant_block_numel", 2)
    + _rule("quant_block_numel", lambda v, c: v % 2 == 0, lambda v, c: f"quant_block_numel must be even (int4 "
            f"codes are packed two per byte), got {v}; {_fix('quant_block_numel')}")
    + _rule("grad_quant", lambda v, c: v in _GRAD_QUANT, lambda v, c: f"grad_quant must be None, 'int8' or 'int4' "
            f"(the supported bit widths); got {v!r}; pass grad_quant='int8', 'int4' or None (exact)")
    + _rule("grad_quant", lambda v, c: c.stage != 0, lambda v, c: f"grad_quant={v!r} needs stage 1, 2 or 3 (stage "
            f"0 reduces with an all-reduce, which has no quantized form); use stage=1 or grad_quant=None", None)
    + _rule("grad_quant", lambda v, c: c.reduce_scatter != "native", lambda v, c: f"grad_quant={v!r} reduces by "
            f"all-to-all; reduce_scatter='native' contradicts it; pass reduce_scatter='auto' or 'alltoall', or "
            f"grad_quant=None", None)
    + _rule("grad_quant_error_feedback", lambda v, c: not v or c.grad_quant is not None, "grad_quant_error_feedback"
            "=True needs grad_quant='int8' or 'int4'; pass one of them, or grad_quant_error_feedback=False")
    + _rule("param_quant", lambda v, c: v in _PARAM_QUANT, lambda v, c: f"param_quant must be None or 'int8' (the "
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
        base = dataclasses.asdict(config)
        base["process_group"] = config.process_group
    elif isinstance(config, dict):
        check_keys(config)
        base = dict(config)
    elif isinstance(config, str):
        base = dataclasses.asdict(ZeroConfig.from_json(config))
    else:
        raise TypeError(f"zero_ext: config must be a ZeroConfig, dict or JSON path, got {type(config).__name__}; "
                        f"pass config=ZeroConfig(...), a dict of options or a JSON file's path (or the options as "
                        f"keyword arguments)")
    check_keys(overrides)
    base.update(overrides)
    if stage is not None:
        base["stage"] = stage
    return ZeroConfig(**base)
