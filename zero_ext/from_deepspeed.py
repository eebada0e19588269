"""config_from_deepspeed(): a DeepSpeed config as zeroify() keyword arguments (docs/porting.md).

    model, opt = zero_ext.zeroify(model, opt, **zero_ext.config_from_deepspeed("ds_config.json"))

Every DeepSpeed ZeRO key has a verdict in KEYS (the guide's table is generated from it); a key
not in KEYS raises, so nothing is dropped silently. DeepSpeed need not be installed.
"""
from __future__ import annotations

import warnings
from typing import Any

from .config import ZeroConfig, dtype_name, read_json

# dotted key -> (verdict, zeroify argument or "", why). Verdicts: "maps" (to the argument), "not needed",
# "script" (the training loop's: one warning), "if disabled" (raises unless switched off).
# A literal: tools/docsgen.py reads it without importing zero_ext.
KEYS = {
    # ---- the ZeRO section
    "zero_optimization.stage": (
        "maps", "stage", "0-3 keep their meaning: 1 shards optimizer state, 2 gradients too, 3 parameters too"),
    "zero_optimization.reduce_scatter": (
        "not needed", "", "stages 1-3 always reduce-scatter (on gloo by all-to-all + a local sum); "
        "false (all-reduce) is a speed choice with the same result"),
    "zero_optimization.reduce_bucket_size": (
        "not needed", "", "DeepSpeed's element counts size its own buffers (default 5e8 elements); zero_ext's "
        "bucket_bytes='auto' sizes buckets from the model. Pass bucket_bytes to tune"),
    "zero_optimization.allgather_bucket_size": (
        "not needed", "", "one bucket is the unit of both the reduce-scatter and the all-gather (bucket_bytes)"),
    "zero_optimization.allgather_partitions": ("not needed", "", "parameters are always all-gathered per bucket"),
    "zero_optimization.overlap_comm": (
        "not needed", "", "the reduce-scatter of a bucket always starts during backward, from its last "
        "gradient's hook; overlap_param_gather=True also overlaps stages 1-2's parameter gather with forward"),
    "zero_optimization.contiguous_gradients": (
        "not needed", "", "gradients always live in flat buckets (stage 2: a ring of two buffers)"),
    "zero_optimization.round_robin_gradients": (
        "not needed", "", "offload lands each bucket's gradient on the host in bucket order as it is reduced"),
    "zero_optimization.use_multi_rank_bucket_allreduce": (
        "not needed", "", "buckets are reduce-scattered, never all-reduced, in stages 1-3"),
    "zero_optimization.load_from_fp32_weights": ("not needed", "", "checkpoints always hold the fp32 master weights"),
    "zero_optimization.elastic_checkpoint": (
        "not needed", "", "every zero_ext.save checkpoint loads at any world size and stage"),
    "zero_optimization.ignore_unused_parameters": (
        "maps", "find_unused_parameters", "true: agree on unused parameters every step (as "
        "DDP(find_unused_parameters=True)); false: a missing gradient raises. Absent: zero_ext's 'auto'"),
    "zero_optimization.sub_group_size": ("not needed", "", "the fused step runs bucket by bucket"),
    "zero_optimization.cpu_offload": (
        "maps", "offload", "true: optimizer state in host memory (offload='cpu', stages 1-3)"),
    "zero_optimization.offload_optimizer": (
        "maps", "offload", "{'device': 'cpu'}: optimizer state in host memory (offload='cpu', stages 1-3); "
        "'none' is off; 'nvme' is not supported; pin_memory and the buffer counts are not needed"),
    "zero_optimization.offload_param": (
        "if disabled", "", "parameter offload is not implemented ({'device': 'none'} is accepted)"),
    "zero_optimization.stage3_prefetch_bucket_size": (
        "not needed", "", "stage 3 prefetches prefetch_depth units ahead and coalesces small ones up to "
        "coalesce_numel elements"),
    "zero_optimization.prefetch_bucket_size": ("not needed", "", "as stage3_prefetch_bucket_size"),
    "zero_optimization.stage3_param_persistence_threshold": (
        "maps", "min_unit_numel", "units smaller than this many elements stay gathered (DeepSpeed counts per "
        "parameter, zero_ext per unit)"),
    "zero_optimization.param_persistence_threshold": (
        "maps", "min_unit_numel", "as stage3_param_persistence_threshold"),
    "zero_optimization.model_persistence_threshold": (
        "not needed", "", "what stays gathered is the root unit and units under min_unit_numel"),
    "zero_optimization.stage3_max_live_parameters": (
        "not needed", "", "a unit is released after its forward and its backward; prefetch_depth bounds the "
        "units gathered ahead"),
    "zero_optimization.max_live_parameters": ("not needed", "", "as stage3_max_live_parameters"),
    "zero_optimization.stage3_max_reuse_distance": (
        "not needed", "", "units are gathered again for backward (or, with node_size, from the node's parts)"),
    "zero_optimization.max_reuse_distance": ("not needed", "", "as stage3_max_reuse_distance"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        "not needed", "", "model.state_dict() gathers the full weights unit by unit; zero_ext.save writes a "
        "checkpoint that loads at any world size"),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": (
        "not needed", "", "as stage3_gather_16bit_weights_on_model_save"),
    "zero_optimization.gather_16bit_weights_on_model_save": (
        "not needed", "", "as stage3_gather_16bit_weights_on_model_save"),
    "zero_optimization.stage3_module_granularity_threshold": (
        "not needed", "", "stage-3 units are chosen by unit_modules, unit_numel and min_unit_numel"),
    "zero_optimization.zero_hpz_partition_size": (
        "maps", "node_size", "ZeRO++ hpZ: a secondary copy of each unit inside a node of this many ranks, so "
        "the backward gather stays in the node (stage 3; 1 is off)"),
    "zero_optimization.zero_quantized_weights": (
        "maps", "param_quant", "ZeRO++ qwZ: true gathers parameters as blockwise int8 (param_quant='int8')"),
    "zero_optimization.zero_quantized_gradients": (
        "maps", "grad_quant", "ZeRO++ qgZ: true reduces gradients as blockwise int4 by all-to-all "
        "(grad_quant='int4'; 'int8' is the gentler choice)"),
    "zero_optimization.zero_quantized_nontrainable_weights": (
        "if disabled", "", "frozen parameters are gathered exactly"),
    "zero_optimization.mics_shard_size": ("if disabled", "", "MiCS sub-group sharding is not implemented"),
    "zero_optimization.mics_hierarchical_params_gather": ("if disabled", "", "MiCS is not implemented"),
    "zero_optimization.memory_efficient_linear": ("not needed", "", "linear layers run as torch's own"),
    "zero_optimization.legacy_stage1": ("not needed", "", "there is one stage 1"),
    "zero_optimization.log_trace_cache_warnings": (
        "not needed", "", "unforeseen unit fetches are counted in stats()['out_of_order_fetches']"),
    "zero_allow_untested_optimizer": (
        "not needed", "", "any elementwise torch.optim optimizer runs (Adam/AdamW/SGD fused); others raise"),
    "zero_force_ds_cpu_optimizer": ("not needed", "", "there is no separate CPU optimizer"),
    # ---- precision
    "bf16.enabled": ("maps", "param_dtype", "true: param_dtype='bf16' (fp32 masters and optimizer states)"),
    "bf16.immediate_grad_update": ("not needed", "", "gradients reach the fp32 shard as each bucket reduces"),
    "bf16.check_grad_overflow": ("not needed", "", "bf16 needs no loss scaling"),
    "fp16.enabled": ("maps", "param_dtype", "true: param_dtype='fp16' with dynamic loss scaling"),
    "fp16.loss_scale": ("maps", "loss_scale", "0: 'dynamic'; a positive number: that static scale"),
    "fp16.initial_scale_power": ("maps", "initial_loss_scale", "p: initial_loss_scale = 2**p"),
    "fp16.loss_scale_window": ("maps", "loss_scale_growth_interval", "overflow-free steps before the scale grows"),
    "fp16.hysteresis": (
        "maps", "loss_scale_hysteresis", "overflowing steps before the scale backs off; zero_ext counts "
        "consecutive ones (DeepSpeed's consecutive_hysteresis=true)"),
    "fp16.consecutive_hysteresis": (
        "not needed", "", "zero_ext's hysteresis always counts consecutive overflowing steps"),
    "fp16.min_loss_scale": ("maps", "min_loss_scale", "the scale's floor"),
    "fp16.auto_cast": ("not needed", "", "floating-point inputs to model(...) are always cast to param_dtype"),
    "fp16.fp16_master_weights_and_grads": ("if disabled", "", "master weights and optimizer states are fp32"),
    "amp.enabled": ("if disabled", "", "apex AMP is not used; param_dtype='fp16' or 'bf16' instead"),
    "communication_data_type": (
        "maps", "reduce_dtype", "what gradients are reduced in: 'fp32' (zero_ext's default), 'bf16' or 'fp16'"),
    "data_types.grad_accum_dtype": ("maps", "reduce_dtype", "gradients accumulate and are reduced in the same dtype"),
    "prescale_gradients": ("not needed", "", "zero_ext averages over ranks exactly (1/N folded into the step)"),
    "gradient_predivide_factor": ("not needed", "", "as prescale_gradients"),
    "sparse_gradients": ("if disabled", "", "sparse gradients are not supported"),
    # ---- the training loop's own
    "train_batch_size": ("script", "", "the data loader's batch x accumulation steps x world size"),
    "train_micro_batch_size_per_gpu": ("script", "", "the data loader's batch size"),
    "gradient_accumulation_steps": (
        "maps", "accumulation_steps", "used by stage='auto' to weigh stages 2-3's per-micro-step "
        "reduction; the loop accumulates (model.no_sync() or require_backward_grad_sync, as with DDP)"),
    "gradient_clipping": ("script", "", "call opt.clip_grad_norm_(value) (or torch's clip_grad_norm_) before step()"),
    "optimizer": ("script", "", "build the torch optimizer (torch.optim.AdamW(model.parameters(), ...)) and pass it"),
    "scheduler": ("script", "", "build a torch LR scheduler on the optimizer zeroify returns"),
    "activation_checkpointing": ("script", "", "torch.utils.checkpoint inside the model works in every stage"),
    "steps_per_print": ("not needed", "", "print what you like; opt.stats() has the counters"),
    "wall_clock_breakdown": ("not needed", "", "opt.stats()['comm_wait_s'] is the time blocked in collectives"),
    "memory_breakdown": ("not needed", "", "opt.stats()['model_state_bytes'] and ['buffer_bytes']"),
    "dump_state": ("not needed", "", "opt.describe_plan() prints the layout"),
    "tensorboard": ("not needed", "", "logging is the script's"),
    "wandb": ("not needed", "", "logging is the script's"),
    "csv_monitor": ("not needed", "", "logging is the script's"),
    "comet": ("not needed", "", "logging is the script's"),
    "comms_logger": ("not needed", "", "opt.stats()['comm'] counts every collective's calls and bytes"),
    "flops_profiler": ("not needed", "", "use torch.profiler"),
    "checkpoint": (
        "not needed", "", "zero_ext.save / zero_ext.load: verified, atomic, any world size (DeepSpeed's "
        "universal checkpoints without a conversion)"),
    "elasticity": (
        "if disabled", "", "batch-size elasticity is the script's; torchrun --nnodes=MIN:MAX restarts the job "
        "and zero_ext.load resumes at the new world size"),
    "aio": ("not needed", "", "no NVMe offload"),
    # ---- other parallelism and training features
    "pipeline": ("if disabled", "", "pipeline parallelism is not part of zero_ext"),
    "tensor_parallel": ("if disabled", "", "tensor parallelism is not part of zero_ext"),
    "sequence_parallel_size": ("if disabled", "", "sequence parallelism is not part of zero_ext"),
    "moe": ("if disabled", "", "expert parallelism is not part of zero_ext (MoE models train data-parallel)"),
    "compression_training": ("if disabled", "", "not part of zero_ext"),
    "curriculum_learning": ("if disabled", "", "the data schedule is the script's"),
    "data_efficiency": ("if disabled", "", "the data schedule is the script's"),
    "autotuning": ("if disabled", "", "stage='auto' picks a stage from a memory budget; nothing else is tuned"),
    "quantize_training": ("if disabled", "", "not part of zero_ext"),
    "progressive_layer_drop": ("if disabled", "", "not part of zero_ext"),
    "eigenvalue": ("if disabled", "", "not part of zero_ext"),
    "hybrid_engine": ("if disabled", "", "not part of zero_ext"),
    "weight_quantization": ("if disabled", "", "not part of zero_ext"),
}

_SECTIONS = ("zero_optimization", "bf16", "fp16", "data_types")   # their keys are listed one by one


def _flatten(config: dict) -> dict:
    """{"zero_optimization.stage": 2, "optimizer": {...}}: _SECTIONS one level deep, other keys whole."""
    flat = {}
    for k, v in config.items():
        if k in _SECTIONS and isinstance(v, dict):
            # bf16/fp16 off (or HF's "auto"): their other keys do not apply, but are checked for typos
            off = k in ("bf16", "fp16") and v.get("enabled", False) is not True
            for kk, vv in v.items():
                flat[f"{k}.{kk}"] = "auto" if off and kk != "enabled" else vv
        elif k == "amp" and isinstance(v, dict):
            flat["amp.enabled"] = v.get("enabled", False)
        else:
            flat[k] = v
    return flat


def _disabled(value: Any) -> bool:
    """True for a feature switched off: false/None/0, {"enabled": false}, {"device": "none"}, or an empty dict."""
    if value is None or value is False or value == 0:
        return True
    if isinstance(value, str):
        return value.lower() in ("none", "auto")
    if isinstance(value, dict) and "enabled" in value:
        return value["enabled"] in (False, None, 0)
    return isinstance(value, dict) and (not value or str(value.get("device", "?")).lower() in ("none", ""))


def config_from_deepspeed(config: dict | str) -> dict:
    """zeroify() keyword arguments (validated as a ZeroConfig) doing what DeepSpeed config `config`
    (a dict or a JSON path) asks; "auto" values keep zero_ext's defaults. Raises ZeroInputError naming
    every unsupported or unknown key; the training loop's keys are named in one UserWarning."""
    from .api import ZeroInputError      # api imports the extension

    if isinstance(config, str):
        config = read_json(config, "DeepSpeed config file", "your ds_config JSON, or its contents as a dict",
                           "one JSON object", ZeroInputError)
    if not isinstance(config, dict):
        raise TypeError(f"zero_ext: a DeepSpeed config must be a dict or a JSON path, got {type(config).__name__}; "
                        f"pass the ds_config dict or the path of its JSON file")

    kwargs: dict = {}
    refused, script = [], []
    for key, value in _flatten(config).items():
        if key not in KEYS:
            refused.append(f"{key}: not a DeepSpeed key zero_ext knows (a typo, or a newer DeepSpeed "
                           f"feature): remove it, or map it by hand")
            continue
        verdict, arg, why = KEYS[key]
        if verdict == "if disabled":
            if not _disabled(value):
                refused.append(f"{key}={value!r}: not supported: {why}")
        elif verdict == "script":
            if value != "auto":
                script.append(f"{key}={value!r}: {why}")
        elif verdict == "maps" and value != "auto" and (why := _map(key, value, kwargs)):
            refused.append(f"{key}={value!r}: {why}")
    if refused:
        raise ZeroInputError("zero_ext: this DeepSpeed config asks for what zero_ext does not do:\n  "
                             + "\n  ".join(refused) + "\nRemove these keys (or disable them) and convert again")
    if script:
        warnings.warn("zero_ext: these DeepSpeed keys belong to your training loop, not to zeroify:\n  "
                      + "\n  ".join(script), UserWarning, stacklevel=2)
    try:
        ZeroConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise ZeroInputError(f"zero_ext: the DeepSpeed config maps to {kwargs}, which zeroify refuses: {e} (change "
                             f"the DeepSpeed key that sets it)") from None
    return kwargs


# "maps" keys whose value alone gives the arguments: key -> value -> {argument: value}
_SIMPLE = {
    "zero_optimization.stage": lambda v: {"stage": v},
    "zero_optimization.ignore_unused_parameters": lambda v: {"find_unused_parameters": bool(v)},
    "zero_optimization.stage3_param_persistence_threshold": lambda v: {"min_unit_numel": int(v)},
    "zero_optimization.param_persistence_threshold": lambda v: {"min_unit_numel": int(v)},
    "zero_optimization.zero_hpz_partition_size": lambda v: {"node_size": int(v)} if int(v) > 1 else {},
    "zero_optimization.zero_quantized_weights": lambda v: {"param_quant": "int8"} if v else {},
    "zero_optimization.zero_quantized_gradients": lambda v: {"grad_quant": "int4"} if v else {},
    "zero_optimization.cpu_offload": lambda v: {"offload": "cpu"} if v else {},
    "fp16.loss_scale": lambda v: {"loss_scale": "dynamic" if v == 0 else v},
    "fp16.initial_scale_power": lambda v: {"initial_loss_scale": 2.0 ** v},
    "fp16.loss_scale_window": lambda v: {"loss_scale_growth_interval": int(v)},
    "fp16.hysteresis": lambda v: {"loss_scale_hysteresis": int(v)},
    "fp16.min_loss_scale": lambda v: {"min_loss_scale": float(v)},
    "gradient_accumulation_steps": lambda v: {"accumulation_steps": int(v)},
}


def _map(key: str, value: Any, kwargs: dict) -> str | None:
    """Put the zeroify argument(s) of one "maps" key into kwargs, or return why it cannot be."""
    if key in _SIMPLE:
        kwargs.update(_SIMPLE[key](value))
    elif key in ("bf16.enabled", "fp16.enabled"):
        if value and kwargs.setdefault("param_dtype", key.split(".")[0]) != key.split(".")[0]:
            return "bf16 and fp16 are both enabled; enable one"
    elif key in ("communication_data_type", "data_types.grad_accum_dtype"):
        dtype = None if value is None else dtype_name(str(value).lower())
        if dtype not in (None, "fp32", "bf16", "fp16"):
            return "zero_ext reduces gradients in 'fp32', 'bf16' or 'fp16'"
        if dtype is not None and kwargs.setdefault("reduce_dtype", dtype) != dtype:
            return f"communication_data_type and data_types.grad_accum_dtype disagree ({kwargs['reduce_dtype']!r})"
    elif key == "zero_optimization.offload_optimizer":
        device = value.get("device", "none") if isinstance(value, dict) else value
        if device not in (None, "none", "cpu"):
            return "zero_ext offloads the optimizer to host memory only; use {'device': 'cpu'} or 'none'"
        if device == "cpu":
            kwargs["offload"] = "cpu"
    return None   # every "maps" key has a rule (tests/test_from_deepspeed.py)
