"""Mixed precision (bf16/fp16 compute, fp32 masters) on real gloo ranks, and the
fake backend for memory.

1. bf16 compute with fp32 master weights, every stage, STEPS (120) steps of the small GPT
   on tinyshakespeare: (a) equals, step by step, a reference that emulates the same
   arithmetic with plain torch (bf16 forward/backward on the bf16 cast of the fp32
   master, gradients cast to fp32 and summed in rank order, one torch
   AdamW(fused=True) step from our pre-step master and moments): identical losses at
   every step and master weights within MAX_ULPS of the emulated step, every step
   (re-synchronized each step, so Adam's amplification of rounding noise over
   the run neither hides a per-step error nor excuses one); (b) follows an fp32 DDP run's loss curve
   within LOSS_TOLERANCE (means over 20-step windows); (c) clip_grad_norm_ returns the
   global norm of the full averaged fp32 gradients within 1e-6 relative, with two
   param groups and a frozen parameter.
2. fp16 with dynamic loss scaling: an inf injected into one gradient element on one
   rank skips the step on every rank (parameters, master weights and optimizer state
   bitwise unchanged), backs the scale off, and the scale grows back after the interval.
3. Memory per rank with bf16 + Adam: the paper's formulas with reduce_dtype=bf16 and
   the fp32-gradient ones with the default fp32 reduce (Note [Mixed
   precision] in csrc/engine/layout.cpp), within 1%, on the fake backend at N = 8 and 64.
4. reduce_dtype=bf16 halves the reduce-scatter bytes per step (stats).
"""
import os

import pytest

from dist_harness import ROOT, run_world

pytestmark = pytest.mark.dist

DATA = os.path.join(ROOT, "examples", "data", "tinyshakespeare.txt")
STEPS = 120
CLIP = 1.0
LOSS_TOLERANCE = 0.1      # |bf16 - fp32| of 20-step mean losses, nats. Set by torch's bf16
                          # matmuls, not by us (we equal the emulation to the ulp): up to
                          # 0.05 on a Zen 4 with avx512_bf16, 0.063 (stage 0, N=2, steps
                          # 60-80) on an AVX2-only EPYC, where torch computes bf16 GEMMs
                          # another way
MAX_ULPS = 2              # per step, ours vs the emulated step from our state. Mostly 0;
                          # 1 at steps where torch's fused AdamW rounds a bias correction
                          # or a sqrt differently (csrc/core/zx_kernels_ref.c follows the
                          # single-tensor AdamW, whose scalars Python computes in double)


def _groups(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 1.5e-3}]


def _ulps(mine, ref, before):
    """Largest |mine - ref| in ulps of the step's operands, max(|before|, |ref|,
    |ref - before|): an update that cancels most of a parameter is judged on the scale
    of the parameter and of the update (a result near zero has tiny ulps that its
    inputs never had)."""
    import torch
    scale = torch.maximum(torch.maximum(before.abs(), ref.abs()), (ref - before).abs())
    ulp = torch.nextafter(scale, torch.full_like(scale, float("inf"))) - scale
    return ((mine - ref).abs() / ulp).max().item()


def _bf16_worker(rank, world, stages, steps, reduce_dtype):
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn

    import zero_ext
    from cases import TINY_GPT
    from gpt import GPT, CharDataset, GPTConfig

    def all_gather(t):
        if world == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        return parts

    ds = CharDataset(DATA)
    cfg = GPTConfig(**{**TINY_GPT, "vocab_size": ds.vocab_size, "bias": True})
    adamw = dict(lr=3e-3, betas=(0.9, 0.95))
    out = {}
    for stage in stages:
        torch.manual_seed(1234)
        base = GPT(cfg)
        base.wpe.weight.requires_grad_(False)                  # a frozen parameter

        fp32 = copy.deepcopy(base)
        ddp = nn.parallel.DistributedDataParallel(fp32) if world > 1 else fp32
        opt32 = torch.optim.AdamW(_groups(fp32), **adamw)

        emu = copy.deepcopy(base).to(torch.bfloat16)           # the emulation's compute copy
        emu_params = dict(emu.named_parameters())
        names = [n for n, p in emu.named_parameters() if p.requires_grad]
        offsets, off = {}, 0
        for n in names:
            offsets[n] = off
            off += emu_params[n].numel()

        mine = copy.deepcopy(base)
        zm, zo = zero_ext.zeroify(mine, torch.optim.AdamW(_groups(mine), **adamw), stage=stage,
                                  param_dtype="bf16", reduce_dtype=reduce_dtype)
        eng = zo._engine
        pname = {id(p): n for n, p in mine.named_parameters()}
        me = 0 if stage == 0 else rank
        frags = {r: [(pname[id(zo._params[i])], po, so, k) for i, po, so, k in eng.fragments(r)]
                 for r in range(eng.partitions)}
        bucket_groups = eng.bucket_groups()
        losses, losses32, norm_pairs, same_loss, ulps = [], [], [], True, []
        for step in range(steps):
            g = torch.Generator().manual_seed(7919 * step + rank)
            x, y = ds.get_batch("train", 4, TINY_GPT["block_size"], g)

            loss32 = ddp(x, y)[1]
            loss32.backward()
            torch.nn.utils.clip_grad_norm_(fp32.parameters(), CLIP)
            opt32.step()
            opt32.zero_grad()

            # Our state before the step; the emulation computes with bf16(master).
            before = [s.clone() for s in eng.param_shards()]
            states = {k: v.clone() for k, v in eng.states().items()}
            flat = torch.cat([b.flatten() for b in before])
            shards = all_gather(flat) if stage else [flat]
            with torch.no_grad():
                for r, fr in frags.items():
                    for n, po, so, k in fr:
                        emu_params[n].view(-1)[po:po + k] = shards[r][so:so + k]   # rounds to nearest even

            loss = zm(x, y)[1]
            loss.backward()
            norm = float(zo.clip_grad_norm_(CLIP))
            coef = zo._clip_coef          # from our fp64 norm (the norm itself is checked below)
            zo.step()
            zo.zero_grad()

            loss_e = emu(x, y)[1]
            loss_e.backward()
            local = torch.cat([emu_params[n].grad.float().flatten() for n in names])
            emu.zero_grad()
            parts = all_gather(local)
            total = parts[0].clone()
            for p in parts[1:]:
                total += p                                     # fp32, in rank order
            full_norm = (total.double() / world).norm().item()
            norm_pairs.append((full_norm, norm))
            scale = torch.tensor(coef * (1.0 / world), dtype=torch.float32)
            # One AdamW(fused=True) step per bucket slice from our pre-step state.
            grad = torch.zeros(flat.numel())
            for n, po, so, k in frags[me]:
                grad[so:so + k] = total[offsets[n] + po:offsets[n] + po + k] * scale
            after = eng.param_shards()
            worst, so = 0, 0
            for b, gi in enumerate(bucket_groups):
                k = before[b].numel()
                p = before[b].clone()
                hp = zo.param_groups[gi]
                opt = torch.optim.AdamW([p], lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                                        weight_decay=hp["weight_decay"], fused=True)
                if states:
                    opt.state[p] = {"step": torch.tensor(float(zo.group_steps[gi] - 1)),
                                    "exp_avg": states["exp_avg"][so:so + k].clone(),
                                    "exp_avg_sq": states["exp_avg_sq"][so:so + k].clone()}
                p.grad = grad[so:so + k]
                opt.step()
                if k:
                    worst = max(worst, _ulps(after[b], p, before[b]))
                so += k
            ulps.append(worst)
            same_loss = same_loss and loss.item() == loss_e.item()
            losses.append(loss.item())
            losses32.append(loss32.item())
        out[stage] = {"losses": losses, "losses32": losses32, "norms": norm_pairs, "same_loss": same_loss,
                      "ulps": ulps, "stats": zo.stats()}
        if world > 1:
            dist.barrier()
    return out


def _check_bf16(results, world, stages):
    import statistics
    for rank, out in enumerate(results):
        for stage in stages:
            r = out[stage]
            tag = f"N={world} stage {stage} rank {rank}"
            assert r["stats"]["param_dtype"] == "bf16"
            assert r["same_loss"], f"{tag}: a step's loss differs from the emulation's"
            assert len(r["ulps"]) == STEPS and max(r["ulps"]) <= MAX_ULPS, \
                f"{tag}: master weights {max(r['ulps'])} ulps from the emulated step"
            for full, mine in r["norms"]:
                assert abs(full - mine) <= 1e-6 * full, f"{tag}: clip norm {mine} vs {full}"
            assert any(full > CLIP for full, _ in r["norms"]) and any(full < CLIP for full, _ in r["norms"]), \
                "the run should both clip and not clip"
            w = 20
            for k in range(0, STEPS, w):
                m16 = statistics.fmean(r["losses"][k:k + w])
                m32 = statistics.fmean(r["losses32"][k:k + w])
                assert abs(m16 - m32) <= LOSS_TOLERANCE, f"{tag}: steps {k}-{k + w}: bf16 {m16:.4f} vs fp32 {m32:.4f}"
            assert statistics.fmean(r["losses"][-w:]) < statistics.fmean(r["losses"][:w]) - 0.5, "it should learn"


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_follows_fp32_and_matches_emulation(world):
    # every stage at 2 ranks; at 4, one stage that reduce-scatters and stage 3 (stages 0 and 2
    # at 4 ranks: test_parity in fp32, stage 2 in bf16 at 3 ranks: test_bf16_reduce_world3)
    stages = (0, 1, 2, 3) if world == 2 else (1, 3)
    results = run_world(_bf16_worker, world, stages, STEPS, "fp32", timeout_s=900, reuse=True)
    _check_bf16(results, world, stages)


def test_bf16_reduce_world3():
    """reduce_dtype=bf16 (opt-in) at a world size that divides nothing: the emulation
    reduces in fp32, so only the norm (2% of the fp32-reduced one, every step: the emulation
    starts from our state each step) and the loss curve are checked, and that bf16 was
    reduced. The loss curve as in test 1(b): 20-step means within LOSS_TOLERANCE of the fp32
    DDP run's, not step by step: the runs drift apart, and one step's loss then differed by
    0.186 (stage 2, step 28, Intel Xeon with AMX, where the 20-step means were within 0.035;
    the old per-step bound 0.15 held on a Zen 4 and with torch capped at AVX2)."""
    import statistics
    steps, w = 60, 20
    results = run_world(_bf16_worker, 3, (2, 3), steps, "bf16", timeout_s=600, reuse=True)
    for out in results:
        for stage in (2, 3):
            r = out[stage]
            assert r["stats"]["reduce_dtype"] == "bf16"
            for full, mine in r["norms"]:
                assert abs(full - mine) <= 2e-2 * full, f"stage {stage}: clip norm {mine} vs {full}"
            for k in range(0, steps, w):
                m16, m32 = statistics.fmean(r["losses"][k:k + w]), statistics.fmean(r["losses32"][k:k + w])
                assert abs(m16 - m32) <= LOSS_TOLERANCE, \
                    f"stage {stage}: steps {k}-{k + w}: bf16-reduce {m16:.4f} vs fp32 {m32:.4f}"
            assert statistics.fmean(r["losses"][-w:]) < statistics.fmean(r["losses"][:w]) - 0.2, "it should learn"


# ---------------------------------------------------------------------- fp16 overflow

def _fp16_worker(rank, world, stage, step_control=False):
    import torch

    import zero_ext
    from cases import build_model, batch, loss_of

    model = build_model("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    interval = 3
    zm, zo = zero_ext.zeroify(model, opt, stage=stage, param_dtype="fp16", loss_scale="dynamic",
                              initial_loss_scale=2.0 ** 10, loss_scale_growth_interval=interval,
                              loss_scale_backoff_factor=0.25, min_unit_numel=0, step_control=step_control)
    bad_step, target = 4, list(model.parameters())[1]
    scales, skipped_flags, snapshots_equal = [], [], None
    for step in range(bad_step + 1 + interval + 1):
        x, y = batch("mlp", rank, step, 0)
        handle = None
        if step == bad_step and rank == world - 1:
            def inject(g):
                g = g.clone()
                g.view(-1)[3] = float("inf")
                return g
            handle = target.register_hook(inject)
        zo.backward(loss_of("mlp", zm, x, y))
        if handle is not None:
            handle.remove()
        before = None
        if step == bad_step:
            before = ([s.clone() for s in zo._engine.param_shards()],
                      {k: v.clone() for k, v in zo._engine.states().items()},
                      [p.detach().clone() for p in zm.state_dict().values()], list(zo.group_steps))
        skipped_before = zo.skipped_steps
        zo.step()
        zo.zero_grad()
        skipped_flags.append(zo.skipped_steps > skipped_before)
        scales.append(zo.loss_scale)
        if before is not None:
            shards, states, params, steps = before
            snapshots_equal = (
                all(torch.equal(a, b) for a, b in zip(shards, zo._engine.param_shards()))
                and all(torch.equal(states[k], v) for k, v in zo._engine.states().items())
                and all(torch.equal(a, b) for a, b in zip(params, zm.state_dict().values()))
                and steps == zo.group_steps)
    return {"scales": scales, "skipped": skipped_flags, "equal": snapshots_equal, "bad_step": bad_step,
            "interval": interval, "stats": zo.stats()}


@pytest.mark.parametrize("step_control", [False, True], ids=["host", "step_control"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_overflow_skips_everywhere(stage, step_control):
    """step_control=True: the verdict, the scale and the step counts advance in the
    parameters' memory (the GPU path's rules, run here on CPU tensors)."""
    results = run_world(_fp16_worker, 2, stage, step_control, timeout_s=300, reuse=True)
    for rank, r in enumerate(results):
        b, k = r["bad_step"], r["interval"]
        want_skip = [s == b for s in range(len(r["skipped"]))]
        assert r["skipped"] == want_skip, f"rank {rank}: skipped steps {r['skipped']}"
        assert r["equal"], f"rank {rank}: a skipped step changed parameters or optimizer state"
        # 2^10, growing x2 every 3 good steps: steps 0-2 good -> 2^11 after step 2; step 3 good;
        # step 4 overflows -> x0.25; then 3 good steps grow it back x2.
        want, scale, good = [], 2.0 ** 10, 0
        for s in range(len(r["scales"])):
            if s == b:
                scale, good = scale * 0.25, 0
            else:
                good += 1
                if good == k:
                    scale, good = scale * 2, 0
            want.append(scale)
        assert r["scales"] == want, f"rank {rank}: scales {r['scales']} vs {want}"
        assert r["stats"]["skipped_steps"] == 1 and r["stats"]["param_dtype"] == "fp16"


# ---------------------------------------------------------------------- memory and bytes

# stage 3 keeps no low-precision shard (each gather casts the fp32 master): master 4 +
# Adam 8 + gradient g bytes per parameter over N, 2 below the ZeRO paper's 16/N with bf16.
# Stages 1-2 keep a master of m bytes per shard element: 4 (master_remainder=False), or 2
# and a tie bit under the bf16 parameter (Note [Split master in the engine]).
PAPER = {1: lambda psi, n, g, m: 2 * psi + g * psi + (m + 8) * psi / n,
         2: lambda psi, n, g, m: 2 * psi + (m + 8 + g) * psi / n,
         3: lambda psi, n, g, m: (12 + g) * psi / n}


def _memory_worker(rank, world, fake_world, reduce_dtype):
    import torch
    import torch.distributed as dist

    import zero_ext
    from cases import build_model, batch, loss_of

    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=fake_world)
    out = {}
    for remainder in (False, True):
        for stage in (1, 2, 3):
            model = build_model("mlp_big")
            psi = sum(p.numel() for p in model.parameters())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            zm, zo = zero_ext.zeroify(model, opt, stage=stage, param_dtype="bf16", reduce_dtype=reduce_dtype,
                                      unit_modules=["Linear"], master_remainder=remainder)
            x, y = batch("mlp_big", 0, 0, 0)
            loss_of("mlp_big", zm, x, y).backward()
            zo.step()
            out[remainder, stage] = {"stats": zo.stats(), "psi": psi}
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("n", [8, 64])
@pytest.mark.parametrize("reduce_dtype", ["bf16", "fp32"])
def test_bf16_memory_formulas(n, reduce_dtype):
    out = run_world(_memory_worker, 1, n, reduce_dtype, init_pg=False, timeout_s=300)[0]
    g = 2 if reduce_dtype == "bf16" else 4
    for (remainder, stage), r in out.items():
        msb, psi = r["stats"]["model_state_bytes"], r["psi"]
        m = 2 + 1 / 8 if remainder and stage < 3 else 4
        want = PAPER[stage](psi, n, g, m)
        assert abs(msb["total"] - want) <= 0.01 * want, \
            f"stage {stage} N={n} reduce {reduce_dtype} remainder {remainder}: {msb['total']} vs {want:.0f}"
        assert abs(msb["master_weights"] - m * psi / n) <= 0.01 * m * psi / n + 4 * 64 * n
        if reduce_dtype == "bf16" and not remainder:   # the ZeRO paper's K=12 formulas (stage 3: 2 bytes below)
            paper = {1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 14 * psi / n}[stage]
            assert abs(msb["total"] - paper) <= 0.01 * paper


def _bytes_worker(rank, world):
    import torch

    import zero_ext
    from cases import build_model, batch, loss_of

    out = {}
    for rd in ("fp32", "bf16"):
        model = build_model("mlp_big")
        zm, zo = zero_ext.zeroify(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2,
                                  param_dtype="bf16", reduce_dtype=rd)
        x, y = batch("mlp_big", rank, 0, 0)
        loss_of("mlp_big", zm, x, y).backward()
        zo.step()
        out[rd] = zo.stats()["comm"]
    return out


def test_bf16_reduce_halves_reduce_scatter_bytes():
    for c in run_world(_bytes_worker, 2, reuse=True):
        fp32, bf16 = c["fp32"]["reduce_scatter"], c["bf16"]["reduce_scatter"]
        assert fp32["numel"] == bf16["numel"] > 0
        assert bf16["bytes"] * 2 == fp32["bytes"]
        # the parameter all-gather is bf16 either way
        assert c["fp32"]["all_gather"]["bytes"] == 2 * c["fp32"]["all_gather"]["numel"]


# ---------------------------------------------------------------------- accumulation

def _accum_worker(rank, world, stage):
    import contextlib
    import copy

    import torch
    import torch.distributed as dist

    import zero_ext
    from cases import batch, build_model, loss_of

    base = build_model("gpt")
    emu = copy.deepcopy(base).to(torch.bfloat16)
    mine = copy.deepcopy(base)
    zm, zo = zero_ext.zeroify(mine, torch.optim.AdamW(mine.parameters(), lr=1e-3), stage=stage, param_dtype="bf16")
    eng = zo._engine
    names = {id(p): n for n, p in zm.module.named_parameters()}
    micro = 3
    for k in range(micro):
        x, y = batch("gpt", rank, 0, k)
        with zm.no_sync() if k < micro - 1 else contextlib.nullcontext():
            loss_of("gpt", zm, x, y).backward()
        loss_of("gpt", emu, x, y).backward()          # bf16 autograd accumulates in bf16 here
    eng.wait_reductions()
    # The emulation of "accumulate in fp32": each micro-step's bf16 gradient added in
    # fp32 — under no_sync stages 1 and 2 sum the micro-steps locally and reduce once
    # (Note [Local accumulation]); without it stage 2 would reduce every micro-step
    # (ranks summed in rank order) into the fp32 shard.
    def all_ranks_sum(flat):
        parts = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(parts, flat)
        s = parts[0].clone()
        for p in parts[1:]:
            s += p
        return s

    emu2 = copy.deepcopy(base).to(torch.bfloat16)
    names2 = sorted(n for n, _ in emu2.named_parameters())
    acc = {n: torch.zeros(p.shape) for n, p in emu2.named_parameters()}
    total = None
    for k in range(micro):
        emu2.zero_grad()
        x, y = batch("gpt", rank, 0, k)
        loss_of("gpt", emu2, x, y).backward()
        grads = dict((n, p.grad.float()) for n, p in emu2.named_parameters())
        if stage <= 2:
            for n in names2:
                acc[n] += grads[n]
        else:
            step_sum = all_ranks_sum(torch.cat([grads[n].flatten() for n in names2]))
            total = step_sum if total is None else total + step_sum
    if stage <= 2:
        total = all_ranks_sum(torch.cat([acc[n].flatten() for n in names2]))
    offs, off = {}, 0
    for n in sorted(acc):
        offs[n] = off
        off += acc[n].numel()
    shard = torch.cat([g.flatten() for g in eng.grad_shards()])
    worst_fp32, worst_bf16acc = 0.0, 0.0
    bf16_acc = {n: p.grad.float() for n, p in emu.named_parameters()}
    flat_b = torch.cat([bf16_acc[n].flatten() for n in sorted(acc)])
    parts_b = [torch.empty_like(flat_b) for _ in range(world)]
    dist.all_gather(parts_b, flat_b)
    total_b = parts_b[0].clone()
    for p in parts_b[1:]:
        total_b += p
    for i, po, so, k in eng.fragments(rank):
        n = names[id(zo._params[i])]
        want = total[offs[n] + po:offs[n] + po + k]
        worst_fp32 = max(worst_fp32, (shard[so:so + k] - want).abs().max().item())
        worst_bf16acc = max(worst_bf16acc, (total_b[offs[n] + po:offs[n] + po + k] - want).abs().max().item())
    return {"fp32": worst_fp32, "bf16acc": worst_bf16acc}


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_accumulation_is_fp32(stage):
    """Three micro-steps (two under no_sync) with bf16 parameters: the reduced gradient
    equals the fp32 sum of every micro-step's bf16 gradient over micro-steps and ranks,
    exactly — not the bf16 running sum autograd would keep (which the test shows differs)."""
    for r in run_world(_accum_worker, 2, stage, reuse=True):
        assert r["fp32"] == 0.0, f"stage {stage}: gradient differs from the fp32 accumulation by {r['fp32']}"
        assert r["bf16acc"] > 0.0, "bf16 accumulation should differ from fp32 here (else the test shows nothing)"
