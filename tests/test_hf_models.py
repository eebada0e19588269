"""Hugging Face transformers models, built from small configs (never
from_pretrained, no network), trained as their authors train them, against DDP + the
same torch optimizer: GPT-2, Llama, BERT pretraining heads on the MLM loss alone, T5,
a Mixtral-style mixture of experts and a PEFT LoRA (r=4 on q and v) on Llama; stages
0-3 on 2 and 3 gloo ranks.

Reference: DDP + torch AdamW(fused=True), the kernel zero_ext's fused AdamW equals bit
for bit. At 2 ranks, where the reduction order is the same (a sum of two is
commutative and 1/2 is exact), every tensor of every model in every stage must equal
DDP's bit for bit. At 3 ranks the sums run in another order, and Adam amplifies
rounding noise in near-zero gradients (cases.py), so the bound is a floor measured on
the same model and data in the same run: the largest per-tensor relative L2 difference
from the reference of torch's own rounding-level variants of the same training: AdamW
with foreach=False (the for-loop), DDP with one-parameter buckets (another gloo
summation order) and DDP summing before averaging (a comm hook; what stages 1-3 do).
Every tensor must be within twice that floor. Measured (lr 1e-2, 6 steps): zero_ext's
worst tensor is at 0.24-1.38x the floor; against the fused-vs-for-loop floor alone it
is at 0.68-6.4x (Llama stages 1-3 sum before averaging, and DDP doing the same moves
exactly as far: 1.00x that variant), so that narrower bound is not what is asserted.

BERT (10 steps): its pooler and next-sentence head, which the MLM loss gives no
gradient, stay bit-unchanged in every stage, as under DDP(find_unused_parameters=True)
+ AdamW, and are compared to DDP like every other tensor (tests/test_unused.py covers
unused parameters in depth).

Also (buffers keep their dtype): with param_dtype="bf16", Llama's RoPE inv_freq stays
fp32 and bit-equal to the plain model's in every stage, and cast_buffers=True casts it.
"""
import copy

import pytest
import torch
from torch import nn

from dist_harness import run_world

MODELS = ("gpt2", "llama", "bert", "t5", "mixtral", "lora")
STAGES = (0, 1, 2, 3)
STEPS = 6
VOCAB, SEQ, BATCH = 96, 12, 2
OPT = dict(lr=1e-2, weight_decay=0.1)


def build(name: str) -> nn.Module:
    import transformers as tf
    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(**small, bos_token_id=0, eos_token_id=0, n_positions=32,
                                                n_embd=32, n_layer=2, n_head=2,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if name in ("llama", "lora"):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**small, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=2, num_attention_heads=4,
                                                   num_key_value_heads=2, max_position_embeddings=64))
        if name == "lora":
            import peft
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                               target_modules=["q_proj", "v_proj"]))
        return model
    if name == "bert":
        return tf.BertForPreTraining(tf.BertConfig(**small, hidden_size=32, num_hidden_layers=2,
                                                   num_attention_heads=2, intermediate_size=64,
                                                   max_position_embeddings=64, hidden_dropout_prob=0.0,
                                                   attention_probs_dropout_prob=0.0))
    if name == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(**small, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                         num_heads=4, dropout_rate=0.0, pad_token_id=0,
                                                         decoder_start_token_id=0))
    if name == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**small, hidden_size=32, intermediate_size=48,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, num_local_experts=4,
                                                      num_experts_per_tok=2, max_position_embeddings=64))
    raise ValueError(name)


# BERT's pooler and next-sentence head get no gradient from the MLM loss: as under
# DDP(find_unused_parameters=True) + torch's optimizer, they must stay bit-unchanged
# (no weight decay; Note [Unused parameters] in csrc/engine/unused.cpp), over 10 steps.
UNUSED = {"bert": ("bert.pooler.", "cls.seq_relationship.")}
STEPS_OF = {"bert": 10}


def loss_of(name: str, model, rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    if name == "bert":                    # MLM only: 25% of the positions are predicted
        labels = torch.where(torch.rand(BATCH, SEQ, generator=g) < 0.25, ids, torch.full_like(ids, -100))
        labels[:, 0] = ids[:, 0]
        logits = model(input_ids=ids).prediction_logits
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    if name == "t5":
        target = torch.randint(0, VOCAB, (BATCH, SEQ // 2), generator=g)
        return model(input_ids=ids, labels=target).loss
    return model(input_ids=ids, labels=ids).loss


def train(name, model, opt, rank, wrapped=None):
    wrapped = wrapped or model
    for step in range(STEPS_OF.get(name, STEPS)):
        loss_of(name, wrapped, rank, step).backward()
        opt.step()
        opt.zero_grad()


def trainable(model):
    return [n for n, p in model.named_parameters() if p.requires_grad]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# The reference and torch's own rounding-level variants of the same training.
VARIANTS = (("fused", dict(fused=True)), ("loop", dict(foreach=False)), ("rebucketed", dict(fused=True)),
            ("reordered", dict(fused=True)))


def sum_then_average(state, bucket):
    """DDP's reduction in another order: sum the ranks' gradients, then scale by
    1/N (DDP's default hook scales first, then sums)."""
    import torch.distributed as dist
    world = dist.get_world_size()
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].mul_(1.0 / world))


def _parity_worker(rank, world):
    import zero_ext
    out = {}
    for name in MODELS:
        base = build(name)
        names = trainable(base)
        ends = {}
        variants = VARIANTS if world > 2 else VARIANTS[:1]    # 2 ranks: bit for bit, no floor needed
        for kind, kw in variants:
            model = copy.deepcopy(base)
            ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=name in UNUSED,
                                                      bucket_cap_mb=1e-4 if kind == "rebucketed" else 25)
            if kind == "reordered":
                ddp.register_comm_hook(None, sum_then_average)
            train(name, model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT, **kw),
                  rank, ddp)
            ends[kind] = {n: p.detach().clone() for n, p in model.named_parameters()}
        unused = [n for n in names if n.startswith(UNUSED.get(name, ()))]
        floors = {kind: max(rel(ends[kind][n], ends["fused"][n]) for n in names) for kind, _ in variants[1:]}
        for stage in STAGES:
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT)
            zm, zo = zero_ext.zeroify(model, opt, stage=stage)
            train(name, zm, zo, rank)
            sd = zm.state_dict()
            ref = ends["fused"]
            out[(name, stage)] = {
                "floors": floors,
                "rel": {n: rel(sd[n], ref[n]) for n in names},
                "equal": {n: torch.equal(sd[n], ref[n]) for n in names},
                "unused_changed": [n for n in unused if not torch.equal(sd[n], base.state_dict()[n])],
                "ddp_unused_changed": [n for n in unused if not torch.equal(ref[n], base.state_dict()[n])],
                "moved": sum((sd[n] - base.state_dict()[n]).abs().sum().item() for n in names)}
    return out


@pytest.fixture(scope="module", params=[2, 3])
def parity(request):
    pytest.importorskip("transformers", reason="transformers is a test dependency (make test installs it)")
    pytest.importorskip("peft", reason="peft is a test dependency (make test installs it)")
    return request.param, run_world(_parity_worker, request.param, timeout_s=600, reuse=True)


@pytest.mark.dist
@pytest.mark.parametrize("name", MODELS)
def test_hf_training_matches_ddp(parity, name):
    world, outs = parity
    for rank, out in enumerate(outs):
        for stage in STAGES:
            r = out[(name, stage)]
            assert r["moved"] > 0, f"{name} stage {stage}: nothing trained"
            assert not r["ddp_unused_changed"], f"{name}: DDP changed parameters no rank used?"
            assert not r["unused_changed"], (f"rank {rank}, {name} stage {stage}: parameters that no rank gave a "
                                             f"gradient changed: {r['unused_changed']}")
            if world == 2:
                differ = [n for n, eq in r["equal"].items() if not eq]
                assert not differ, (f"rank {rank}, {name} stage {stage}: not bit-equal to DDP: "
                                    f"{ {n: r['rel'][n] for n in differ} }")
            else:
                floor = max(r["floors"].values())
                over = {n: d for n, d in r["rel"].items() if d > 2 * floor}
                assert not over, (f"rank {rank}, {name} stage {stage}: tensors differ from DDP by more than twice "
                                  f"the floor {floor:.2e} of torch's own variants {r['floors']}: {over}")


def _buffers_worker(rank, world):
    import zero_ext
    plain = build("llama")
    ref = plain.model.rotary_emb.inv_freq.clone()
    out = {}
    for stage in STAGES:
        for cast in ("auto", True):
            model = copy.deepcopy(plain)
            zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), **OPT), stage=stage,
                                      param_dtype="bf16", cast_buffers=cast)
            loss_of("llama", zm, rank, 0).backward()       # RoPE runs with it
            zo.step()
            f = model.model.rotary_emb.inv_freq
            out[(stage, cast)] = (str(f.dtype), torch.equal(f.float(), ref))
    return out


@pytest.mark.dist
def test_bf16_llama_keeps_inv_freq_fp32():
    pytest.importorskip("transformers", reason="transformers is a test dependency (make test installs it)")
    for out in run_world(_buffers_worker, 2, timeout_s=600, reuse=True):
        for stage in STAGES:
            assert out[(stage, "auto")] == ("torch.float32", True), (stage, out[(stage, "auto")])
            assert out[(stage, True)][0] == "torch.bfloat16", (stage, out[(stage, True)])


def test_cast_buffers_option():
    """One process: "auto" casts only torch's normalization statistics (their kernels
    need the weight's dtype), False none, True every floating-point buffer; anything
    else is refused before any work."""
    import zero_ext

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)
            self.register_buffer("table", torch.linspace(0, 1, 4) / 3)

        def forward(self, x):
            return self.bn(self.lin(x)) * self.table.to(x.dtype)

    dtypes = {}
    for cast in ("auto", False, True):
        model = Net()
        table = model.table.clone()
        zm, _ = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), stage=2, param_dtype="bf16",
                                 cast_buffers=cast)
        if cast is not False:    # (False: BatchNorm would meet bf16 weights with fp32 statistics)
            zm(torch.randn(3, 4))
        dtypes[cast] = (model.bn.running_mean.dtype, model.table.dtype, torch.equal(model.table.float(), table))
    assert dtypes["auto"] == (torch.bfloat16, torch.float32, True)
    assert dtypes[False] == (torch.float32, torch.float32, True)
    assert dtypes[True][:2] == (torch.bfloat16, torch.bfloat16)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="cast_buffers must be 'auto', True or False"):
            zero_ext.ZeroConfig(cast_buffers=bad)
