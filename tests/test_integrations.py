"""Framework integrations (zero_ext/integrations/, docs/integrations.md), each against
the same framework's own DDP run on 2 CPU gloo ranks: PyTorch Lightning's ZeroStrategy
vs strategy="ddp", the Hugging Face ZeroTrainer vs Trainer, Accelerate's prepare()
vs accelerator.prepare(). Every run clips gradients with the framework's own option
(and the reference shows that clipping engages at every step), accumulates gradients
over 2 micro-batches, saves a checkpoint mid-run and resumes from it in a fresh
model/trainer. Compared: each micro-batch's loss, the final weights and optimizer
states of the uninterrupted run, and the same after the resume.

The ranks are real processes joined by a gloo group (dist_harness.run_world) with
the environment torchrun sets, so each framework runs as under torchrun. Each
framework's cases share one pair of processes (one import of the framework).
"""
from __future__ import annotations

import os

import pytest
import torch

from dist_harness import run_world

WORLD = 2
CLIP_NORM = 0.05      # below every step's gradient norm in these runs (checked on the DDP reference)
CLIP_VALUE = 0.004    # below every step's largest gradient element (checked likewise)
# zero_ext folds the clipping factor into its fused step (and clamps the unscaled gradient
# shard for clip-by-value), so the last bit of float32 rounding differs from torch's
# clip-then-step: measured at most 1.2e-7 on losses and weights and 1.6e-9 on Adam's
# states, in every stage. Ignoring the clipping (factor ~0.06 here) or resuming without
# the optimizer state moves them by orders of magnitude more.
TOL = dict(rtol=1e-5, atol=1e-6)          # losses, gradient norms, weights
STATE_TOL = dict(rtol=1e-4, atol=1e-8)    # optimizer states (exp_avg_sq ~1e-4)


def _torchrun_env(rank: int, world: int) -> None:
    """What torchrun exports (the group itself is already up: the frameworks join it)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      NODE_RANK="0", GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                      OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def _regression_data(n: int = 48, d_in: int = 16, d_out: int = 4):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, d_out, generator=g)
    return x, y


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def _grad_stats(params) -> tuple[float, float] | None:
    """(global 2-norm, largest |element|) of the gradients, where every one is present (DDP)."""
    grads = [p.grad for p in params if p.requires_grad]
    if not grads or any(g is None for g in grads):
        return None
    return (float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))),
            max(float(g.abs().max()) for g in grads))


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=lambda m, k=k: f"{what} {k!r}: {m}")


def _assert_optimizer_same(got: dict, want: dict, what: str) -> None:
    """Two torch optimizer state dicts: the same per-parameter states and step counts."""
    assert sorted(got["state"]) == sorted(want["state"]), f"{what}: parameters with state differ"
    for i, st in want["state"].items():
        for k, v in st.items():
            w = v if torch.is_tensor(v) else torch.tensor(v)
            g = got["state"][i][k]
            g = g if torch.is_tensor(g) else torch.tensor(g)
            tol = STATE_TOL if w.dim() else dict(rtol=0, atol=0)     # step counts: exact
            torch.testing.assert_close(g.to(w.dtype), w, **tol, msg=lambda m, i=i, k=k: f"{what} param {i} {k}: {m}")


def _max_diff(got: dict, want: dict) -> float:
    return max((float((got[k].double() - want[k].double()).abs().max()) for k in want if want[k].numel()),
               default=0.0)


# ============================================================================ Lightning
LIGHTNING_CASES = [  # (name, strategy, gradient_clip_algorithm); "-16": MixedPrecision("16-mixed", "cpu")
    ("ddp-norm", "ddp", "norm"),
    ("ddp-value", "ddp", "value"),
    ("ddp-norm-16", "ddp", "norm"),
    ("stage1-norm", "zero_ext_stage1", "norm"),
    ("stage2-norm", "zero_ext_stage2", "norm"),
    ("stage3-norm", "zero_ext_stage3", "norm"),
    ("stage2-value", "zero_ext_stage2", "value"),
    ("stage3-value", "zero_ext_stage3", "value"),
    ("stage1-norm-16", "zero_ext_stage1", "norm"),
    ("stage3-norm-16", "zero_ext_stage3", "norm"),
]
# fp16 autocast with Lightning's GradScaler (Note [GradScaler on sharded gradients] in zero_ext/amp.py):
# the bound for autocast runs against DDP's
AMP_TOL = dict(rtol=1e-2, atol=1e-5)


def _lightning_module_class():
    import lightning as L

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()
            self.losses: list = []
            self.grad_stats: list = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.detach().clone())
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def on_before_optimizer_step(self, optimizer):
            stats = _grad_stats(self.parameters())     # before Lightning clips (DDP's p.grad)
            if stats is not None:
                self.grad_stats.append(stats)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Regressor


def _lightning_fit(strategy: str, algorithm: str, ckpt_dir: str, ckpt_path: str | None = None, amp: bool = False):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader, TensorDataset

    model = _lightning_module_class()()
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, num_nodes=1, strategy=strategy, max_epochs=2,
        plugins=[MixedPrecision("16-mixed", "cpu")] if amp else None,
        gradient_clip_val=CLIP_NORM if algorithm == "norm" else CLIP_VALUE, gradient_clip_algorithm=algorithm,
        accumulate_grad_batches=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1)])
    # 48 samples, 4 per batch and rank, 2 micro-batches per step: 3 optimizer steps per epoch
    trainer.fit(model, DataLoader(TensorDataset(*_regression_data()), batch_size=4), ckpt_path=ckpt_path)
    model.final_scale = trainer.precision_plugin.scaler.get_scale() if amp else None
    return model


def _lightning_validate(strategy: str, ckpt_path: str) -> float:
    """validate(ckpt_path=...) in a fresh Trainer: the checkpoint's weights, not fitting."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    trainer = L.Trainer(accelerator="cpu", devices=WORLD, num_nodes=1, strategy=strategy, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(TensorDataset(*_regression_data()), batch_size=4)
    metrics = trainer.validate(_lightning_module_class()(), loader, ckpt_path=ckpt_path, verbose=False)
    return float(metrics[0]["val_loss"])


def _lightning_final(path: str, rank: int, scratch: str):
    """The full weights and optimizer state of a checkpoint (rank 0; None elsewhere)."""
    if rank != 0:
        return None
    if os.path.isdir(path):                  # ZeroStrategy's: a zero_ext checkpoint directory
        from zero_ext.integrations.lightning import to_lightning_checkpoint

        out = os.path.join(scratch, "converted.ckpt")
        to_lightning_checkpoint(path, out)
        path = out
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    return {"state_dict": {k: v.clone() for k, v in ckpt["state_dict"].items()},
            "optimizer": ckpt["optimizer_states"][0], "global_step": ckpt["global_step"]}


def _lightning_cases(rank: int, world: int, cases: list, root: str) -> dict:
    _torchrun_env(rank, world)
    import zero_ext.integrations.lightning  # noqa: F401  (registers the "zero_ext_stage*" strategies)

    out = {}
    for name, strategy, algorithm in cases:
        first_dir, resumed_dir = os.path.join(root, name, "first"), os.path.join(root, name, "resumed")
        amp = name.endswith("-16")
        first = _lightning_fit(strategy, algorithm, first_dir, amp=amp)
        resumed = _lightning_fit(strategy, algorithm, resumed_dir, ckpt_path=os.path.join(first_dir, "epoch=0.ckpt"),
                                 amp=amp)
        out[name] = {
            "losses": torch.stack(first.losses), "resumed_losses": torch.stack(resumed.losses),
            "grad_stats": first.grad_stats,
            "final": _lightning_final(os.path.join(first_dir, "epoch=1.ckpt"), rank, os.path.join(root, name)),
            "resumed_final": _lightning_final(os.path.join(resumed_dir, "epoch=1.ckpt"), rank,
                                              os.path.join(root, name)),
            "saved_dir": os.path.isdir(os.path.join(first_dir, "epoch=0.ckpt")),
            "scale": first.final_scale, "resumed_scale": resumed.final_scale,
            "val_loss": _lightning_validate(strategy, os.path.join(first_dir, "epoch=1.ckpt")),
        }
    return out


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (make test installs lightning)")
    return run_world(_lightning_cases, WORLD, LIGHTNING_CASES, str(tmp_path_factory.mktemp("lightning")),
                     timeout_s=900)


def _check_reference(ref: list, algorithm: str) -> None:
    """The DDP reference: clipping engaged at every step, and its own resume reproduces it."""
    for r in ref:
        assert len(r["grad_stats"]) == 6, r["grad_stats"]
        for norm, largest in r["grad_stats"]:
            assert (norm > 2 * CLIP_NORM) if algorithm == "norm" else (largest > 2 * CLIP_VALUE), r["grad_stats"]
        torch.testing.assert_close(r["resumed_losses"], r["losses"][6:], rtol=0, atol=0)
    _assert_same(ref[0]["resumed_final"]["state_dict"], ref[0]["final"]["state_dict"], "DDP resumed")


@pytest.mark.dist
@pytest.mark.parametrize("case", [c[0] for c in LIGHTNING_CASES if c[1] != "ddp"])
def test_lightning_strategy_matches_ddp(lightning_runs, case):
    algorithm = case.split("-")[1]
    amp = case.endswith("-16")
    ref = [per_rank[f"ddp-{algorithm}" + ("-16" if amp else "")] for per_rank in lightning_runs]
    got = [per_rank[case] for per_rank in lightning_runs]
    _check_reference(ref, algorithm)
    tol = AMP_TOL if amp else TOL
    assert got[0]["saved_dir"], "ZeroStrategy's checkpoint is a zero_ext directory"
    for r in range(WORLD):   # every micro-batch loss on every rank; 12 before, 6 after the resume
        assert got[r]["losses"].shape == (12,) and got[r]["resumed_losses"].shape == (6,)
        torch.testing.assert_close(got[r]["losses"], ref[r]["losses"], **tol)
        torch.testing.assert_close(got[r]["resumed_losses"], ref[r]["resumed_losses"], **tol)
        # the gradients Lightning clips (unscaled, before clipping: Note [Sharded gradients]) as DDP's
        torch.testing.assert_close(torch.tensor(got[r]["grad_stats"]), torch.tensor(ref[r]["grad_stats"]), **tol)
        # GradScaler's scale (and its state through the checkpoint) as DDP's, on every rank
        assert (got[r]["scale"], got[r]["resumed_scale"]) == (ref[r]["scale"], ref[r]["resumed_scale"]), (got, ref)
    # validate(ckpt_path=...) outside fit: the full weights read from the checkpoint directory
    assert abs(got[0]["val_loss"] - ref[0]["val_loss"]) <= tol["rtol"] * ref[0]["val_loss"], (got[0], ref[0])
    for key in ("final", "resumed_final"):
        g, w = got[0][key], ref[0][key]
        print(f"{case} {key}: max |weight - DDP's| = {_max_diff(g['state_dict'], w['state_dict']):.3g}")
        assert g["global_step"] == w["global_step"] == 6
        if amp:
            torch.testing.assert_close(g["state_dict"], w["state_dict"], **AMP_TOL)
        else:
            _assert_same(g["state_dict"], w["state_dict"], f"{case} {key} weights")
            _assert_optimizer_same(g["optimizer"], w["optimizer"], f"{case} {key} optimizer")


def test_lightning_strategy_names():
    pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (make test installs lightning)")
    from lightning.pytorch.strategies import StrategyRegistry

    from zero_ext.integrations.lightning import ZeroStrategy
    for stage in range(4):
        assert StrategyRegistry[f"zero_ext_stage{stage}"]["strategy"] is ZeroStrategy
        assert StrategyRegistry[f"zero_ext_stage{stage}"]["init_params"]["stage"] == stage
    with pytest.raises(ValueError, match="bucket_byts"):
        ZeroStrategy(stage=2, bucket_byts=1 << 20)


def test_lightning_16_mixed_refused_with_zero_ext_loss_scaling():
    """Lightning's GradScaler cannot drive an optimizer that scales the loss itself or steps in
    backward: refused at setup, naming the fix (Note [GradScaler on sharded gradients])."""
    pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (make test installs lightning)")
    from lightning.pytorch.plugins.precision import MixedPrecision

    from zero_ext.integrations.lightning import ZeroStrategy
    for options, fix in ((dict(param_dtype="fp16"), "param_dtype='fp16'"),
                         (dict(step_in_backward=True), "step_in_backward=False")):
        strategy = ZeroStrategy(stage=2, precision_plugin=MixedPrecision("16-mixed", "cpu"), **options)
        with pytest.raises(ValueError, match="'16-mixed'.*GradScaler") as e:
            strategy._check_precision()
        assert fix in str(e.value), e.value
    ZeroStrategy(stage=2, precision_plugin=MixedPrecision("16-mixed", "cpu"))._check_precision()   # accepted


@pytest.mark.dist
def test_import_zero_ext_imports_no_framework():
    """`import zero_ext` stays framework-free: the integrations are imported explicitly."""
    import subprocess
    import sys

    code = ("import sys, zero_ext; bad = [m for m in ('lightning', 'pytorch_lightning', 'transformers', "
            "'accelerate') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# ============================================================================ Hugging Face Trainer
HF_CASES = [None, 2, 3]   # None: the Trainer itself (Accelerate's DDP); else ZeroTrainer(zero_stage=...)
HF_BF16_CASES = [None, 2]   # bf16=True: ZeroTrainer runs the forward under autocast as the Trainer does


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _token_data(n: int = 48, length: int = 12) -> list:
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(0, 64, (n, length), generator=g)
    return [{"input_ids": t, "labels": t.clone()} for t in ids]


def _hf_train(stage, out_dir: str, resume: str | None = None, bf16: bool = False) -> list:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from zero_ext.integrations.hf import ZeroTrainer

    logged = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged.append((state.global_step, logs["loss"], logs["grad_norm"]))

    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6,
        learning_rate=3e-3, weight_decay=0.1, max_grad_norm=CLIP_NORM, lr_scheduler_type="linear", warmup_steps=1,
        optim="adamw_torch", save_strategy="steps", save_steps=3, logging_steps=1, report_to="none", use_cpu=True,
        ddp_backend="gloo", seed=0, disable_tqdm=True, dataloader_num_workers=0, bf16=bf16)
    kw = dict(model=_tiny_gpt2(), args=args, train_dataset=_token_data(), callbacks=[Record()])
    trainer = Trainer(**kw) if stage is None else ZeroTrainer(**kw, zero_stage=stage)
    trainer.train(resume_from_checkpoint=resume)
    return logged


def _hf_checkpoint(path: str) -> dict:
    """A checkpoint-N directory's full weights and plain torch optimizer state."""
    from safetensors.torch import load_file

    from zero_ext.checkpoint import consolidate
    from zero_ext.integrations.hf import ZERO_DIR

    weights = load_file(os.path.join(path, "model.safetensors"))
    if os.path.isdir(os.path.join(path, ZERO_DIR)):
        optimizer = consolidate(os.path.join(path, ZERO_DIR))["optimizer"]
    else:
        optimizer = torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu", weights_only=True)
    return {"weights": weights, "optimizer": optimizer}


def _hf_cases(rank: int, world: int, cases: list, bf16_cases: list, root: str) -> dict:
    _torchrun_env(rank, world)
    out = {("bf16", stage): _hf_train(stage, os.path.join(root, f"bf16-{stage}"), bf16=True) for stage in bf16_cases}
    for stage in cases:
        first, resumed = os.path.join(root, f"{stage}", "first"), os.path.join(root, f"{stage}", "resumed")
        logged = _hf_train(stage, first)
        resumed_logged = _hf_train(stage, resumed, resume=os.path.join(first, "checkpoint-3"))
        out[stage] = {"logged": logged, "resumed_logged": resumed_logged,
                      "final": _hf_checkpoint(os.path.join(first, "checkpoint-6")) if rank == 0 else None,
                      "resumed_final": _hf_checkpoint(os.path.join(resumed, "checkpoint-6")) if rank == 0 else None}
    return out


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")
    pytest.importorskip("accelerate", reason="accelerate is not installed (make test installs it)")
    return run_world(_hf_cases, WORLD, HF_CASES, HF_BF16_CASES, str(tmp_path_factory.mktemp("hf")), timeout_s=900)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [s for s in HF_BF16_CASES if s is not None])
def test_hf_trainer_bf16_autocast_matches_ddp(hf_runs, stage):
    """TrainingArguments(bf16=True): the zeroified model's forward runs under autocast, as the
    model the Trainer hands to Accelerate (before, ZeroTrainer left it in fp32)."""
    ref, got, fp32 = hf_runs[0][("bf16", None)], hf_runs[0][("bf16", stage)], hf_runs[0][None]["logged"]
    as_tensor = lambda logged: torch.tensor([v[1:] for v in logged], dtype=torch.float64)   # noqa: E731
    assert [s for s, _, _ in got] == [s for s, _, _ in ref] == [1, 2, 3, 4, 5, 6]
    ref, got, fp32 = as_tensor(ref), as_tensor(got), as_tensor(fp32)
    _first_step_in_bf16_as_ref(got[0], ref[0], fp32[0])
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-5)


def _first_step_in_bf16_as_ref(got, ref, fp32):
    """The first optimizer step's figures (losses, grad norm) of bf16-autocast runs from the
    same weights and batches: zero_ext's are the reference's (1e-6) and the reference's are
    not fp32's (the Trainer's grad norm is 1e-4 relative off fp32's). Only the first step:
    from the second on, the two AdamW updates differ in the last bit of some fp32 weight,
    which can flip a bf16 rounding, and the runs drift apart by as much as the fp32 run is
    away (seen: steps 1-3 bit-equal to the Trainer's, then 2.5e-4 apart in the 6th step's
    grad norm on an Intel Xeon with AMX, where fp32's was 7.4e-4), so the later steps are
    held to rtol 1e-2 only."""
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    assert float(((ref - fp32).abs() / fp32.abs()).max()) > 1e-5, \
        f"the reference's first step is fp32's, not bf16's: {ref.tolist()} vs {fp32.tolist()}"


@pytest.mark.dist
@pytest.mark.parametrize("stage", [s for s in HF_CASES if s is not None])
def test_hf_trainer_matches_ddp(hf_runs, stage):
    ref, got = hf_runs[0][None], hf_runs[0][stage]
    # the reference: 6 logged steps, every one clipped, and its resume logs steps 4-6 as before
    assert [s for s, _, _ in ref["logged"]] == [1, 2, 3, 4, 5, 6]
    assert all(norm > 2 * CLIP_NORM for _, _, norm in ref["logged"]), ref["logged"]
    assert ref["resumed_logged"] == ref["logged"][3:]
    for key in ("logged", "resumed_logged"):   # (step, loss, grad_norm before clipping), as the Trainer logs them
        assert [s for s, _, _ in got[key]] == [s for s, _, _ in ref[key]]
        torch.testing.assert_close(torch.tensor([v[1:] for v in got[key]], dtype=torch.float64),
                                   torch.tensor([v[1:] for v in ref[key]], dtype=torch.float64), **TOL)
    for key in ("final", "resumed_final"):
        g, w = got[key], ref[key]
        print(f"HF stage {stage} {key}: max |weight - DDP's| = {_max_diff(g['weights'], w['weights']):.3g}")
        _assert_same(g["weights"], w["weights"], f"HF stage {stage} {key} weights")
        _assert_optimizer_same(g["optimizer"], w["optimizer"], f"HF stage {stage} {key} optimizer")


# ============================================================================ Accelerate
ACCELERATE_CASES = [None, 2, 3]   # None: accelerator.prepare (DDP); else zero_ext's prepare(stage=...)
# mixed_precision="bf16": prepare() runs the forward under autocast as accelerator.prepare() does
ACCELERATE_BF16_CASES = [None, 3]


def _accelerate_run(stage, ckpt: str, resume: bool, mixed_precision: str = "no") -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader, TensorDataset

    import zero_ext
    from zero_ext.integrations.accelerate import prepare, save_model

    if AcceleratorState._shared_state.get("_mixed_precision", mixed_precision) != mixed_precision:
        AcceleratorState._reset_state()     # one process runs both precisions (Accelerate's own tests do so)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, mixed_precision=mixed_precision)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = DataLoader(TensorDataset(*_regression_data()), batch_size=4)
    if stage is None:
        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    else:
        model, opt, loader, sched = prepare(accelerator, model, opt, loader, sched, stage=stage)
    losses, norms = [], []

    def epoch():
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                losses.append(loss.detach().clone())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP_NORM)))
                opt.step()
                sched.step()
                opt.zero_grad()

    if resume:
        accelerator.load_state(ckpt)
    else:
        epoch()
        accelerator.save_state(ckpt)
    epoch()
    if stage is None:
        full = {"model": accelerator.unwrap_model(model).state_dict(), "optimizer": opt.state_dict()}
    else:
        full = zero_ext.consolidated_state_dict(model, opt.optimizer)   # rank 0; None elsewhere
    final = None if full is None else {"weights": {k: v.clone() for k, v in full["model"].items()},
                                       "optimizer": full["optimizer"]}
    if stage is None:
        accelerator.save_model(model, ckpt + "-model")
        accelerator.wait_for_everyone()
    else:
        save_model(accelerator, model, ckpt + "-model")    # every rank; rank 0 writes
    if accelerator.is_main_process:
        from safetensors.torch import load_file

        final["saved_model"] = load_file(os.path.join(ckpt + "-model", "model.safetensors"))
    accelerator.free_memory()
    return {"losses": torch.stack(losses), "norms": norms, "final": final}


def _accelerate_cases(rank: int, world: int, cases: list, bf16_cases: list, root: str) -> dict:
    _torchrun_env(rank, world)
    out = {}
    for stage in cases:
        ckpt = os.path.join(root, f"{stage}")
        out[stage] = {"first": _accelerate_run(stage, ckpt, resume=False),
                      "resumed": _accelerate_run(stage, ckpt, resume=True)}
        if stage is not None and rank == 0:
            out[stage]["files"] = sorted(os.listdir(ckpt))
    for stage in bf16_cases:
        ckpt = os.path.join(root, f"bf16-{stage}")
        out[("bf16", stage)] = {"first": _accelerate_run(stage, ckpt, resume=False, mixed_precision="bf16")}
    return out


@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory):
    pytest.importorskip("accelerate", reason="accelerate is not installed (make test installs it)")
    return run_world(_accelerate_cases, WORLD, ACCELERATE_CASES, ACCELERATE_BF16_CASES,
                     str(tmp_path_factory.mktemp("accelerate")), timeout_s=900)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [s for s in ACCELERATE_BF16_CASES if s is not None])
def test_accelerate_bf16_autocast_matches_ddp(accelerate_runs, stage):
    """mixed_precision="bf16": the zeroified model's forward runs under autocast, as the model
    accelerator.prepare() wraps in DDP (before, prepare() left it in fp32: off by far more)."""
    for r in range(WORLD):
        ref, got = accelerate_runs[r][("bf16", None)]["first"], accelerate_runs[r][("bf16", stage)]["first"]
        fp32 = accelerate_runs[r][None]["first"]
        # the first optimizer step: its 2 micro-steps' losses (gradient_accumulation_steps=2), its norm
        first = [torch.tensor([*run["losses"][:2].tolist(), run["norms"][0]], dtype=torch.float64)
                 for run in (got, ref, fp32)]
        _first_step_in_bf16_as_ref(*first)
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-2, atol=1e-5)
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-2, atol=1e-5)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [s for s in ACCELERATE_CASES if s is not None])
def test_accelerate_prepare_matches_ddp(accelerate_runs, stage):
    for r in range(WORLD):
        ref, got = accelerate_runs[r][None], accelerate_runs[r][stage]
        assert len(ref["first"]["norms"]) == 6 and all(n > 2 * CLIP_NORM for n in ref["first"]["norms"])
        torch.testing.assert_close(ref["resumed"]["losses"], ref["first"]["losses"][6:], rtol=0, atol=0)
        for key in ("first", "resumed"):
            torch.testing.assert_close(got[key]["losses"], ref[key]["losses"], **TOL)
            torch.testing.assert_close(torch.tensor(got[key]["norms"]), torch.tensor(ref[key]["norms"]), **TOL)
    files = accelerate_runs[0][stage]["files"]
    assert "zero_ext" in files and "optimizer.bin" not in files, files   # no rank-0-only optimizer file
    for key in ("first", "resumed"):
        g, w = accelerate_runs[0][stage][key]["final"], accelerate_runs[0][None][key]["final"]
        print(f"Accelerate stage {stage} {key}: max |weight - DDP's| = {_max_diff(g['weights'], w['weights']):.3g}")
        _assert_same(g["weights"], w["weights"], f"Accelerate stage {stage} {key} weights")
        _assert_same(g["saved_model"], g["weights"], f"Accelerate stage {stage} {key} save_model")
        _assert_same(w["saved_model"], w["weights"], f"Accelerate DDP {key} save_model")
        _assert_optimizer_same(g["optimizer"], w["optimizer"], f"Accelerate stage {stage} {key} optimizer")
