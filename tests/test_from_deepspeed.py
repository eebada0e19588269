"""zero_ext.config_from_deepspeed: a DeepSpeed config as zeroify() arguments
(docs/porting.md, "From DeepSpeed"). One process, no DeepSpeed installed: the mapping
is what is tested; tests/test_porting.py runs the ported script.

- every "maps" key becomes the argument the table says, and the result is a valid ZeroConfig;
- an unsupported or unknown key raises ZeroInputError naming every such key at once;
- keys the training loop owns are named in one UserWarning, the rest pass silently;
- "auto" values (Hugging Face's configs) and switched-off sections leave zero_ext's defaults.
"""
import json
import warnings

import pytest
import torch

import zero_ext
from zero_ext.from_deepspeed import KEYS

DS_CONFIG = "examples/ds_config.json"


def convert(config, expect_warning=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kwargs = zero_ext.config_from_deepspeed(config)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if expect_warning is None:
        assert not messages, messages
    else:
        assert len(messages) == 1 and all(k in messages[0] for k in expect_warning), messages
    return kwargs


def test_example_config_maps_to_stage_2(request):
    path = request.config.rootpath / DS_CONFIG
    kwargs = convert(str(path), expect_warning=["gradient_clipping=1.0", "train_micro_batch_size_per_gpu"])
    assert kwargs == {"stage": 2, "accumulation_steps": 2}
    assert kwargs == convert(json.loads(path.read_text()), expect_warning=["gradient_clipping"])


def test_zero_and_precision_keys_map():
    config = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10000,
                              "zero_hpz_partition_size": 8, "zero_quantized_weights": True,
                              "zero_quantized_gradients": True, "ignore_unused_parameters": True,
                              "stage3_max_live_parameters": 1e9, "stage3_prefetch_bucket_size": 5e8,
                              "offload_param": {"device": "none"}},
        "bf16": {"enabled": True},
        "communication_data_type": "bf16",
    }
    assert convert(config) == {"stage": 3, "min_unit_numel": 10000, "node_size": 8, "param_quant": "int8",
                               "grad_quant": "int4", "find_unused_parameters": True, "param_dtype": "bf16",
                               "reduce_dtype": "bf16"}


def test_fp16_loss_scaling_maps():
    config = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                       "hysteresis": 2, "min_loss_scale": 1}, "zero_optimization": {"stage": 1}}
    kwargs = convert(config)
    assert kwargs == {"stage": 1, "param_dtype": "fp16", "loss_scale": "dynamic", "initial_loss_scale": 4096.0,
                      "loss_scale_growth_interval": 500, "loss_scale_hysteresis": 2, "min_loss_scale": 1.0}
    cfg = zero_ext.ZeroConfig(**kwargs)
    assert cfg.resolved_loss_scale() == "dynamic" and cfg.initial_loss_scale == 2.0 ** 12
    assert convert({"fp16": {"enabled": True, "loss_scale": 128.0}})["loss_scale"] == 128.0


def test_switched_off_and_auto_sections_keep_defaults():
    # Hugging Face's Trainer writes "auto" for what it fills in itself.
    config = {"fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
              "bf16": {"enabled": False}, "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
              "pipeline": {"enabled": False}, "offload_optimizer": None}
    with pytest.raises(zero_ext.ZeroInputError, match="offload_optimizer: not a DeepSpeed key"):
        convert(config)                          # top-level offload_optimizer is misplaced
    del config["offload_optimizer"]
    assert convert(config) == {"stage": 2}


def test_unsupported_keys_raise_naming_each():
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "pin_memory": True},
                                    "offload_param": {"device": "nvme"}, "stage3_typo_key": 1},
              "pipeline": {"stages": 2}, "sparse_gradients": True}
    with pytest.raises(zero_ext.ZeroInputError) as e:
        zero_ext.config_from_deepspeed(config)
    text = str(e.value)
    for key in ("zero_optimization.offload_optimizer", "zero_optimization.offload_param",
                "zero_optimization.stage3_typo_key", "pipeline", "sparse_gradients"):
        assert key in text, (key, text)
    assert "parameter offload is not implemented" in text and "host memory only" in text


def test_optimizer_offload_maps_to_offload_cpu():
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    assert zero_ext.config_from_deepspeed(ds) == {"stage": 2, "offload": "cpu"}
    assert zero_ext.config_from_deepspeed({"zero_optimization": {"stage": 1, "cpu_offload": True}}) == \
        {"stage": 1, "offload": "cpu"}
    off = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}
    assert zero_ext.config_from_deepspeed(off) == {"stage": 2}
    assert zero_ext.config_from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "cpu"}}}) == {"stage": 3, "offload": "cpu"}
    with pytest.raises(zero_ext.ZeroInputError, match="zeroify refuses"):   # stage 0 shards nothing
        zero_ext.config_from_deepspeed({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})


def test_values_zeroify_refuses_raise():
    with pytest.raises(zero_ext.ZeroInputError, match="zeroify refuses"):
        zero_ext.config_from_deepspeed({"zero_optimization": {"stage": 0, "zero_quantized_weights": True}})
    with pytest.raises(zero_ext.ZeroInputError, match="both enabled"):
        zero_ext.config_from_deepspeed({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(zero_ext.ZeroInputError, match="communication_data_type"):
        zero_ext.config_from_deepspeed({"communication_data_type": "int8"})


def test_bad_inputs():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        zero_ext.config_from_deepspeed("/nonexistent/ds.json")
    with pytest.raises(TypeError, match="dict or a JSON path"):
        zero_ext.config_from_deepspeed(["stage", 2])


def test_every_maps_entry_has_a_rule_and_table_is_complete():
    """Each 'maps' key converts (no internal error), to the argument its row names."""
    samples = {"zero_optimization.stage": 2, "zero_optimization.ignore_unused_parameters": False,
               "communication_data_type": "fp32", "data_types.grad_accum_dtype": "fp32",
               "zero_optimization.zero_quantized_weights": True, "zero_optimization.zero_quantized_gradients": True,
               "zero_optimization.zero_hpz_partition_size": 2, "gradient_accumulation_steps": 4,
               "zero_optimization.offload_optimizer": {"device": "cpu"}, "zero_optimization.cpu_offload": True}
    for key, (verdict, arg, why) in KEYS.items():
        assert verdict in ("maps", "not needed", "script", "if disabled"), (key, verdict)
        assert why, key
        if verdict != "maps":
            assert not arg, key
            continue
        value = samples.get(key, 3)
        section, _, leaf = key.rpartition(".")
        config = {section: {leaf: value}} if section else {key: value}
        if section == "fp16":
            config["fp16"]["enabled"] = True
        if key in ("zero_optimization.zero_hpz_partition_size", "zero_optimization.stage3_param_persistence_threshold",
                   "zero_optimization.param_persistence_threshold"):
            config["zero_optimization"]["stage"] = 3
        elif key in ("zero_optimization.zero_quantized_weights", "zero_optimization.zero_quantized_gradients",
                     "zero_optimization.offload_optimizer", "zero_optimization.cpu_offload"):
            config["zero_optimization"]["stage"] = 2
        kwargs = convert(config)
        assert arg in kwargs, (key, kwargs)


def test_result_drives_zeroify():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kwargs = convert({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
    model, opt = zero_ext.zeroify(model, opt, **kwargs)
    loss = model(torch.randn(4, 8)).float().square().mean()
    loss.backward()
    opt.step()
    assert opt.stats()["stage"] == 2 and opt.stats()["param_dtype"] == "bf16"
