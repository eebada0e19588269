"""Pretrained weights in and out of shards (zero_ext/pretrained/, Note [Pretrained weights
into shards], Note [Streaming save_pretrained]). Small Llama, GPT-2 and T5 configs saved
here with transformers' own save_pretrained (nothing downloaded), in the shapes a user
meets them: Llama in bf16 cut into several files with an index, GPT-2 as its base model
(names without "transformer.", the LM head tied to the embedding), T5 in fp16 (three
names tied to one embedding).

* Load: each model built on the meta device with from_config and zeroified with
  weights=<dir> at 1, 2 and 3 gloo ranks in stages 0-3 equals from_pretrained(dir,
  dtype=float32) bit for bit (every tensor, RoPE buffers, ties still ties); each rank
  reads only its fragments in stage 3 (the bytes the ranks read add up to the
  checkpoint's once) and nothing twice in fp32 stages 0-2. Three AdamW steps then equal
  DDP + torch's fused AdamW on from_pretrained's model bit for bit at 1-2 ranks (tensor
  sizes are multiples of 16: tests/test_hf_models.py), and at 3 ranks zeroify() of
  from_pretrained's model in the same stage.
* A classification head on the causal-LM checkpoint (allow_missing / allow_unexpected):
  the head is initialized by the model's init (HF's normal, std initializer_range), the
  same on every rank, named in a warning; training equals DDP from the same start.
* LoRA: the adapter is initialized as PEFT initializes it (B zero), trained, saved by
  zero_ext.save_pretrained and reloaded by PeftModel.from_pretrained equal to the
  trained adapter; training equals DDP + PEFT from the same start.
* A plain nn.Module: nothing the checkpoint fills is initialized first (reset_parameters
  calls counted), a "model." prefix is found, an allowed missing head is initialized
  once, from rank 0's draw.
* Round trip: trained, save_pretrained (sharded, with index; rank 0 gathering windows far
  smaller than a unit), then from_pretrained and zeroify(weights=) in another stage equal
  the trained weights bit for bit.
* Bad checkpoints raise zero_ext.CheckpointError on every rank, naming the problem,
  before any training collective: a missing key, a wrong shape, an unexpected key, a
  truncated file, a file missing on one rank only (the other ranks name that rank and the
  file), a pytorch_model.bin, a non-persistent buffer nothing computes; load_weights on a
  zeroified model the same. A rank killed in the middle of save_pretrained leaves the
  previous files loadable, and the other rank raises a CheckpointError naming the save.
"""
import copy
import os
import shutil
import warnings

import pytest
import torch
from torch import nn

from dist_harness import run_world

pytestmark = pytest.mark.dist

VOCAB, STEPS = 128, 3
OPT = dict(lr=1e-2, weight_decay=0.1)


def _configs():
    import transformers as tf
    return {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, max_position_embeddings=64,
                                                      pad_token_id=0)),
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                                   bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                                   attn_pdrop=0.0)),
        "t5": (tf.T5ForConditionalGeneration, tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                           num_heads=4, relative_attention_num_buckets=32,
                                                           dropout_rate=0.0, pad_token_id=0,
                                                           decoder_start_token_id=0)),
    }


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The checkpoints, written once by transformers itself."""
    pytest.importorskip("transformers", reason="transformers is a test dependency (make test installs it)")
    pytest.importorskip("peft", reason="peft is a test dependency (make test installs it)")
    root = tmp_path_factory.mktemp("pretrained")
    out = {"root": str(root)}
    for name, (cls, cfg) in _configs().items():
        torch.manual_seed(1)
        model = cls(copy.deepcopy(cfg))
        path = str(root / name)
        if name == "llama":
            model.to(torch.bfloat16).save_pretrained(path, max_shard_size="20KB")
        elif name == "gpt2":
            model.transformer.save_pretrained(path)                     # the base model: no "transformer."
        else:
            model.to(torch.float16).save_pretrained(path, max_shard_size="40KB")
        out[name] = path
    assert len([f for f in os.listdir(out["llama"]) if f.endswith(".safetensors")]) > 2
    assert len([f for f in os.listdir(out["t5"]) if f.endswith(".safetensors")]) > 1
    return out


def _loss(kind: str, model, rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(1, VOCAB, (2, 8), generator=g)
    if kind == "t5":
        return model(input_ids=ids, labels=torch.randint(1, VOCAB, (2, 4), generator=g)).loss
    if kind == "cls":
        return model(input_ids=ids, labels=torch.randint(0, 2, (2,), generator=g)).loss
    return model(input_ids=ids, labels=ids).loss


def _train(kind, model, opt, rank):
    for step in range(STEPS):
        _loss(kind, model, rank, step).backward()
        opt.step()
        opt.zero_grad()


def _ddp(kind, model, rank):
    """The reference: DDP + torch's fused AdamW (the kernel zero_ext's equals bit for bit)."""
    ddp = nn.parallel.DistributedDataParallel(model)
    _train(kind, ddp, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT, fused=True), rank)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _full(zm, zo) -> dict:
    import zero_ext
    return {k: v.clone() for k, v in zero_ext.consolidated_state_dict(zm, zo, to=None)["model"].items()}


def _differ(got: dict, ref: dict, keys=None) -> list:
    return [k for k in (keys or ref) if not torch.equal(got[k], ref[k])]


def _meta(cls, path, kind="causal"):
    import transformers as tf
    config = tf.AutoConfig.from_pretrained(path)
    if cls is tf.GPT2LMHeadModel:                 # the base model's config, for the LM head model
        config.architectures = None
    with torch.device("meta"):
        if kind == "causal" and cls is not tf.T5ForConditionalGeneration:
            return tf.AutoModelForCausalLM.from_config(config)
        return cls(config)


def _ties(model) -> list:
    """Names that share one parameter with an earlier name."""
    seen, out = {}, []
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.append((seen[id(p)], n))
        seen.setdefault(id(p), n)
    return out


def _parity_worker(rank, world, ckpts, cases):
    import zero_ext
    out = {}
    for name, stage, dtype in cases:
        cls = _configs()[name][0]
        ref = cls.from_pretrained(ckpts[name], dtype=torch.float32)
        ref_sd = {k: v.clone() for k, v in ref.state_dict().items()}
        ref_bufs = {k: b.clone() for k, b in ref.named_buffers()}
        model = _meta(cls, ckpts[name])
        zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), **OPT), stage=stage, weights=ckpts[name],
                                  param_dtype=dtype)
        r = {"load_differ": _differ(_full(zm, zo), ref_sd), "bytes": zm.weights_report.bytes_read,
             "ties": _ties(zm.module) == _ties(ref), "n_ties": len(_ties(ref)),
             "bufs_differ": [k for k, b in zm.module.named_buffers() if not torch.equal(b, ref_bufs[k])],
             "files": len(zm.weights_report.files)}
        _train(name, zm, zo, rank)
        trained = _full(zm, zo)
        names = [n for n, _ in ref.named_parameters()]
        if world <= 2 and dtype == "fp32":
            r["ddp_differ"] = _differ(trained, _ddp(name, copy.deepcopy(ref), rank), names)
        else:                             # from_pretrained + zeroify in the same stage
            twin = copy.deepcopy(ref)
            tm, to = zero_ext.zeroify(twin, torch.optim.AdamW(twin.parameters(), **OPT), stage=stage, param_dtype=dtype)
            _train(name, tm, to, rank)
            r["twin_differ"] = _differ(trained, _full(tm, to), names)
        r["moved"] = sum((trained[n] - ref_sd[n]).abs().sum().item() for n in names)
        if stage in (1, 3) and dtype == "fp32":   # round trip: sharded files, then two ways back in
            path = os.path.join(ckpts["root"], f"rt-{name}-{world}-{stage}")
            from zero_ext.pretrained import save as saving
            window, saving.WINDOW_BYTES = saving.WINDOW_BYTES, 4000   # many windows, across fragments' ends
            try:
                zero_ext.save_pretrained(zm, path, max_shard_size="30KB")
            finally:
                saving.WINDOW_BYTES = window
            back = cls.from_pretrained(path, dtype=torch.float32)
            r["rt_files"] = sorted(os.listdir(path))
            r["rt_hf_differ"] = _differ(back.state_dict(), trained)
            again = _meta(cls, path)
            am, ao = zero_ext.zeroify(again, torch.optim.AdamW(again.parameters(), **OPT), stage=3 - stage + 1,
                                      weights=path)
            r["rt_zero_differ"] = _differ(_full(am, ao), trained)
        out[(name, stage, dtype)] = r
    return out


def _checkpoint_bytes(path) -> int:
    from zero_ext.pretrained.files import read_entries
    return sum(e.nbytes for e in read_entries(path)[1].values())


CASES = {1: [("llama", 0, "fp32"), ("llama", 3, "fp32")],
         2: [(m, s, "fp32") for m in ("llama", "gpt2", "t5") for s in (0, 1, 2, 3)] + [("llama", 3, "bf16"),
                                                                                       ("llama", 2, "bf16")],
         3: [(m, s, "fp32") for m in ("llama", "gpt2", "t5") for s in (1, 3)]}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_load_equals_from_pretrained_and_trains_like_ddp(ckpts, world):
    outs = run_world(_parity_worker, world, ckpts, CASES[world], timeout_s=600, reuse=True)
    for case in CASES[world]:
        name, stage, dtype = case
        total = _checkpoint_bytes(ckpts[name])
        for rank, out in enumerate(outs):
            r = out[case]
            where = f"rank {rank}/{world}, {name} stage {stage} {dtype}"
            assert r["load_differ"] == [], f"{where}: not bit-equal to from_pretrained when loaded: {r['load_differ']}"
            assert r["bufs_differ"] == [], f"{where}: buffers differ from from_pretrained's: {r['bufs_differ']}"
            assert r["ties"], f"{where}: ties differ from from_pretrained's"
            assert r["moved"] > 0, f"{where}: nothing trained"
            if "ddp_differ" in r:
                assert r["ddp_differ"] == [], f"{where}: differs from from_pretrained + DDP: {r['ddp_differ']}"
            else:
                assert r["twin_differ"] == [], f"{where}: differs from zeroify(from_pretrained): {r['twin_differ']}"
            if "rt_files" in r:
                assert "model.safetensors.index.json" in r["rt_files"] and "config.json" in r["rt_files"], r["rt_files"]
                assert r["rt_hf_differ"] == [], f"{where}: from_pretrained(saved) != trained: {r['rt_hf_differ']}"
                assert r["rt_zero_differ"] == [], f"{where}: zeroify(weights=saved) != trained: {r['rt_zero_differ']}"
            if dtype == "fp32" and stage in (0, 1, 2):
                assert r["bytes"] == total, f"{where}: read {r['bytes']} bytes, the checkpoint holds {total}"
        if stage == 3:   # every byte read once, by the rank owning it
            read = [out[case]["bytes"] for out in outs]
            assert sum(read) == total, f"{name} stage 3 at {world} ranks: the ranks read {read}, {total} in the files"
            assert world == 1 or max(read) < total, read
    assert outs[0][CASES[world][0]]["files"] > 2                     # llama: several files and an index
    if world == 2:
        assert outs[0][("gpt2", 0, "fp32")]["n_ties"] == 1 and outs[0][("t5", 0, "fp32")]["n_ties"] == 3


# ----------------------------------------------------------------------------- a head, LoRA, a plain module
def _head_worker(rank, world, ckpts, stage):
    import transformers as tf
    import zero_ext
    from zero_ext import Weights
    config = tf.AutoConfig.from_pretrained(ckpts["llama"], num_labels=2)
    ref = tf.LlamaForSequenceClassification.from_pretrained(ckpts["llama"], num_labels=2, dtype=torch.float32)
    with torch.device("meta"):
        model = tf.LlamaForSequenceClassification(config)
    torch.manual_seed(1000 + rank)    # each rank draws other values: rank 0's must reach every rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), **OPT), stage=stage,
                                  weights=Weights(ckpts["llama"], allow_missing=["score"],
                                                  allow_unexpected=["lm_head"]))
    start = _full(zm, zo)
    names = [n for n, _ in ref.named_parameters()]
    out = {"base_differ": _differ(start, ref.state_dict(), [n for n in names if not n.startswith("score")]),
           "score_std": start["score.weight"].std().item(), "score": start["score.weight"],
           "warned": [str(w.message) for w in caught if "initialized by the model's init" in str(w.message)],
           "report": (zm.weights_report.missing, zm.weights_report.ignored)}
    _train("cls", zm, zo, rank)
    ref.score.weight.data.copy_(start["score.weight"])        # DDP from the same start
    out["ddp_differ"] = _differ(_full(zm, zo), _ddp("cls", ref, rank), names)
    return out


def _lora_worker(rank, world, ckpts, stage):
    import peft
    import transformers as tf
    import zero_ext
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(_meta(tf.LlamaForCausalLM, ckpts["llama"]), copy.deepcopy(lora))
    torch.manual_seed(1000 + rank)    # each rank draws other values: rank 0's must reach every rank
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT),
                              stage=stage, weights=zero_ext.Weights(ckpts["llama"], allow_missing=["lora_"]))
    start = _full(zm, zo)
    base = tf.LlamaForCausalLM.from_pretrained(ckpts["llama"], dtype=torch.float32)
    ref = peft.get_peft_model(copy.deepcopy(base), copy.deepcopy(lora))
    ref_sd = ref.state_dict()
    lora_names = [n for n in ref_sd if "lora_" in n]
    out = {"base_differ": _differ(start, ref_sd, [n for n in ref_sd if "lora_" not in n]),
           "b_zero": all(bool((start[n] == 0).all()) for n in lora_names if "lora_B" in n),
           "a_nonzero": all(bool((start[n] != 0).any()) for n in lora_names if "lora_A" in n)}
    _train("llama", zm, zo, rank)
    trained = _full(zm, zo)
    path = os.path.join(ckpts["root"], f"adapter-{world}-{stage}")
    zero_ext.save_pretrained(zm, path)
    out["files"] = sorted(os.listdir(path))
    back = peft.PeftModel.from_pretrained(copy.deepcopy(base), path)
    out["adapter_differ"] = _differ(back.state_dict(), trained, lora_names)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_" in n:
                p.copy_(start[n])                               # DDP + PEFT from the same start
    out["ddp_differ"] = _differ(trained, _ddp("llama", ref, rank), lora_names)
    out["moved"] = sum((trained[n] - start[n]).abs().sum().item() for n in lora_names)
    return out


RESETS = []


class Counted(nn.Linear):
    def reset_parameters(self):
        RESETS.append(tuple(self.weight.shape))
        super().reset_parameters()


class Plain(nn.Module):
    def __init__(self, new_head: bool = False):
        super().__init__()
        self.inp = Counted(16, 32)
        self.blocks = nn.ModuleList(Counted(32, 32) for _ in range(2))
        self.head = Counted(32, 16)
        if new_head:
            self.head2 = Counted(32, 96)   # over half the model: every rank holds a piece

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _plain_worker(rank, world, root, stage):
    import zero_ext
    from safetensors.torch import save_file
    torch.manual_seed(3)
    src = Plain()
    path = os.path.join(root, f"plain-{world}-{stage}.safetensors")
    if rank == 0:
        save_file({"model." + k: v for k, v in src.state_dict().items()}, path)   # a wrapper's names
    torch.distributed.barrier()
    out = {}
    for new in (False, True):     # True: a new head, allowed missing
        with torch.device("meta"):
            model = Plain(new)
        RESETS.clear()            # (the constructors ran reset_parameters() on the meta device)
        weights = zero_ext.Weights(path, allow_missing=["head2"] if new else ())
        torch.manual_seed(1000 + rank)    # each rank draws other values: rank 0's must reach every rank
        zm, zo = zero_ext.zeroify(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage, weights=weights)
        full = _full(zm, zo)
        out[new] = {"resets": list(RESETS), "differ": _differ(full, src.state_dict())}
        if new:
            torch.manual_seed(1000)       # what rank 0 drew: one Linear's reset_parameters()
            out[new]["rank0_draw"] = torch.equal(full["head2.weight"], nn.Linear(32, 96).weight.detach())
            if stage < 3:                 # the replicated parameter every rank computes with
                out[new]["replica"] = torch.equal(zm.module.head2.weight.detach(), full["head2.weight"])
    return out


@pytest.mark.parametrize("world,stage", [(2, 3), (3, 1)])
def test_new_head_lora_and_plain_module(ckpts, world, stage):
    heads = run_world(_head_worker, world, ckpts, stage, timeout_s=300, reuse=True)
    loras = run_world(_lora_worker, world, ckpts, stage, timeout_s=300, reuse=True)
    plains = run_world(_plain_worker, world, ckpts["root"], stage, timeout_s=300, reuse=True)
    import transformers as tf
    std = tf.LlamaConfig().initializer_range
    for rank in range(world):
        h, lo, pl = heads[rank], loras[rank], plains[rank]
        where = f"rank {rank}/{world}, stage {stage}"
        assert h["base_differ"] == [], f"{where}: classifier body != from_pretrained: {h['base_differ']}"
        assert 0.5 * std < h["score_std"] < 1.5 * std, f"{where}: the new head's std {h['score_std']}, init's {std}"
        assert torch.equal(h["score"], heads[0]["score"]), f"{where}: the new head differs across ranks"
        assert h["report"] == (["score.weight"], ["lm_head.weight"]), h["report"]
        assert (rank == 0) == bool(h["warned"]) and (rank != 0 or "score.weight" in h["warned"][0]), h["warned"]
        if world <= 2:
            assert h["ddp_differ"] == [], f"{where}: the classifier's training != DDP: {h['ddp_differ']}"
        assert lo["base_differ"] == [], f"{where}: LoRA base != from_pretrained: {lo['base_differ']}"
        assert lo["b_zero"] and lo["a_nonzero"], f"{where}: LoRA not initialized as PEFT initializes it"
        assert lo["moved"] > 0 and "adapter_model.safetensors" in lo["files"] and "adapter_config.json" in lo["files"]
        assert lo["adapter_differ"] == [], f"{where}: PeftModel.from_pretrained != trained: {lo['adapter_differ']}"
        if world <= 2:
            assert lo["ddp_differ"] == [], f"{where}: LoRA training != DDP + PEFT: {lo['ddp_differ']}"
        assert pl[False]["resets"] == [], f"{where}: the checkpoint's tensors were initialized: {pl[False]['resets']}"
        assert pl[True]["resets"] == [(96, 32)], f"{where}: only the new head is initialized: {pl[True]['resets']}"
        assert pl[False]["differ"] == [] and pl[True]["differ"] == [], (pl[False]["differ"], pl[True]["differ"])
        assert pl[True]["rank0_draw"], f"{where}: the new head is not rank 0's draw"
        assert pl[True].get("replica", True), f"{where}: the new head's replica differs from its master"


# ----------------------------------------------------------------------------- failures
def _bad_checkpoints(root: str, llama: str) -> dict:
    """case -> checkpoint path (per rank: {rank: path} for the one missing on one rank)."""
    from safetensors.torch import load_file, save_file
    files = sorted(f for f in os.listdir(llama) if f.endswith(".safetensors"))
    tensors = {}
    for f in files:
        tensors.update(load_file(os.path.join(llama, f)))
    out = {}

    def write(case, sd):
        os.makedirs(os.path.join(root, case), exist_ok=True)
        shutil.copy(os.path.join(llama, "config.json"), os.path.join(root, case))
        save_file(sd, os.path.join(root, case, "model.safetensors"))
        out[case] = os.path.join(root, case)

    write("missing", {k: v for k, v in tensors.items() if k != "model.norm.weight"})
    write("shape", {**tensors, "model.norm.weight": torch.ones(31, dtype=torch.bfloat16)})
    write("unexpected", {**tensors, "model.extra.weight": torch.ones(4, dtype=torch.bfloat16)})
    trunc = os.path.join(root, "truncated")
    shutil.copytree(llama, trunc)
    with open(os.path.join(trunc, files[1]), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(trunc, files[1])) - 100)
    out["truncated"] = trunc
    for r in range(3):
        shutil.copytree(llama, os.path.join(root, f"node{r}"))
    os.remove(os.path.join(root, "node1", files[0]))                # only rank 1's copy lacks it
    out["one_rank"] = {r: os.path.join(root, f"node{r}") for r in range(3)}
    os.makedirs(os.path.join(root, "bin"))
    torch.save(tensors, os.path.join(root, "bin", "pytorch_model.bin"))
    out["bin"] = os.path.join(root, "bin")
    out["_missing_file"] = files[0]
    return out


class Table(nn.Module):
    """A non-persistent buffer computed in the constructor (lost on the meta device)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("freq", torch.arange(16.0), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.freq


def _failure_worker(rank, world, ckpts, bad):
    import transformers as tf
    import zero_ext
    out = {}
    cases = ["missing", "shape", "unexpected", "truncated", "one_rank", "bin"]
    for case in cases:
        path = bad[case][rank] if case == "one_rank" else bad[case]
        model = _meta(tf.LlamaForCausalLM, ckpts["llama"])
        try:
            zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), stage=3, weights=path)
            out[case] = None
        except zero_ext.CheckpointError as e:
            out[case] = str(e)
    with torch.device("meta"):
        table = Table()
    path = os.path.join(ckpts["root"], "table.safetensors")
    if rank == 0:
        from safetensors.torch import save_file
        save_file({"lin.weight": torch.zeros(16, 16), "lin.bias": torch.zeros(16)}, path)
    torch.distributed.barrier()
    try:
        zero_ext.zeroify(table, torch.optim.AdamW(table.parameters()), stage=3, weights=path)
        out["buffer"] = None
    except RuntimeError as e:
        out["buffer"] = str(e)
    # load_weights into a zeroified model: its own agreement
    model = tf.LlamaForCausalLM.from_pretrained(ckpts["llama"], dtype=torch.float32)
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters()), stage=2)
    try:
        zero_ext.load_weights(zm, bad["one_rank"][rank])
        out["load_weights"] = None
    except zero_ext.CheckpointError as e:
        out["load_weights"] = str(e)
    _train("llama", zm, zo, rank)             # nothing was left pending: training goes on
    return out


def _killed_worker(rank, world, ckpts):
    import signal

    import transformers as tf
    import zero_ext
    from zero_ext.comm import Comm
    path = os.path.join(ckpts["root"], "killed")
    model = _meta(tf.LlamaForCausalLM, ckpts["llama"])
    zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), **OPT), stage=3, weights=ckpts["llama"])
    zero_ext.save_pretrained(zm, path, max_shard_size="30KB")
    first = _full(zm, zo)
    _train("llama", zm, zo, rank)
    if rank == 1:
        gather, calls = Comm.gather_to, []

        def dies(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3:                     # in the middle of streaming the units
                os.kill(os.getpid(), signal.SIGKILL)
            return gather(self, *args, **kwargs)
        Comm.gather_to = dies
    try:
        zero_ext.save_pretrained(zm, path, max_shard_size="30KB")
        error = None
    except zero_ext.CheckpointError as e:
        error = str(e)
    back = tf.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {"error": error, "old_kept": _differ(back.state_dict(), first) == []}


def test_bad_checkpoints_fail_on_every_rank(ckpts):
    bad = _bad_checkpoints(os.path.join(ckpts["root"], "bad"), ckpts["llama"])
    outs = run_world(_failure_worker, 3, ckpts, bad, timeout_s=300)
    gone = bad["_missing_file"]
    for rank, out in enumerate(outs):
        where = f"rank {rank}"
        for case, needles in (("missing", ["model.norm.weight", "not in the checkpoint", "allow_missing"]),
                              ("shape", ["model.norm.weight", "[31]", "[32]"]),
                              ("unexpected", ["model.extra.weight", "allow_unexpected"]),
                              ("truncated", ["truncated"]),
                              ("bin", ["safetensors", "pytorch_model.bin"])):
            assert out[case] is not None and all(n in out[case] for n in needles), (where, case, out[case])
        assert out["one_rank"] is not None and gone in out["one_rank"] and "missing" in out["one_rank"], out["one_rank"]
        if rank != 1:
            assert "rank(s) [1]" in out["one_rank"], (where, out["one_rank"])
        assert out["load_weights"] is not None and gone in out["load_weights"], (where, out["load_weights"])
        assert out["buffer"] is not None and "'freq'" in out["buffer"], out["buffer"]
        assert "uninitialized" in out["buffer"], out["buffer"]


def test_killed_rank_leaves_the_old_files(ckpts):
    outs = run_world(_killed_worker, 2, ckpts, timeout_s=120, expect_errors=True)
    assert not outs[1]["ok"], "rank 1 was to be killed"
    assert outs[0]["ok"], outs[0]
    r = outs[0]["result"]
    assert r["error"] is not None and "save_pretrained" in r["error"] and "died" in r["error"], r["error"]
    assert r["old_kept"], "the previous save_pretrained's files changed"


def test_weights_path_spellings():
    """A path as str, bytes or os.PathLike names the same checkpoint; anything else is refused."""
    import pathlib

    from zero_ext.pretrained.load import Weights, as_weights
    for spelling in ("/ckpt/dir", b"/ckpt/dir", pathlib.Path("/ckpt/dir")):
        assert as_weights(spelling, prefix="model.") == Weights("/ckpt/dir", prefix="model."), spelling
    with pytest.raises(TypeError, match="checkpoint path or zero_ext.Weights"):
        as_weights(3)
