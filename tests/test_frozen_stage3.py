"""Stage 3 shards frozen parameters (requires_grad=False) like trainable
ones, gathered with their unit, with no gradient, master or optimizer state
(Note [Stage 3 frozen parameters] in csrc/engine/frozen.cpp).

PEFT LoRA (r=4 on q_proj and v_proj) on a small Llama built from its config:
- 2 gloo ranks, stage 3: the frozen bytes each rank holds (stats()) are the frozen
  bytes / 2 within 1%; after 6 steps every trainable tensor equals DDP + the same
  torch AdamW bit for bit (2 ranks: same reduction order, as tests/test_hf_models.py),
  and every frozen tensor is bit-equal to the model's original one.
- torch's fake backend at N = 64 (one process allocating what one rank of 64 would):
  frozen bytes per rank = frozen bytes / 64 within 1%, as estimate_memory predicts.
- checkpoints keep the frozen weights exactly across layouts: saved at 2 ranks
  stage 3, loaded at 3 ranks stage 1 (into a model whose weights all differ), trained
  on and saved there, loaded back at 2 ranks stage 3, and through load_state_dict;
  an in-place edit of a sharded frozen parameter outside gathered_parameters raises.
The plain GPT with a frozen embedding at stage 3 against DDP is in tests/test_stage3.py.
"""
import copy
import os
import tempfile

import pytest
import torch
from torch import nn

from dist_harness import run_world
from test_hf_models import OPT, build, loss_of, train, trainable

pytestmark = pytest.mark.dist

pytest.importorskip("transformers", reason="transformers is a test dependency (make test installs it)")
pytest.importorskip("peft", reason="peft is a test dependency (make test installs it)")


def _frozen(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def _frozen_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


def _opt(model, **kw):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT, **kw)


def _lora_worker(rank, world, ckpt):
    import zero_ext

    base = build("lora")
    names, frozen0 = trainable(base), _frozen(base)
    ref = copy.deepcopy(base)     # DDP + torch's fused AdamW, the kernel zero_ext's equals bit for bit
    train("lora", ref, _opt(ref, fused=True), rank, nn.parallel.DistributedDataParallel(ref))
    model = copy.deepcopy(base)
    zm, zo = zero_ext.zeroify(model, _opt(model), stage=3)
    held = zo.stats()["frozen_parameter_bytes"]
    train("lora", zm, zo, rank)
    grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    sd = zm.state_dict()
    zero_ext.save(ckpt, zm, zo)
    return {"held": held, "total": _frozen_bytes(base), "stats": zo.stats(), "grads": grads,
            "differ": [n for n in names if not torch.equal(sd[n], ref.state_dict()[n])],
            "frozen_changed": [n for n, t in frozen0.items() if not torch.equal(sd[n], t)],
            "moved": sum((sd[n] - base.state_dict()[n]).abs().sum().item() for n in names),
            "sd": sd if rank == 0 else None}


def _perturbed(stage, **options):
    """The LoRA Llama with every weight different from the saved ones, zeroified."""
    import zero_ext

    model = build("lora")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    return zero_ext.zeroify(model, _opt(model), stage=stage, **options)


def _reload_worker(rank, world, ckpt, ckpt2, stage, sd=None):
    """Load ckpt into a perturbed model at this world size / stage, train a step,
    save ckpt2 (if given), then load_state_dict(sd) (if given); return the state
    after the load and at the end."""
    import zero_ext

    zm, zo = _perturbed(stage)
    zero_ext.load(ckpt, zm, zo)
    loaded = {k: t.clone() for k, t in zm.state_dict().items()}   # stages 0-2 give views
    loss_of("lora", zm, rank, 100).backward()
    zo.step()
    zo.zero_grad()
    if ckpt2:
        zero_ext.save(ckpt2, zm, zo)
    refused = None
    if sd is not None:
        zm.load_state_dict(sd)
        end = zm.state_dict()
        # an in-place edit of a sharded frozen parameter outside gathered_parameters is refused
        with torch.no_grad():
            next(p for p in zm.module.parameters() if not p.requires_grad).mul_(2.0)
        try:
            zo.step()
        except zero_ext.ZeroUsageError as e:
            refused = str(e)
    else:
        end = zm.state_dict()
    return {"loaded": loaded, "end": end, "held": zo.stats()["frozen_parameter_bytes"], "refused": refused}


def _fake_worker(rank, world, fake_world):
    import torch.distributed as dist
    import transformers as tf
    from peft import LoraConfig, get_peft_model
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zero_ext

    dist.init_process_group("fake", store=FakeStore(), rank=fake_world - 1, world_size=fake_world)
    torch.manual_seed(0)
    # big enough that padding each unit to N * 16 elements stays far below 1% at N = 64
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                                               num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=4, max_position_embeddings=64))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    total = _frozen_bytes(model)
    opt = _opt(model)
    est = zero_ext.estimate_memory(model, fake_world, 3, optimizer=opt, backend="fake")
    zm, zo = zero_ext.zeroify(model, opt, stage=3)
    ids = torch.randint(0, 1024, (2, 12))
    zm(input_ids=ids, labels=ids).loss.backward()
    zo.step()
    zo.zero_grad()
    s = zo.stats()
    dist.destroy_process_group()
    return {"total": total, "held": s["frozen_parameter_bytes"], "estimate": est["frozen_parameter_bytes"],
            "msb": s["model_state_bytes"], "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def test_lora_stage3_shards_frozen_and_matches_ddp():
    with tempfile.TemporaryDirectory() as tmp:
        a, b = os.path.join(tmp, "a"), os.path.join(tmp, "b")
        outs = run_world(_lora_worker, 2, a, timeout_s=300, reuse=True)
        for rank, r in enumerate(outs):
            where = f"rank {rank}"
            assert r["moved"] > 0, f"{where}: nothing trained"
            assert abs(r["held"] - r["total"] / 2) <= 0.01 * r["total"] / 2, \
                f"{where}: holds {r['held']} frozen bytes, {r['total']} / 2 expected"
            assert r["stats"]["frozen_shard_bytes"] == r["held"]
            assert not r["differ"], f"{where}: not bit-equal to DDP: {r['differ']}"
            assert not r["frozen_changed"], f"{where}: frozen parameters changed: {r['frozen_changed']}"
            assert not r["grads"], f"{where}: frozen parameters got gradients: {r['grads']}"
        saved, total = outs[0]["sd"], outs[0]["total"]

        # 2 ranks stage 3 -> 3 ranks stage 1 (frozen replicated there), and back
        outs = run_world(_reload_worker, 3, a, b, 1, timeout_s=300, reuse=True)
        for rank, r in enumerate(outs):
            bad = [n for n, t in saved.items() if not torch.equal(r["loaded"][n], t)]
            assert not bad, f"3 ranks stage 1, rank {rank}: loaded tensors differ from the saved: {bad}"
            assert r["held"] == total                          # stage 1 keeps them whole
        after = outs[0]["end"]
        # back at 2 ranks stage 3; then (after a step there) load_state_dict(after)
        for rank, r in enumerate(run_world(_reload_worker, 2, b, None, 3, after, timeout_s=300, reuse=True)):
            bad = [n for n, t in after.items() if not torch.equal(r["loaded"][n], t)]
            assert not bad, f"2 ranks stage 3, rank {rank}: loaded tensors differ from the saved: {bad}"
            bad = [n for n, t in after.items() if not torch.equal(r["end"][n], t)]
            assert not bad, f"load_state_dict at stage 3, rank {rank}: {bad}"
            assert r["refused"] and "gathered_parameters" in r["refused"], f"rank {rank}: edit not refused"


def test_fake_backend_64_ranks_hold_frozen_over_64():
    r = run_world(_fake_worker, 1, 64, init_pg=False, timeout_s=300)[0]
    share = r["total"] / 64
    assert abs(r["held"] - share) <= 0.01 * share, f"holds {r['held']} frozen bytes, {share:.0f} expected"
    assert r["estimate"] == r["held"], f"estimate_memory says {r['estimate']}"
    # the trainable state is unaffected: 16 bytes per trainable element over 64 ranks (+ padding)
    assert r["msb"]["total"] < 16 * r["trainable"] / 64 * 1.5 + 16 * 1024, r["msb"]
