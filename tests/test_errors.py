"""Every error a user can trigger names the object (a parameter by its
name, also from C++), what was expected, and the fix.

A table of (trigger, exception, expected substrings) walks the documented bad inputs
(docs/troubleshooting.md): config keys and values, optimizers
zero_ext cannot run, sparse gradients, mixed devices, a checkpoint of another model,
bad load_state_dict input, gathered_parameters misuse, stage-3 misuse, changes after
zeroify, estimate_memory and config_from_deepspeed input. Each row expects the object
and the fix in the message, so a message that loses either fails its row. The rows
run in this process (no process group: world size 1); the errors that need other ranks
(a parameter list or option that differs across ranks, a rank that rejects its inputs,
a parameter without a gradient) run on one real 2-rank gloo world.
"""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero_ext
from zero_ext import CheckpointError, ZeroInputError, ZeroUsageError, _C
from cases import MLP
from dist_harness import run_world


def _mlp(**kw):
    torch.manual_seed(0)
    return MLP(**kw)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _zeroify(model=None, stage=2, **kw):
    model = model if model is not None else _mlp()
    return zero_ext.zeroify(model, _adamw(model), stage=stage, **kw)


def _train_step(zm, zo):
    x, y = torch.randn(4, 13), torch.randn(4, 5)
    zm(x, y).backward()
    zo.step()
    zo.zero_grad()


class SparseLookup(nn.Module):
    """Asks for a sparse gradient through the functional form (nn.Embedding(sparse=True)
    is refused at zeroify; this one only shows at the first backward)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, idx):
        return self.head(F.embedding(idx, self.table, sparse=True)).sum()


def _sparse_backward(stage):
    def trigger(tmp):
        m = SparseLookup()
        zm, _ = zero_ext.zeroify(m, torch.optim.SGD(m.parameters(), lr=0.1), stage=stage)
        zm(torch.tensor([1, 2, 3])).backward()
    return trigger


def _engine_param_dtype(tmp):
    """The engine's own check, as C++ raises it: it names the parameter by the name given."""
    opts = _C.EngineOptions()
    opts.stage = 1
    opts.param_names = ["encoder.weight", "decoder.weight"]
    _C.Engine([torch.zeros(3), torch.zeros(4, dtype=torch.float64)], [0, 0], [], None, opts)


def _zeroify_twice(tmp):
    m = _mlp()
    first = zero_ext.zeroify(m, _adamw(m), stage=1)   # kept: a dropped wrapper frees the model again
    zero_ext.zeroify(m, _adamw(m), stage=1)
    del first


def _torch_optimizer_step(tmp):
    m = _mlp()
    opt = _adamw(m)
    zero_ext.zeroify(m, opt, stage=1)
    opt.step()


def _twice_in_optimizer(tmp):
    m = _mlp()
    w = m.layers[0].weight
    with pytest.warns(UserWarning):       # torch's own warning about the duplicate
        opt = torch.optim.AdamW([w, w] + list(m.layers[1:].parameters()), lr=1e-3)
    zero_ext.zeroify(m, opt, stage=1)


def _no_trainable(tmp):
    m = _mlp()
    for p in m.parameters():
        p.requires_grad_(False)
    zero_ext.zeroify(m, _adamw(m), stage=1)


def _mixed_devices(tmp):
    m = _mlp()
    m.layers[0].weight = nn.Parameter(torch.empty(37, 13, device="meta"))
    zero_ext.zeroify(m, _adamw(m), stage=1)


def _meta_stage2(tmp):
    with torch.device("meta"):
        m = _mlp()
    zero_ext.zeroify(m, _adamw(m), stage=2)


def _foreign_param(tmp):
    m = _mlp()
    zero_ext.zeroify(m, torch.optim.AdamW(list(m.parameters()) + [nn.Parameter(torch.zeros(3))]), stage=1)


def _double_model(tmp):
    m = _mlp().double()
    zero_ext.zeroify(m, _adamw(m), stage=1)


def _zero_model_again(tmp):
    zm, _ = _zeroify()
    zero_ext.zeroify(zm, _adamw(zm.module), stage=1)


def _auto_over_a_list(tmp):
    m = _mlp()
    zero_ext.zeroify(m, [torch.optim.AdamW(m.layers[0].parameters()), torch.optim.SGD(m.layers[1:].parameters())],
                     stage="auto")


def _step_control_generic(tmp):
    m = _mlp()
    zero_ext.zeroify(m, torch.optim.Adagrad(m.parameters()), stage=1, step_control=True)


def _add_param_group(tmp):
    zm, zo = _zeroify()
    zo.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def _move_after(tmp):
    zm, _ = _zeroify()
    zm.module.double()


def _assign_load(tmp):
    zm, _ = _zeroify()
    zm.load_state_dict(zm.state_dict(), assign=True)


def _clip_norm_type(tmp):
    zm, zo = _zeroify()
    zm(torch.randn(4, 13), torch.randn(4, 5)).backward()
    zo.clip_grad_norm_(1.0, norm_type=1.0)


def _torch_clip_subset(tmp):
    zm, zo = _zeroify()
    zm(torch.randn(4, 13), torch.randn(4, 5)).backward()
    torch.nn.utils.clip_grad_norm_(zm.module.layers[0].parameters(), 1.0)


def _torch_clip_value(tmp):
    zm, zo = _zeroify()
    zm(torch.randn(4, 13), torch.randn(4, 5)).backward()
    torch.nn.utils.clip_grad_value_(zm.parameters(), -1.0)


def _load_model_state_as_optimizer(tmp):
    zm, zo = _zeroify()
    zo.load_state_dict(zm.state_dict())


def _load_state_of_other_model(tmp):
    other = _mlp(hidden=38)
    opt = _adamw(other)
    other(torch.randn(4, 13), torch.randn(4, 5)).backward()
    opt.step()
    zm, zo = _zeroify()
    zo.load_state_dict(opt.state_dict())


def _load_state_other_groups(tmp):
    m = _mlp()
    opt = torch.optim.AdamW([{"params": m.layers[0].parameters()}, {"params": m.layers[1:].parameters()}])
    zm, zo = _zeroify()
    zo.load_state_dict(opt.state_dict())


def _load_sharded_other_stage(tmp):
    zm, zo = _zeroify(stage=1)
    _train_step(zm, zo)
    sd = zo.sharded_state_dict()
    zm2, zo2 = _zeroify(stage=2)
    zo2.load_state_dict(sd)


def _checkpoint_of_another_model(tmp):
    zm, zo = _zeroify(_mlp(hidden=38))
    zero_ext.save(str(tmp / "ckpt"), zm, zo)
    zm2, zo2 = _zeroify()
    zero_ext.load(str(tmp / "ckpt"), zm2, zo2)


def _checkpoint_of_another_optimizer(tmp):
    zm, zo = _zeroify()
    zero_ext.save(str(tmp / "ckpt"), zm, zo)
    m = _mlp()
    zm2, zo2 = zero_ext.zeroify(m, torch.optim.SGD(m.parameters(), lr=0.1), stage=2)
    zero_ext.load(str(tmp / "ckpt"), zm2, zo2)


def _no_checkpoint(tmp):
    zm, zo = _zeroify()
    zero_ext.load(str(tmp / "nowhere"), zm, zo)


def _truncated_checkpoint(tmp):
    zm, zo = _zeroify()
    path = tmp / "ckpt"
    zero_ext.save(str(path), zm, zo)
    shard = next(f for f in os.listdir(path) if f.endswith(".distcp"))
    with open(path / shard, "r+b") as f:
        f.truncate(8)
    zero_ext.load(str(path), zm, zo)


def _save_plain_pair(tmp):
    m = _mlp()
    zero_ext.save(str(tmp / "ckpt"), m, _adamw(m))


def _gather_plain_module(tmp):
    _zeroify()
    with zero_ext.gathered_parameters(_mlp()):
        pass


def _gather_bad_modifier(tmp):
    zm, _ = _zeroify()
    with zero_ext.gathered_parameters(zm.module, modifier_rank=3):
        pass


def _gather_edit_read_only(tmp):
    zm, _ = _zeroify(stage=3)
    with zero_ext.gathered_parameters(zm.module.layers[1]):
        with torch.no_grad():
            zm.module.layers[1].weight.add_(1.0)


def _gather_two_models(tmp):
    a, _ = _zeroify()
    b, _ = _zeroify()
    with zero_ext.gathered_parameters(list(a.parameters()) + list(b.parameters())):
        pass


def _stage3_edit_outside(tmp):
    zm, zo = _zeroify(stage=3, unit_modules=["Linear"], min_unit_numel=0)
    _train_step(zm, zo)
    with torch.no_grad():
        zm.module.layers[2].bias.add_(1.0)
    _train_step(zm, zo)


def _meta_replaced_parameter(tmp):
    with zero_ext.meta_parameters():
        m = _mlp()

    def init_fn(module):
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(torch.zeros_like(module.weight, device="cpu"))

    zero_ext.zeroify(m, _adamw(m), stage=3, init_fn=init_fn)


def _estimate(**kw):
    def trigger(tmp):
        zero_ext.estimate_memory(_mlp(), **kw)
    return trigger


def _deepspeed(config):
    def trigger(tmp):
        zero_ext.config_from_deepspeed(config)
    return trigger


def _zeroify_with(**kw):
    def trigger(tmp):
        m = _mlp()
        zero_ext.zeroify(m, _adamw(m), **kw)
    return trigger


def _zeroify_optimizer(make, **kw):
    def trigger(tmp):
        m = _mlp()
        zero_ext.zeroify(m, make(m), **dict(dict(stage=1), **kw))
    return trigger


def _sparse_embedding(tmp):
    m = nn.Embedding(10, 4, sparse=True)
    zero_ext.zeroify(m, torch.optim.SGD(m.parameters(), lr=0.1))


def _optimizer_twice(tmp):
    m = _mlp()
    opt = _adamw(m)
    zero_ext.zeroify(m, opt, stage=1)
    zero_ext.zeroify(_mlp(), opt, stage=1)


# (id, trigger(tmp_path), exception class, substrings the message must hold: the object, then the fix)
CASES = [
    # --- config keys and values
    ("unknown_key", _zeroify_with(stage=2, bucket_byte=1 << 20), ValueError,
     ["'bucket_byte'", "Did you mean 'bucket_bytes'", "Remove it"]),
    ("stage_range", _zeroify_with(stage=7), ValueError, ["stage must be 0, 1, 2 or 3", "got 7", "pass stage=0"]),
    ("stage_type", _zeroify_with(stage=1.5), TypeError, ["stage must be an int", "1.5", "pass stage=0"]),
    ("int_type", _zeroify_with(bucket_bytes="big"), TypeError,
     ["bucket_bytes must be an int", "'big'", "bucket_bytes='auto'"]),
    ("int_range", _zeroify_with(grad_ring_buckets=0), ValueError,
     ["grad_ring_buckets must be >= 1", "grad_ring_buckets=2"]),
    ("choice", _zeroify_with(reduce_scatter="ring"), ValueError,
     ["reduce_scatter must be one of", "'ring'", "reduce_scatter='auto'"]),
    ("bool", _zeroify_with(log_plan="yes"), TypeError, ["log_plan must be True or False", "log_plan=False"]),
    ("dtype", _zeroify_with(param_dtype="fp8"), ValueError, ["param_dtype must be one of", "'fp8'",
                                                              "param_dtype='fp32'"]),
    ("loss_scale", _zeroify_with(loss_scale=-4.0), ValueError, ["loss_scale must be", "-4.0", "loss_scale='auto'"]),
    ("number", _zeroify_with(loss_scale_backoff_factor=2.0), ValueError,
     ["loss_scale_backoff_factor must be in (0, 1)", "loss_scale_backoff_factor=0.5"]),
    ("step_control", _zeroify_with(step_control="sometimes"), ValueError,
     ["step_control must be", "'sometimes'", "step_control='auto'"]),
    ("unit_modules", _zeroify_with(stage=3, unit_modules="Linear"), ValueError,
     ["unit_modules must be a list", "'Linear'", "unit_modules=['Block']"]),
    ("memory_budget", _zeroify_with(stage="auto", memory_budget=-1), ValueError,
     ["memory_budget must be", "-1", "memory_budget=8 * 2**30"]),
    ("quant_block", _zeroify_with(grad_quant="int4", quant_block_numel=7), ValueError,
     ["quant_block_numel must be even", "got 7", "quant_block_numel=256"]),
    ("grad_quant_value", _zeroify_with(grad_quant="int2"), ValueError,
     ["grad_quant must be", "'int2'", "pass grad_quant='int8'"]),
    ("grad_quant_stage0", _zeroify_with(stage=0, grad_quant="int8"), ValueError,
     ["grad_quant='int8' needs stage 1, 2 or 3", "use stage=1 or grad_quant=None"]),
    ("grad_quant_native", _zeroify_with(grad_quant="int8", reduce_scatter="native"), ValueError,
     ["reduce_scatter='native' contradicts it", "pass reduce_scatter='auto' or 'alltoall'"]),
    ("feedback_alone", _zeroify_with(grad_quant_error_feedback=True), ValueError,
     ["grad_quant_error_feedback=True needs grad_quant", "grad_quant_error_feedback=False"]),
    ("param_quant_stage0", _zeroify_with(stage=0, param_quant="int8"), ValueError,
     ["param_quant='int8' needs stage 1, 2 or 3", "use stage=1 or param_quant=None"]),
    ("node_size_stage", _zeroify_with(stage=2, node_size=2), ValueError,
     ["node_size=2", "is for stage 3", "use stage=3 or node_size=None"]),
    ("config_file", _zeroify_with(config="/nonexistent/zero.json"), FileNotFoundError,
     ["'/nonexistent/zero.json' does not exist", "pass the path of a JSON file"]),
    ("config_type", _zeroify_with(config=42), TypeError, ["config must be a ZeroConfig", "got int", "pass config="]),
    ("config_dict_type", lambda tmp: zero_ext.ZeroConfig.from_dict([("stage", 2)]), TypeError,
     ["a config must be a dict, got list", "{'stage': 2}"]),
    ("process_group", _zeroify_with(process_group="world"), TypeError,
     ["process_group must be a torch.distributed.ProcessGroup", "got str", "dist.new_group"]),
    ("memory_budget_fits_not", _zeroify_with(stage="auto", memory_budget=16), ValueError,
     ["no stage fits the memory budget", "raise memory_budget"]),
    # --- optimizers zero_ext cannot run
    ("not_elementwise", _zeroify_optimizer(lambda m: torch.optim.LBFGS(m.parameters())), ZeroInputError,
     ["LBFGS is not an elementwise optimizer", "Supported: ", "build the optimizer as one of these"]),
    ("sparse_adam", _zeroify_optimizer(lambda m: torch.optim.SparseAdam(m.parameters())), ZeroInputError,
     ["SparseAdam is not an elementwise optimizer", "build the optimizer as one of these"]),
    ("differentiable", _zeroify_optimizer(lambda m: torch.optim.AdamW(m.parameters(), differentiable=True)),
     ZeroInputError, ["AdamW(differentiable=True) is not supported", "construct it with differentiable=False"]),
    ("fused_always", _zeroify_with(fused="always", stage=1), None, None),   # AdamW is fused: accepted
    ("fused_always_generic", _zeroify_optimizer(lambda m: torch.optim.Adagrad(m.parameters()), fused="always"),
     ZeroInputError,
     ["Adagrad has no fused kernel", "use fused='auto'"]),
    # two optimizers over shard views (one keeps their state: was a KeyError at the first state_dict())
    ("two_generic", _zeroify_optimizer(lambda m: [torch.optim.Adagrad(list(m.parameters())[:2]),
                                                  torch.optim.RMSprop(list(m.parameters())[2:])], stage=2),
     ZeroInputError, ["Adagrad and RMSprop would each run as a torch optimizer", "as param groups"]),
    ("reduce_dtype_generic", _zeroify_optimizer(lambda m: torch.optim.RMSprop(m.parameters()), reduce_dtype="bf16"),
     ZeroInputError,
     ["reduce_dtype='bf16' needs a fused optimizer", "RMSprop", "use reduce_dtype='fp32'"]),
    ("step_control_generic", _step_control_generic, ValueError,
     ["step_control=True needs one fused optimizer", "Adagrad", "pass step_control='auto'"]),
    ("not_optimizer", _zeroify_optimizer(lambda m: object()), ZeroInputError,
     ["optimizer must be a torch.optim.Optimizer", "got object", "torch.optim.AdamW(model.parameters())"]),
    ("no_optimizers", _zeroify_optimizer(lambda m: []), ZeroInputError,
     ["the list of optimizers is empty", "pass one torch optimizer"]),
    ("auto_over_a_list", _auto_over_a_list, ZeroInputError,
     ["stage='auto' takes one torch optimizer", "pass stage=1, 2 or 3"]),
    # --- the model and its parameters
    ("not_module", lambda tmp: zero_ext.zeroify(lambda x: x, _adamw(_mlp()), stage=1), ZeroInputError,
     ["model must be a torch.nn.Module", "got function", "zeroify(model, optimizer"]),
    ("already_zeroified_model", _zero_model_again, ZeroInputError,
     ["already wrapped (ZeroModel)", "pass the plain module (model.module)"]),
    ("zeroify_twice", _zeroify_twice, ZeroInputError,
     ["already zeroified (parameter 'layers.0.weight'", "use the model and optimizer that the first zeroify()"]),
    ("optimizer_twice", _optimizer_twice, ZeroInputError,
     ["this torch optimizer (AdamW) was already wrapped", "use the optimizer that zeroify() returned"]),
    ("param_twice", _twice_in_optimizer, ZeroInputError,
     ["parameter 'layers.0.weight' appears twice", "list each parameter once"]),
    ("no_trainable", _no_trainable, ZeroInputError,
     ["no parameter with requires_grad=True", "requires_grad=True on those to train"]),
    ("foreign_param", _foreign_param, ZeroInputError,
     ["(shape (3,), param group 0) is not a parameter of the model", "build the optimizer from model.parameters()"]),
    ("mixed_devices", _mixed_devices, ZeroInputError,
     ["different device types ['cpu', 'meta']", "model.to(device)"]),
    ("meta_stage2", _meta_stage2, ZeroInputError, ["on the meta device", "needs stage=3", "build it on the CPU"]),
    ("double_params", _double_model, ZeroInputError,
     ["parameter 'layers.0.weight' is torch.float64", "model.float()", "param_dtype='bf16'"]),
    ("sparse_embedding", _sparse_embedding, ZeroInputError,
     ["Embedding with sparse=True", "construct it with sparse=False"]),
    # --- sparse gradients met by the C++ engine: named, in every stage's path
    ("sparse_grad_stage0", _sparse_backward(0), RuntimeError,
     ["parameter 'table' got a sparse gradient", "F.embedding(..., sparse=False)"]),
    ("sparse_grad_stage2", _sparse_backward(2), RuntimeError,
     ["parameter 'table' got a sparse gradient", "F.embedding(..., sparse=False)"]),
    ("engine_names_parameters", _engine_param_dtype, RuntimeError,
     ["parameter 'decoder.weight' is Double", "model.float()"]),
    # --- after zeroify
    ("torch_optimizer_step", _torch_optimizer_step, ZeroUsageError,
     ["this torch optimizer (AdamW) was wrapped", "call opt.step()"]),
    ("add_param_group", _add_param_group, ZeroUsageError,
     ["add_param_group after zeroify() is not supported", "put every param group in the torch optimizer"]),
    ("move_after", _move_after, ZeroUsageError, ["'layers.0.weight'", "torch.float64", "param_dtype='bf16'"]),
    ("assign_load", _assign_load, ValueError, ["load_state_dict(assign=True)", "pass assign=False"]),
    ("clip_norm_type", _clip_norm_type, ValueError, ["norm_type 2.0 and inf, got 1.0", "pass norm_type=2.0"]),
    ("torch_clip_subset", _torch_clip_subset, ZeroUsageError,
     ["leave out 4 of the zeroified model's 6", "'layers.1.weight'", "optimizer.clip_grad_norm_(max_norm"]),
    ("torch_clip_value", _torch_clip_value, ValueError, ["clip_value=-1.0", "pass a finite value >= 0"]),
    # --- optimizer state dicts
    ("load_model_state", _load_model_state_as_optimizer, ValueError,
     ["load_state_dict takes an optimizer state dict", "got ['layers.0.bias'", "optimizer.state_dict()"]),
    ("load_other_model_state", _load_state_of_other_model, ValueError,
     ["state 'exp_avg' of parameter 'layers.0.weight' has shape (38, 13)", "load one saved from this model"]),
    ("load_other_groups", _load_state_other_groups, ValueError,
     ["the state dict has 2 param groups, this optimizer 1", "build the optimizer with the same param groups"]),
    ("load_sharded_other_stage", _load_sharded_other_stage, ValueError,
     ["(stage, world_size, rank, optimizer)", "zero_ext.save(path, model, optimizer)"]),
    # --- checkpoints
    ("checkpoint_other_model", _checkpoint_of_another_model, CheckpointError,
     ["is of another model", "layers.0.weight (38, 13) saved, (37, 13) here", "Build the same model"]),
    ("checkpoint_other_optimizer", _checkpoint_of_another_optimizer, CheckpointError,
     ["holds AdamW state; this optimizer is SGD", "Wrap the same optimizer class"]),
    ("checkpoint_missing", _no_checkpoint, CheckpointError,
     ["no checkpoint at", "nowhere", "pass the directory that zero_ext.save"]),
    ("checkpoint_truncated", _truncated_checkpoint, CheckpointError,
     ["is damaged: file '", "truncated", "load an earlier checkpoint"]),
    ("save_plain_pair", _save_plain_pair, TypeError,
     ["got (MLP, AdamW)", "zero_ext.save(path, model, opt)"]),
    # --- gathered_parameters
    ("gather_plain_module", _gather_plain_module, ValueError,
     ["parameter 'layers.0.weight', which no zeroified optimizer trains", "pass the model zeroify() returned"]),
    ("gather_modifier_rank", _gather_bad_modifier, ValueError,
     ["modifier_rank must be", "[0, 1), got 3", "pass modifier_rank=0"]),
    ("gather_read_only_edit", _gather_edit_read_only, RuntimeError,
     ["parameter 'layers.1.weight' was modified inside gathered_parameters() without a modifier_rank",
      "modifier_rank=0"]),
    ("gather_two_models", _gather_two_models, ValueError,
     ["parameters of 2 zeroified models", "one `with gathered_parameters(...)` per model"]),
    # --- stage 3
    ("stage3_edit_outside", _stage3_edit_outside, ZeroUsageError,
     ["'layers.2.bias'", "modified in place outside gathered_parameters()",
      "zero_ext.gathered_parameters(module, modifier_rank=0)"]),
    ("meta_replaced_parameter", _meta_replaced_parameter, RuntimeError,
     ["replaced parameters by new nn.Parameter objects (layers.0.weight", "initialize them in place"]),
    # --- estimate_memory, config_from_deepspeed, delay_collectives
    ("estimate_optimizer", _estimate(world_size=2, stage=2, optimizer="Adamm"), ValueError,
     ["unknown optimizer 'Adamm'", "optimizer='AdamW'"]),
    ("estimate_world", _estimate(world_size=0, stage=2), ValueError,
     ["world_size must be an int >= 1, got 0", "pass world_size="]),
    ("estimate_auto", _estimate(world_size=2, stage="auto"), ValueError,
     ["needs a stage 0-3, got 'auto'", "pass stage=0, 1, 2 or 3"]),
    ("deepspeed_offload", _deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}),
     ZeroInputError, ["zero_optimization.offload_optimizer", "host memory only", "Remove these keys"]),
    ("deepspeed_type", _deepspeed(3), TypeError, ["a DeepSpeed config must be a dict", "got int",
                                                   "pass the ds_config dict"]),
    ("deepspeed_file", _deepspeed("/nonexistent/ds.json"), FileNotFoundError,
     ["'/nonexistent/ds.json' does not exist", "pass the path of your ds_config JSON"]),
    ("delay_collectives", lambda tmp: zero_ext.delay_collectives(object(), 1.0), TypeError,
     ["got object", "pass one of those"]),
]


@pytest.mark.parametrize("case", [c for c in CASES if c[2] is not None], ids=lambda c: c[0])
def test_message_names_object_and_fix(case, tmp_path):
    name, trigger, exc, expected = case
    with pytest.raises(exc) as info:
        trigger(tmp_path)
    msg = str(info.value)
    assert "zero_ext" in msg, f"{name}: not a zero_ext message: {msg!r}"
    missing = [s for s in expected if s not in msg]
    assert not missing, f"{name}: {missing} not in the message:\n{msg}"


def test_rows_can_fail():
    """A row whose trigger does not raise fails (pytest.raises), and so does one whose
    message lacks an expected substring: checked on a trigger that is accepted."""
    accepted = next(c for c in CASES if c[0] == "fused_always")
    with pytest.raises(pytest.fail.Exception):
        with pytest.raises(ValueError):
            accepted[1](None)
    with pytest.raises(AssertionError):
        test_message_names_object_and_fix(("probe", _zeroify_with(stage=7), ValueError, ["no such fix"]), None)


# ---------------------------------------------------------------------------------- 2 ranks
def _two_rank_worker(rank, world):
    """Errors that need other ranks, one after another in one world: each raises on
    every rank alike (the zeroify check exchanges before anyone raises), so the next
    case starts from ranks that agree."""
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[name] = f"{type(e).__name__}: {e}"

    def differ_in_shape():
        m = _mlp(hidden=37 + rank)                      # rank 1 builds another model
        zero_ext.zeroify(m, _adamw(m), stage=2)

    def differ_in_option():
        _zeroify(stage=2, bucket_bytes=(1 << 20) + rank * 4096)

    def differ_in_parameters():
        m = _mlp()
        if rank == 1:
            m.layers[2].bias.requires_grad_(False)      # rank 1 trains one parameter fewer
        zero_ext.zeroify(m, _adamw(m), stage=1)

    def one_rank_rejects():
        _zeroify(stage=2, fused="sometimes" if rank == 1 else "auto")

    def no_gradient():
        m = _mlp()
        zm, zo = zero_ext.zeroify(m, _adamw(m), stage=2, find_unused_parameters=False)
        h = torch.randn(4, 13)
        for layer in zm.module.layers[:2]:              # the last layer gets no gradient
            h = torch.tanh(layer(h))
        h.square().mean().backward()
        zo.step()

    attempt("differ_in_shape", differ_in_shape)
    attempt("differ_in_option", differ_in_option)
    attempt("differ_in_parameters", differ_in_parameters)
    attempt("one_rank_rejects", one_rank_rejects)
    attempt("node_size_divides", lambda: _zeroify(stage=3, node_size=3))
    attempt("no_gradient", no_gradient)
    return out


TWO_RANK_CASES = {
    "differ_in_shape": ["rank(s) [", "parameter 'layers.0.weight' is (", "(37, 13)", "(38, 13)",
                        "every rank must build the same model"],
    "differ_in_option": ["option bucket_bytes=", "on rank", "call zeroify() with the same options"],
    "differ_in_parameters": ["parameter 'layers.2.bias' is trained", "every rank must build the same model"],
    "one_rank_rejects": ["rejected their zeroify() inputs", "Fix the error those ranks raised"],
    "node_size_divides": ["node_size=3 does not divide the world size 2", "or node_size=None"],
    "no_gradient": ["ZeroUsageError", "parameter(s) 'layers.2.weight', 'layers.2.bias' got no gradient",
                    "Pass find_unused_parameters=True"],
}


@pytest.mark.dist
def test_errors_that_need_two_ranks():
    outs = run_world(_two_rank_worker, 2, timeout_s=180)
    for rank, got in enumerate(outs):
        for name, expected in TWO_RANK_CASES.items():
            msg = got[name]
            if name == "one_rank_rejects" and rank == 1:
                expected = ["fused must be one of", "'sometimes'", "fused='auto'"]
            missing = [s for s in expected if s not in msg]
            assert not missing, f"rank {rank}, {name}: {missing} not in the message:\n{msg}"
