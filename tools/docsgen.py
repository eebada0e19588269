"""The generated parts of README.md and the docs site: one source per fact.

    python tools/docsgen.py           rewrite README.md's generated regions
    python tools/docsgen.py --check   exit 1 if README.md's regions are stale (tests/test_docs.py runs it)

Every figure the README or the docs state comes from a file under benchmarks/reference/
(each directory's machine.json names the machine and the commit of each file), and every
status claim (what ran where) from the result files that `make gpu-check` and the
benchmarks write there. They reach the text only through the generators below:

- README.md holds their output between `<!-- gen:NAME -->` and `<!-- /gen:NAME -->`
  (GitHub shows the file as it is), checked fresh by tests/test_docs.py.
- A docs page holds a lone `<!-- gen:NAME [ARG] -->` line, expanded when mkdocs builds
  the site: this file is also the site's mkdocs hook (mkdocs.yml: hooks), which also adds
  the plots and turns links to repository files outside docs/ into their paths.

Outside generated regions, code and `within N%`-style tolerances, a number that looks
measured (a decimal, a percentage, a ratio like 1.3x) is an error (`stray_figures`,
tests/test_docs.py). Nothing here imports zero_ext: the sources are read as text.
"""
from __future__ import annotations

import ast
import io
import json
import pathlib
import re
import sys
import xml.sax.saxutils

ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "benchmarks" / "reference"
README = ROOT / "README.md"
DOCS = ROOT / "docs"

MARKER = re.compile(r"^<!-- gen:([\w-]+)(?: ([^>]*?))? -->$", re.M)
REGION = re.compile(r"^<!-- gen:([\w-]+)(?: ([^>]*?))? -->\n(.*?)^<!-- /gen:\1 -->$", re.M | re.S)


class DocsError(Exception):
    """A generator cannot produce its text (a missing reference file, test file, ...)."""


# ------------------------------------------------------------------ reference files

def ref(rel: str) -> dict:
    """benchmarks/reference/<rel> parsed."""
    path = REFERENCE / rel
    if not path.exists():
        raise DocsError(f"benchmarks/reference/{rel} does not exist")
    return json.loads(path.read_text())


def provenance(rel: str) -> str:
    """'NVIDIA H200, torch ..., 2026-11-23, commit 99b708e': the machine and commit of a
    reference file, from the file itself (gpu-check.json has both) or its machine.json."""
    machine_dir, name = rel.split("/", 1)
    meta_path = REFERENCE / machine_dir / "machine.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    data = ref(rel)
    entry = meta.get("files", {}).get(name, {})
    commit = data.get("commit") or entry.get("commit")
    date = (data.get("date_utc") or entry.get("date") or "")[:10]
    machine = meta.get("machine") or data.get("gpu")
    if not machine or not commit:
        raise DocsError(f"benchmarks/reference/{rel}: no machine or commit (add it to {machine_dir}/machine.json)")
    software = meta.get("software", "")
    parts = [machine, software, date, f"commit {commit[:7]}"]
    return f"`benchmarks/reference/{rel}`: " + ", ".join(p for p in parts if p)


def source_line(*rels: str) -> str:
    return "\n".join(f"<small>Source: {provenance(r)}.</small>  " for r in rels).rstrip() + "\n"


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def spread(d: dict, fmt: str = ".2f", unit: str = "x") -> str:
    return f"{d['median']:{fmt}}{unit} [{d['min']:{fmt}}, {d['max']:{fmt}}]"


# ------------------------------------------------------------------ performance

H200 = "h200"
EPYC = "epyc-avx2-2026-11-23"
XEON = "xeon-avx512-2026-11-25"
ZEN5 = "epyc-avx512-2026-11-27"
XEON_0528 = "xeon-avx512-2026-11-28"


def gen_perf_headline(arg: str = "") -> str:
    """A 1.31B GPT's training step on one H200: zero_ext's stages against plain torch and FSDP2."""
    rel = f"{H200}/bench_step_gpu.json"
    d = ref(rel)
    a = d["meta"]["args"]
    names = {"torch": "plain torch (autocast bf16, fused AdamW)", "fsdp2": "FSDP2 `fully_shard`",
             "zero1": "zero_ext stage 1", "zero2": "zero_ext stage 2", "zero3": "zero_ext stage 3",
             "zero1_fp32master": "zero_ext stage 1, fp32 master (`master_remainder=False`)",
             "zero2_fp32master": "zero_ext stage 2, fp32 master (`master_remainder=False`)"}
    rows = []
    for key, s in d["systems"].items():
        rows.append([names.get(key, key), f"{s['median_ms']:.1f}", f"{s['vs_torch']:.2f}x", f"{s['vs_fsdp2']:.2f}x"])
    # no peak column: the systems ran one after another in one process (Note [GPU tiers]);
    # peak memory comes from bench_peak_gpu.py, each system alone (gen_perf_peak_gpu)
    text = (f"One training step of a {d['meta']['numel'] / 1e9:.2f}B-parameter bf16 GPT ({a['layers']} layers, "
            f"width {a['width']}, batch {a['batch']} x {a['seq']} tokens) at world size 1: nothing is sharded "
            f"across ranks here, so this is the engine's overhead against the peers (median of {a['reps']} "
            f"repetitions). Peak memory, each system measured alone: the Performance page.\n\n")
    text += table(["system", "ms / step", "time vs plain torch", "time vs FSDP2"], rows)
    return text + "\n" + source_line(rel)


H100 = "h100-80gb-hbm3"


def gen_perf_peak_gpu(arg: str = "") -> str:
    """Peak device memory of the 1.31B GPT, each system in a process of its own (bench_peak_gpu.py)."""
    rel = f"{H100}/bench_peak_gpu.json"
    d = ref(rel)
    a, systems = d["meta"]["args"], d["systems"]
    names = {"torch": "plain torch (autocast bf16, fused AdamW)", "fsdp2": "FSDP2 `fully_shard`",
             "fsdp2_offload": "FSDP2, `CPUOffloadPolicy`", "zero1": "zero_ext stage 1", "zero2": "zero_ext stage 2",
             "zero3": "zero_ext stage 3", "zero1_offload": "zero_ext stage 1, `offload=\"cpu\"`",
             "zero2_offload": "zero_ext stage 2, `offload=\"cpu\"`", "zero3_offload": "zero_ext stage 3, `offload=\"cpu\"`",
             "zero1_2ranks": "zero_ext stage 1, 2 ranks (`cuda:gloo`)", "zero2_2ranks": "zero_ext stage 2, 2 ranks",
             "zero3_2ranks": "zero_ext stage 3, 2 ranks (`cuda:gloo`)"}
    g = lambda v: f"{v / 2**30:.2f}"   # noqa: E731
    rows, left = [], []
    for key, r in systems.items():
        if "did_not_run" in r:
            left.append(f"{names.get(key, key)} ({r['did_not_run']})")
            continue
        z = r.get("zero_ext") or {}
        msb, buf = z.get("model_state_bytes") or {}, z.get("buffer_bytes") or {}
        per_rank = f" ({g(r['device_per_rank'])} a rank)" if r["world"] > 1 else ""
        rows.append([names.get(key, key), g(r["allocated"]), g(r["reserved"]), g(r["device"]) + per_rank,
                     g(msb["total"]) if msb else "-", g(buf.get("grad_ring", 0) + buf.get("peak_gathered_params", 0))
                     if buf else "-"])
    text = (f"Peak device memory of the same GPT ({a['layers']} layers, width {a['width']}, batch {a['batch']} x "
            f"{a['seq']} tokens; the 2-rank runs take half the batch each), bf16 compute with fp32 masters and "
            f"AdamW states, {a['steps']} training steps, each system in a process of its own with the GPU to "
            f"itself, measured after wrapping (a model built on the meta device skips the build's copy). "
            f"*allocated*: `torch.cuda.max_memory_allocated`; *reserved*: `max_memory_reserved`; *device*: total "
            f"minus free of `torch.cuda.mem_get_info` after each step, what `nvidia-smi` shows (the CUDA context "
            f"included; at 2 ranks both processes); *model states*: what zero_ext's `stats()` says it keeps on "
            f"the device; *ring + gathered*: its gradient ring and gathered units at their peak.\n\n")
    text += table(["system", "allocated GiB", "reserved GiB", "device GiB", "model states GiB",
                   "ring + gathered GiB"], rows)
    ok = lambda k: k in systems and "did_not_run" not in systems[k]   # noqa: E731
    notes = []
    if ok("zero3") and ok("fsdp2"):
        z, f = systems["zero3"], systems["fsdp2"]
        notes.append(f"Stage 3 against FSDP2: {g(z['device'])} against {g(f['device'])} GiB on the device, "
                     f"{g(z['allocated'])} against {g(f['allocated'])} GiB allocated. Both keep the same "
                     f"model states (fp32 parameter, gradient and two Adam states a parameter); what zero_ext "
                     f"holds beyond them is not its ring or gathered units, whose sum is in the table, and "
                     f"is open (runs.md of this machine).")
    if ok("zero3_offload") and ok("fsdp2_offload"):
        z, f = systems["zero3_offload"], systems["fsdp2_offload"]
        msb = z["zero_ext"]["model_state_bytes"]
        notes.append(f"With offload: {g(z['device'])} against FSDP2's {g(f['device'])} GiB on the device; "
                     f"zero_ext keeps the bf16 parameter shard on the device ({g(msb['total'])} GiB), FSDP2 "
                     f"moves its parameters to the host too (zero_ext has no parameter offload yet).")
    if ok("zero3_offload") and ok("zero3"):
        moved = sum(systems["zero3_offload"]["zero_ext"]["offload"].get(k, 0) for k in ("master_weights", "optimizer_states"))
        saved = systems["zero3"]["allocated"] - systems["zero3_offload"]["allocated"]
        notes.append(f"Offload takes {g(saved)} GiB off the device in stage 3, the {g(moved)} GiB of masters "
                     f"and states it moves to the host and the gradient shard.")
    if left:
        notes.append("Not measured: " + "; ".join(left) + ".")
    return text + "\n" + " ".join(notes) + "\n\n" + source_line(rel)


def gen_perf_optimizer_gpu(arg: str = "") -> str:
    rel = f"{H200}/bench_optimizer_gpu.json"
    d = ref(rel)
    rows = []
    for s in d["sizes"]:
        t = s["times"]
        rows.append([f"{s['numel'] / 2**20:,.0f}M", f"{t['ours']['median_ms']:.3f}", f"{t['torch_fused+copy']['median_ms']:.3f}",
                     f"{t['copy']['median_ms']:.3f}", f"{s['ours_fraction_of_copy']:.2f}",
                     f"{s['speedup_vs_torch_fused_plus_copy']:.2f}x"])
    m = d["many_small_tensors"]
    text = ("AdamW step with the bf16 copy-out in the same pass (zero_ext's CUDA kernel) against torch's "
            "`AdamW(fused=True)` followed by a separate bf16 copy, and a device-to-device copy of the same "
            "bytes as the bandwidth ceiling (median ms).\n\n")
    text += table(["parameters", "zero_ext ms", "torch fused + copy ms", "copy ms", "zero_ext / copy bandwidth",
                   "zero_ext vs torch"], rows)
    text += (f"\n{m['tensors']:,} small tensors ({m['numel_total'] / 1e6:,.0f}M parameters): one flat zero_ext step "
             f"{m['times']['ours_flat']['median_ms']:.2f} ms against torch's fused list + foreach copy "
             f"{m['times']['torch_fused_list+foreach_copy']['median_ms']:.2f} ms "
             f"({m['speedup_vs_torch']:.2f}x).\n\n")
    sm = d.get("split_master")
    if sm:   # benchmarks/bench_optimizer_gpu.py --split-size (files written after 2026-11-26)
        st = sm["times"]
        text += (f"The split master ({sm['numel'] / 2**20:,.0f}M elements, chunks of {sm['chunk'] / 2**20:,.0f}M): the "
                 f"step {st['split_master']['median_ms']:.2f} ms against {st['fp32_master']['median_ms']:.2f} ms on an "
                 f"fp32 master ({sm['split_over_fp32_master']:.2f}x; the bytes alone would give "
                 f"{sm['ideal_split_over_fp32_master']:.2f}x); join + split at "
                 f"{sm['join_split_fraction_of_copy']:.2f} of the copy bandwidth.")
        if "fused_split" in st:   # files written after the one-pass kernel (Note [Fused split-master step])
            text += (f" What the engine runs for Adam with fp32 states is one pass (join, step, split in "
                     f"registers): {st['fused_split']['median_ms']:.2f} ms, {sm['fused_over_fp32_master']:.2f}x the "
                     f"fp32-master step (the bytes alone would give {sm['ideal_fused_over_fp32_master']:.2f}x), "
                     f"{sm['fused_fraction_of_copy']:.2f} of the copy bandwidth.")
        text += "\n\n"
    return text + "![AdamW bandwidth on the H200](img/optimizer_gpu.svg)\n\n" + source_line(rel)


def gen_perf_optimizer_cpu(arg: str = "") -> str:
    rel = f"{EPYC}/bench_optimizer.json"
    d = ref(rel)
    names = {"ours fp32": "zero_ext AdamW, fp32", "ours + bf16 out": "zero_ext AdamW + bf16 copy-out in the same pass",
             "torch foreach": "torch AdamW foreach", "torch fused": "torch AdamW fused",
             "torch fused + bf16 copy": "torch AdamW fused + separate bf16 `copy_`"}
    rows = [[names.get(r["name"], r["name"]), f"{r['median_s'] * 1e3:.1f}", f"{r['speedup_vs_torch_fused']:.2f}x",
             f"{r['fraction_of_copy_bw']:.2f}"] for r in d["results"]]
    text = (f"{d['numel'] / 2**20:,.0f}M parameters, {d['threads']} threads, ISA path `{d['isa']}`, "
            f"{d['reps']} interleaved repetitions (median). Copy bandwidth counts the write-allocate read "
            f"that a read-modify-write step does not pay, so fractions above one happen.\n\n")
    text += table(["contender", "ms", "speed vs torch fused", "fraction of copy bandwidth"], rows)
    srows = []
    for s in d["scaling"]:
        srows.append([f"{s['numel']:,}", s["threads"], f"{s['ours']['params_per_s'] / 1e9:.2f}",
                      f"{s['ours'].get('time_vs_1_thread', 1.0):.2f}", f"{s['torch fused']['params_per_s'] / 1e9:.2f}",
                      f"{s['torch fused'].get('time_vs_1_thread', 1.0):.2f}", f"{s['ours_speedup_vs_fused']:.2f}x"])
    text += "\nThread scaling (torch's intra-op threads), ours against torch fused in the same run:\n\n"
    text += table(["parameters", "threads", "zero_ext Gparams/s", "zero_ext time vs 1 thread", "torch Gparams/s",
                   "torch time vs 1 thread", "zero_ext vs torch"], srows)
    return text + "\n" + source_line(rel)


def gen_perf_units(arg: str = "") -> str:
    rel = f"{XEON}/bench_units.json"
    d = ref(rel)
    names = {"1": "zero_ext stage 1", "2": "zero_ext stage 2", "3": "zero_ext stage 3",
             "3-single": "zero_ext stage 3, `coalesce_numel=0`", "fsdp2": "FSDP2 (`fully_shard` per block)",
             "ddp": "DDP"}
    rows = []
    for key, s in d["systems"].items():
        c = s.get("collectives_per_step")
        coll = f"{c['all_gather']} all-gathers, {c['reduce_scatter']} reduce-scatters" if c else ""
        rows.append([names.get(key, key), spread(s["vs_ddp"]) if "vs_ddp" in s else "1",
                     spread(s["vs_fsdp2"]) if "vs_fsdp2" in s else "1", coll])
    text = (f"{d['blocks']} blocks of Linear(32, 32) + LayerNorm(32), each block a stage-3 unit "
            f"({d['params']:,} parameters), {d['world_size']} gloo ranks x {d['threads_per_rank']} thread: a step "
            f"is almost only per-unit overhead. Step time ratios within a repetition, median [min, max] over "
            f"{d['reps']} repetitions of {d['steps']} steps.\n\n")
    text += table(["system", "time vs DDP", "time vs FSDP2", "collectives per step"], rows)
    return text + "\n" + source_line(rel)


def gen_perf_comm(arg: str = "") -> str:
    rel = f"{EPYC}/bench_comm.json"
    d = ref(rel)
    names = {"exact": "exact", "int8": '`grad_quant="int8"`', "int4": '`grad_quant="int4"`',
             "int4_ef": '`grad_quant="int4"`, error feedback', "int8_ef": '`grad_quant="int8"`, error feedback',
             "q8gather": '`param_quant="int8"`', "q8gather_int8": '`param_quant="int8"` + `grad_quant="int8"`'}
    rows = []
    for key, m in d["modes"].items():
        rows.append([names.get(key, key), f"{m['final_loss']:.4f}", f"{100 * m['final_loss_vs_exact']:+.2f}%",
                     f"{m['wire_vs_exact']:.3f}", f"{m['all_gather_wire_vs_exact']:.3f}",
                     f"{m['step_time_vs_exact']:.2f}"])
    text = (f"{d['steps']} steps, {d['world']} gloo ranks, stage {d['stage']}, the GPT of `examples/gpt.py` on "
            f"tinyshakespeare (block {d['block']}), every mode on the same batches in lockstep. Final loss: the "
            f"mean of the last 20 steps.\n\n")
    text += table(["mode", "final loss", "vs exact", "reduce-scatter wire / exact", "all-gather wire / exact",
                   "step time vs exact"], rows)
    return text + "\n![Loss per step and mode](img/comm_losses.svg)\n\n" + source_line(rel)


def gen_perf_comm_hier(arg: str = "") -> str:
    rel = f"{EPYC}/bench_comm_hier.json"
    d = ref(rel)
    rows = []
    for key, m in d["modes"].items():
        opts = ", ".join(f"`{k}={v!r}`" for k, v in m["options"].items() if k not in ("param_dtype", "reduce_dtype"))
        rows.append([key, opts or "exact", f"{m['inter_wire_bytes_per_step'] / 2**20:.2f}",
                     f"{m['inter_wire_vs_exact_bf16']:.2f}", f"{m['peak_secondary_bytes'] / 2**20:.2f}"])
    text = (f"Stage 3, bf16 parameters and reduction, {d['world']} ranks as nodes of {d['node_size']}, a GPT of "
            f"{d['n_layer']} layers (width {d['n_embd']}); bytes crossing nodes per step.\n\n")
    text += table(["mode", "options", "MiB across nodes / step", "vs exact bf16", "node-local parts, MiB (peak)"], rows)
    return text + "\n" + source_line(rel)


def gen_perf_whole(arg: str = "") -> str:
    rel = f"{EPYC}/bench_whole.json"
    d = ref(rel)
    names = {"ddp": "DDP + torch Muon/AdamW", "zero_s1": "zero_ext stage 1", "zero_s2": "zero_ext stage 2"}
    rows = [[names.get(k, k), f"{s['step_time_vs_ddp']:.2f}", f"{s['state_max_vs_ddp']:.3f}",
             f"{s['state_max_over_mean']:.3f}", f"{100 * s['final_loss_vs_ddp']:+.3f}%"] for k, s in d["systems"].items()]
    text = (f"Muon on the hidden matrices + AdamW on the rest, {d['world']} gloo ranks, GPT {d['n_layer']} layers / "
            f"width {d['n_embd']}, {d['steps']} steps.\n\n")
    text += table(["system", "step time vs DDP", "optimizer state of the most loaded rank vs DDP", "max / mean",
                   "final loss vs DDP"], rows)
    return text + "\n" + source_line(rel)


def gen_perf_memory(arg: str = "") -> str:
    """Model-state bytes per parameter by category: zero_ext beside FSDP2 and DeepSpeed stage 3."""
    rel = f"{XEON}/bench_memory_peers.json"
    d = ref(rel)
    names = {"zero_ext": "zero_ext", "fsdp2": "FSDP2 `fully_shard`", "deepspeed": "DeepSpeed"}
    cats = ("parameters", "gradients", "master_weights", "optimizer_states", "total")
    rows = []
    for p in d["points"]:
        if "bytes" not in p:
            continue
        n = p["world_size"]
        per = [f"{p['bytes'][c] * n / p['num_params']:.2f}" for c in cats]
        check = "yes" if p.get("agree") else ("-" if "agree" not in p else "NO")
        rows.append([str(n), f"{names.get(p['family'], p['family'])} {p['config']}", *per, check])
    m = d["model"]
    text = (f"Model state held by one rank after one AdamW step, times N, per parameter (bytes): the "
            f"{m['num_params'] / 1e6:.2f}M-parameter GPT of `examples/gpt.py` ({m['layers']} layers, width "
            f"{m['width']}) on N gloo ranks. Sharded state reads as bytes per parameter of the whole job; what "
            f"each rank holds whole (stages 1-2 parameters, stage 1 gradients) counts N times. Stage 3 keeps "
            f"no bf16 parameter shard (each gather casts the fp32 master); stages 1-2 with bf16 keep the master "
            f"as a 16-bit remainder and a tie bit under the bf16 parameter (`master_remainder`). "
            f"zero_ext's figures are "
            f"`opt.stats()`, checked against `estimate_memory` on every rank; the peers' are their sharded "
            f"tensors as allocated.\n\n")
    text += table(["N", "system", "parameters", "gradients", "master", "Adam states", "total",
                   "stats() = estimate"], rows)
    return text + "\n" + source_line(rel)


def gen_perf_peak_process(arg: str = "") -> str:
    """Memory per process (resident, steady and peak): zero_ext's stages beside DDP and FSDP2,
    the peak's breakdown by owner, and estimate_memory's prediction of it."""
    rel = f"{XEON_0528}/bench_peak_process.json"
    d = ref(rel)
    results = [r for r in d["results"] if "peak" in r]
    rows, owners, predicted = [], [], []

    def peer_of(r):   # the FSDP2 row r is judged against: same world, bf16 params if r's are
        return next((x for x in results if x["world"] == r["world"]
                     and x["system"] == ("fsdp2-bf16" if r["system"].endswith("bf16") else "fsdp2")), None)

    for r in results:
        peer, ddp = peer_of(r), next((x for x in results if x["world"] == r["world"] and x["system"] == "ddp"), None)
        ratio = lambda q: f"{r['peak'] / q['peak']:.2f}x" if q and r["system"] != q["system"] else "-"   # noqa: E731
        rows.append([str(r["world"]), r["system"], f"{r['steady']:.0f}", f"{r['peak']:.0f}", ratio(peer), ratio(ddp),
                     f"{r['accounted']:.0f}" if "accounted" in r else "-"])
        if "breakdown" in r and r["system"] in ("zero3", "fsdp2"):
            b = r["breakdown"]
            owners.append([str(r["world"]), r["system"], b["at"], f"{b['peak']:.0f}", f"{b['process']:.0f}"]
                          + [f"{b.get(k, 0.0):.0f}" for k in ("model_state", "gradients", "grad_ring",
                                                              "gathered_units", "prefetch", "activations",
                                                              "allocator_slack", "unexplained")])
        if "predicted_peak" in r:
            measured = r["peak"] - r["other"]
            predicted.append([str(r["world"]), r["system"], f"{measured:.0f}", f"{r['predicted_peak']:.0f}",
                              f"{r['predicted_peak'] / measured:.2f}"])
    model = results[0]["params"]
    text = (f"Resident memory of one rank (the one with the highest peak), MiB above what the process held after "
            f"init_process_group: steady between steps, and the peak over training steps 2-4; a "
            f"{model / 1e6:.0f}M-parameter GPT (`examples/gpt.py`, {d['layers']} layers, width 768, vocab 8192, tied "
            f"head) built on the meta device, AdamW, batch 4 x 256 per rank, each system alone in its own torchrun "
            f"launch (`benchmarks/bench_peak_process.py --worlds 2,4 --timeline`). The last column is zero_ext's "
            f"own accounting of what it holds between steps (`opt.stats()`: model state, `held_bytes`); the rest "
            f"of each process is torch's.\n\n")
    text += table(["N", "system", "steady", "peak", "peak / FSDP2's", "peak / DDP's", "zero_ext's accounting"], rows)
    text += ("\nAt the peak, by owner (MiB): the resident peak; what the process holds beyond every owner between "
             "steps (torch, libraries); then each owner as the last mark before the peak saw it (a mark at each "
             "block's forward and backward, the loss, the step: `benchmarks/memory_timeline.py`), zero_ext's from "
             "`opt.stats()`, FSDP2's from its tensors; gathered units are the root's and the marked block's, "
             "prefetch the other units held gathered ahead of their use; activations are the tensors autograd "
             "saved; allocator slack is glibc's free bytes the process still holds (`mallinfo2`). What no owner "
             "explains (autograd's temporaries between two marks: the loss's gradients, a block's weight "
             "gradients) is shown as such. Gradients and ring are allocated bytes: on the CPU only written "
             "pages are resident.\n\n")
    text += table(["N", "system", "at", "peak", "process", "model state", "gradients", "ring", "gathered units",
                   "prefetch", "activations", "allocator slack", "unexplained"], owners)
    floors = [[str(r["world"]), r["system"], f"{r['loss_floor']['at_loss']:.0f}", f"{r['loss_floor']['ahead']:.0f}",
               f"{r['loss_floor']['floor']:.0f}", f"{r['loss_floor']['floor'] / peer_of(r)['peak']:.3f}",
               f"{0.95 * peer_of(r)['peak']:.0f}"]
              for r in results if "loss_floor" in r and peer_of(r) and r["system"] in ("zero3", "zero3-bf16", "fsdp2", "fsdp2-bf16")]
    text += ("\nAround the loss (MiB): the most resident from the loss to the next mark (the loss's and the head's "
             "backward), the units held gathered ahead of their use there, and the rest, the floor: torch, the "
             "model state, the root unit, the activations and the loss's temporaries, which every system holds "
             "there. Its ratio to FSDP2's peak is the lowest ratio a peak can reach without smaller activations or "
             "model state (`--summarize` prints it).\n\n")
    text += table(["N", "system", "at the loss", "held ahead", "floor", "floor / FSDP2's peak", "0.95 x FSDP2's peak"],
                  floors)
    text += ("\n`zero_ext.estimate_memory(model, N, stage, loss_fn=...)[\"peak\"]` against the measured peak less "
             "the process's own memory (MiB):\n\n")
    text += table(["N", "system", "measured", "predicted", "ratio"], predicted)
    return text + "\n" + source_line(rel)


def gen_perf_offload(arg: str = "") -> str:
    """Optimizer offload on the CPU engine: step time with and without it, and its floor."""
    rel = f"{XEON}/bench_offload.json"
    d = ref(rel)
    a = d["args"]
    rows = []
    for world, w in sorted(d["cpu"].items()):
        for stage in a["stages"]:
            r = max((p[str(stage)] for p in w["per_rank"]), key=lambda x: x["step_s"]["offload"]["median"])
            st = r["step_s"]
            rows.append([world, str(stage), f"{st['none']['median'] * 1e3:.1f}", f"{st['offload']['median'] * 1e3:.1f}",
                         spread(r["ratio_step"], ".3f"), f"{st['none_opt']['median'] * 1e3:.2f}",
                         f"{st['offload_opt']['median'] * 1e3:.2f}", f"{r['floor_s'] * 1e3:.2f}",
                         f"{r['opt_over_floor']:.2f}x"])
    text = (f"`offload=\"cpu\"` on the CPU engine (the only device here: its \"device\" buffers are host "
            f"memory too, so offload can only cost): the GPT '{a['size']}' of `benchmarks/bench_offload.py`, "
            f"{a['steps'] - a['warmup']} timed steps x {a['reps']} interleaved repetitions, {a['threads']} "
            f"thread(s) per rank, the slowest rank. The floor of the offloaded `opt.step()` is the "
            f"`opt.step()` without offload (the same kernel, the parameter all-gather) plus the bytes the rings "
            f"copied, once, at the measured memcpy bandwidth; on this CPU engine each up copy is made twice "
            f"(master to pinned slot, slot to the parameters), as the GPU path stages it. Step = forward + "
            f"backward + `opt.step()` (ms, medians; ratio: median [min, max] of the per-repetition ratios).\n\n")
    text += table(["N", "stage", "step, none", "step, offload", "offload / none", "opt.step, none",
                   "opt.step, offload", "floor", "offload opt.step / floor"], rows)
    text += "\n" + source_line(rel)
    grel = f"{H200}/bench_offload_gpu.json"
    g = ref(grel)
    ga, gs = g["args"], g["gpu"]
    names = {"zero_ext_offload": "zero_ext, `offload=\"cpu\"`", "zero_ext": "zero_ext, no offload",
             "fsdp2_offload": "FSDP2, `CPUOffloadPolicy`"}
    grows = [[names.get(k, k), f"{v['step_s']['median'] * 1e3:.0f}", f"{v['peak_bytes'] / 2**30:.2f}"]
             for k, v in gs.items() if "step_s" in v]
    o = gs["zero_ext_offload"]
    text += (f"\nOn one GPU ({machine_name(grel)}): the GPT '{ga['gpu_size']}' ({o['shard_numel'] / 1e9:.2f}B "
             f"parameters), bf16, stage 2, world size 1, median of {ga['steps'] - ga['warmup']} steps x "
             f"{ga['reps']} repetitions. The offloaded step is {o['vs_fsdp2_offload']:.2f}x FSDP2's offloaded step "
             f"and {o['over_floor']:.2f}x its floor ({o['floor_s'] * 1e3:.0f} ms: "
             f"{o['link_bytes_per_step'] / 1e9:.2f} GB over PCIe at {min(o['pcie_GBps']):.0f} GB/s, and the "
             f"host's Adam kernel over the model, {o['adam_kernel_s'] * 1e3:.0f} ms).\n\n")
    text += table(["system", "ms / step", "device peak GiB"], grows)
    return text + "\n" + source_line(grel)


def gen_perf_compile(arg: str = "") -> str:
    """The compiled step (issue 54): zero_ext under torch.compile beside compiled DDP and FSDP2
    compiled per block; step time, compile time, dynamo's graphs, stage 3's step memory. One
    reference file per run (the GPT; the Llama where its run is there)."""
    rels = [f"{XEON_0528}/{name}" for name in ("bench_compile.json", "bench_compile_llama.json")
            if (REFERENCE / XEON_0528 / name).exists()]
    names = {"ddp": "compiled DDP (`torch.compile(DDP(model))`)",
             "fsdp2": "FSDP2, each block compiled, `fully_shard` per block and root",
             "zero2": "zero_ext stage 2, `fullgraph=True`", "zero3-per_unit": "zero_ext stage 3 (`per_unit`, default)",
             "zero3-whole": "zero_ext stage 3, `compile_units=\"whole\"`, `fullgraph=True`",
             "zero3-ingraph": "zero_ext stage 3, units gathered in the graph (prototype)",
             "zero3-eager": "zero_ext stage 3, not compiled"}
    ratio = lambda v: spread(v) if isinstance(v, dict) else "-"   # noqa: E731
    text = ("Two gloo ranks x 1 thread on this CPU, fp32, AdamW; every system built from the same model and data "
            "in the same two processes, compiled in a cache of its own (cold). Step time: median [min, max] over "
            "the repetitions (the systems interleaved); ratios within each repetition. Compile: the first two "
            "steps' wall time less twice the median step. Graphs and breaks: dynamo's counters after step 2; "
            "recompiles: graphs compiled after it. Step peak: the rise of the resident peak over one step (the "
            "rank with the highest). The cores were shared: the absolute times are slow, the ratios are what to "
            "read, and their spread says how far.\n")
    for rel in rels:
        d = ref(rel)
        for model, m in d["models"].items():
            rows = []
            for key, s in m["rows"].items():
                if "error" in s:
                    rows.append([names.get(key, key), "does not run: " + s["error"].split(":")[0]] + ["-"] * 8)
                    continue
                rows.append([names.get(key, key), f"{s['ms']['median']:.0f}", ratio(s.get("vs_ddp")),
                             ratio(s.get("vs_fsdp2")), f"{s['compile_s']:.0f}" if "compile_s" in s else "-",
                             f"{s['compile_vs_ddp']:.2f}x" if "compile_vs_ddp" in s else "-", str(s["graphs"]),
                             str(s["breaks"]), str(s["recompiles"]), f"{s['step_peak_mib']:.0f}"
                             + (f" ({s['peak_vs_eager3']:.2f}x)" if "peak_vs_eager3" in s else "")])
            text += (f"\n{m['config']} ({m['params'] / 1e6:.1f}M parameters); {d['reps']} repetitions of "
                     f"{d['steps']} step; load average {' / '.join(d['load_before'])} before, "
                     f"{' / '.join(d['load_after'])} after; `{d['command']}`:\n\n")
            text += table(["system", "ms / step", "time vs DDP", "time vs FSDP2", "compile s", "compile vs DDP",
                           "graphs", "breaks", "recompiles", "step peak MiB (vs stage 3 eager)"], rows)
            goals = m.get("goals", [])
            if goals:
                text += "\nGoals (issue 54): " + "; ".join(
                    f"{what}: {'met' if met else 'not met'} ({'-' if v is None else f'{v:.2f}x'})"
                    for what, v, met in goals) + ".\n"
    return text + "\n" + source_line(*rels)


def gen_perf_rank_alone(arg: str = "") -> str:
    """Rank 0's checkpoint and evaluation alone, served by the others, beside DDP (bench_rank_alone.py)."""
    rel = f"{ZEN5}/bench_rank_alone.json"
    d = ref(rel)
    names = {"ddp": "DDP (rank 0 holds everything)", "zero1": "zero_ext stage 1", "zero2": "zero_ext stage 2",
             "zero3": "zero_ext stage 3"}
    rows = []
    for key, e in d["systems"].items():
        c, cr, v, vr = e["checkpoint_s"], e["checkpoint_vs_ddp"], e["evaluate_s"], e["evaluate_vs_ddp"]
        rows.append([names.get(key, key), f"{c['median']:.2f}", f"{cr['median']:.2f}x [{cr['min']:.2f}, {cr['max']:.2f}]",
                     f"{v['median']:.2f}", f"{vr['median']:.2f}x [{vr['min']:.2f}, {vr['max']:.2f}]"])
    text = (f"A DDP script's `if rank == 0:` habits on a {d['numel'] / 1e6:.0f}M-parameter GPT at {d['ranks']} gloo "
            f"ranks: rank 0 alone writes the checkpoint (`model.module.state_dict()` and `optimizer.state_dict()`, "
            f"torch.save) and evaluates {d['eval_batches']} batches without autograd, while the other ranks wait in "
            f"their next step; in zero_ext's stages their shard servers send what rank 0 reads "
            f"([Stage 3](guide/stage3.md#evaluation-and-other-code-that-runs-on-some-ranks-only)). Seconds on rank "
            f"0, median of {d['reps']} repetitions; the ratio to DDP within a repetition, median [min, max].\n\n")
    text += table(["system", "checkpoint s", "vs DDP", "evaluation s", "vs DDP"], rows)
    return text + "\n" + source_line(rel)


def gen_perf_pretrained(arg: str = "") -> str:
    """A ~0.5B Llama loaded into stage 3 and saved back: zero_ext beside every rank's
    from_pretrained and FSDP2 with torch's Hugging Face reader and writer."""
    rel = f"{ZEN5}/bench_pretrained.json"
    d = ref(rel)
    m, a, mib = d["meta"], d["meta"]["args"], 2 ** 20
    names = {"from_pretrained": "every rank `from_pretrained`, then zeroify stage 3; save: gathered on rank 0, "
                                "`save_file`",
             "zero_ext": "zero_ext: meta build, `zeroify(weights=...)`; save: `zero_ext.save_pretrained`",
             "fsdp2": "FSDP2: meta build, `fully_shard`, DCP `HuggingFaceStorageReader`; save: "
                      "`HuggingFaceStorageWriter`"}
    base = d["systems"]["from_pretrained"]
    rows = []
    for key, s in d["systems"].items():
        load, save = s["load"], s["save"]
        rows.append([names.get(key, key), f"{load['seconds']:.1f}", f"{load['seconds'] / base['load']['seconds']:.2f}x",
                     f"{load['peak_bytes'] / mib:,.0f}", f"{load['peak_over_bound_bytes'] / mib:+,.0f}",
                     f"{save['seconds']:.1f}", f"{save['seconds'] / base['save']['seconds']:.2f}x",
                     f"{save['peak_bytes'] / mib:,.0f}", f"{save['peak_over_bound_bytes'] / mib:+,.0f}",
                     "yes" if s["saved_equal"] else "NO"])
    text = (f"A {m['numel'] / 1e9:.2f}B-parameter Llama-shaped model ({a['layers']} layers, width {a['hidden']}, "
            f"vocabulary {a['vocab']}, random weights) saved by transformers in bf16 "
            f"({m['checkpoint_bytes'] / 2 ** 30:.2f} GiB, one file), loaded on {a['world']} gloo ranks of one "
            f"thread each and saved back. Peak: the largest rank's resident set during the phase (VmHWM, reset "
            f"before it), MiB; bound: that rank's resident set after the load + the largest tensor in fp32 "
            f"({m['largest_numel'] * 4 / mib:,.0f} MiB) + 64 MiB, so a peak at or under it (a figure at or below "
            f"zero) holds no more than one tensor beyond what the rank keeps. Times: the slowest rank, seconds, "
            f"median of {a['reps']} run(s); saves include the fsync that makes them durable (the gather-on-rank-0 "
            f"save's own fsync: {base['save']['fsync_seconds']:.1f} s). Saved: the files hold the checkpoint's "
            f"values, tensor by tensor.\n\n")
    text += table(["system", "load s", "vs from_pretrained", "load peak", "peak - bound", "save s",
                   "vs gather on rank 0", "save peak", "peak - bound", "saved"], rows)
    return text + "\n" + source_line(rel)


def gen_perf_sequence(arg: str = "") -> str:
    """The divergence check's cost: step time with the default check and the every-phase mode vs off."""
    rel = f"{XEON}/bench_sequence.json"
    d = ref(rel)
    rows = []
    for key, s in d["stages"].items():
        rows.append([key.replace("stage", ""), f"{1e3 * s['off_s']['median']:.1f}", spread(s["now"]["ratio"], ".3f"),
                     f"{s['now']['exchanges_per_step']:.2f}", spread(s["before"]["ratio"], ".3f"),
                     f"{s['before']['exchanges_per_step']:.2f}"])
    text = (f"Step time of a {d['layers']}-layer GPT (width {d['embd']}) on {d['world']} gloo ranks with the divergence "
            f"check as it is by default, and in its every-phase mode (`check_sequence=\"every_phase\"`, an exchange "
            f"at every phase), each against the check switched off in the same repetition: median [min, max] "
            f"over {d['reps']} repetitions of {d['steps']} steps.\n\n")
    text += table(["stage", "off, ms / step", "default vs off", "exchanges / step", "every phase vs off",
                   "exchanges / step"], rows)
    return text + "\n" + source_line(rel)


# ------------------------------------------------------------------ plots (site only)

def plots() -> dict[str, bytes]:
    """{site path: SVG} for the images the performance generators reference."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams["svg.hashsalt"] = "zero_ext"
    out = {}

    d = ref(f"{EPYC}/bench_comm.json")
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for key, m in d["modes"].items():
        losses = m["losses"]
        k = 10
        smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1]) for i in range(len(losses))]
        ax.plot(smooth, label=key, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (mean of {k} steps)")
    ax.set_title(f"Quantized communication: {d['world']} gloo ranks, stage {d['stage']}")
    ax.legend(fontsize=7)
    out["img/comm_losses.svg"] = _svg(fig)

    d = ref(f"{H200}/bench_optimizer_gpu.json")
    fig, ax = plt.subplots(figsize=(7, 3.6))
    sizes = [s["numel"] for s in d["sizes"]]
    per = d["meta"]["bytes_per_param_ours"]
    for label, key in (("zero_ext AdamW + bf16 copy-out", "ours"), ("torch fused + copy", "torch_fused+copy")):
        ax.plot(sizes, [s["numel"] * per / (s["times"][key]["median_ms"] * 1e-3) / 1e9 for s in d["sizes"]],
                marker="o", label=label)
    ax.plot(sizes, [s["copy_GBps"] for s in d["sizes"]], linestyle="--", label="device copy")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel(f"effective GB/s ({per} bytes per parameter)")
    ax.set_ylim(bottom=0)
    ax.set_title(d["meta"]["device"])
    ax.legend(fontsize=7)
    out["img/optimizer_gpu.svg"] = _svg(fig)
    return out


def _svg(fig) -> bytes:
    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    return buf.getvalue()


# ------------------------------------------------------------------ status

# (feature, CPU tests in `make test`, gpu-check steps, benchmark result files)
STATUS = [
    ("Stages 0-3 on CPU (gloo), fp32, against DDP + the same torch optimizer, 1-4 ranks",
     ["tests/test_parity.py", "tests/test_unused.py"], ["tests_multirank"], []),
    ("Mixed precision: bf16/fp16 parameters, fp32 masters, dynamic loss scaling",
     ["tests/test_mixed_precision.py"], ["tests_engine", "tests_multirank_curves"], []),
    ("Fused CPU kernels (scalar, AVX2, AVX-512) on torch's intra-op threads",
     ["tests/test_kernels.py", "tests/test_threads.py"], [], [f"{EPYC}/bench_optimizer.json"]),
    ("CUDA optimizer kernels against the C reference; compute-sanitizer",
     ["tests/test_cuda_compile.py"], ["tests_kernels", "memcheck", "racecheck"], [f"{H200}/bench_optimizer_gpu.json"]),
    ("The engine on CUDA tensors (world size 1, NCCL), no host synchronization in a step",
     [], ["tests_engine", "cuda_sanitizer"], [f"{H200}/bench_step_gpu.json"]),
    ("Several ranks on one GPU (`cuda:gloo`) against DDP", [],
     ["tests_multirank", "tests_multirank_curves", "tests_multirank_4", "tests_multirank_4b"], []),
    ("Several GPUs over NCCL", [], [], []),
    ("Stage 3: units, prefetch, coalesced gathers and reductions, meta-device builds, frozen parameters",
     ["tests/test_stage3.py", "tests/test_prefetch.py", "tests/test_unit_schedule.py", "tests/test_coalesced_reduce.py", "tests/test_meta_init.py",
      "tests/test_frozen_stage3.py"],
     [], [f"{XEON}/bench_units.json"]),
    ("Communication overlapped with compute (delayed collectives)", ["tests/test_overlap.py"], ["tests_overlap"], []),
    ("Checkpoints across world sizes and stages; consolidation", ["tests/test_checkpoint.py", "tests/test_state.py"],
     [], []),
    ("DDP scripts' own checkpoints (`optimizer.state_dict()` complete, any world size)",
     ["tests/test_ddp_checkpoint.py"], ["tests_multirank"], []),
    ("Elastic restarts with torchrun's agents (2 agents on one machine)", ["tests/test_elastic.py"], [], []),
    ("Quantized communication (int8/int4 gradients, int8 gathers) on CPU",
     ["tests/test_quant_reduce.py", "tests/test_quant_gather.py", "tests/test_quant_kernels.py"], [],
     [f"{EPYC}/bench_comm.json"]),
    ("Quantization kernels on CUDA", [], ["tests_quant_cuda", "memcheck_quant", "racecheck_quant"], []),
    ("Hierarchical partitioning (`node_size`)", ["tests/test_hier.py"], [], [f"{EPYC}/bench_comm_hier.json"]),
    ("Muon / Adafactor on whole tensors, with AdamW beside them",
     ["tests/test_whole_tensor.py", "tests/test_fill_engine.py", "tests/test_whole_tensor_checkpoint.py"], [],
     [f"{EPYC}/bench_whole.json"]),
    ("Hugging Face transformers and PEFT models", ["tests/test_hf_models.py"], [], []),
    ("Pretrained safetensors loaded straight into shards (`zeroify(weights=...)`), streamed `save_pretrained`",
     ["tests/test_pretrained.py"], [], [f"{ZEN5}/bench_pretrained.json"]),
    ("Trainers: Lightning, Hugging Face Trainer, Accelerate", ["tests/test_integrations.py"], [], []),
    ("Memory estimator and `stage=\"auto\"`", ["tests/test_estimate.py", "tests/test_auto_stage.py",
                                               "tests/test_memory.py"], [], []),
    ("Gradients held only from a step's first gradient to `zero_grad(set_to_none=True)` (every stage); "
     "16-bit gradients sent as they are on gloo (half the ring, bit-identical)",
     ["tests/test_grad_lifetime.py", "tests/test_ring_slots.py"], [], [f"{XEON_0528}/bench_peak_process.json"]),
    ("16 bytes per parameter in stage 3 with bf16 (no bf16 shard kept)",
     ["tests/test_mixed_precision.py", "tests/test_stage3.py"], [], []),
    ("Divergent ranks named instead of a hang (`check_sequence`, on by default)",
     ["tests/test_diverge.py", "tests/test_failure.py", "tests/test_ddp_checkpoint.py"], ["tests_multirank"], []),
    ("torch's `clip_grad_norm_` on a zeroified model", ["tests/test_torch_clip.py"], [], []),
    ("DDP scripts as written: torch's GradScaler (fp16 autocast, skipped steps), optimizer state loaded "
     "before or after `zeroify`", ["tests/test_ddp_scripts.py"], [], []),
    ("The optimizer built after `zeroify(model)` or never given to it, adopted at the first forward",
     ["tests/test_optimizer_apart.py"], [], []),
    ("The README's multi-GPU launch, run as written", ["tests/test_readme_launch.py"], ["tests_readme"], []),
    ("Porting guides: DDP and FSDP2 scripts, DeepSpeed configs",
     ["tests/test_porting.py", "tests/test_from_deepspeed.py"], [], []),
    ("Optimizer offload to host memory (`offload=\"cpu\"`, stages 1-3), bit-identical to the run without it",
     ["tests/test_offload.py"], ["tests_offload", "bench_offload"], [f"{XEON}/bench_offload.json"]),
    ("Optimizer step in backward, no gradient shard (`step_in_backward=True`; stage 3: 12 B/param)",
     ["tests/test_step_in_backward.py"], [], []),
    ("bf16 optimizer states with stochastic rounding (`state_dtype=\"bf16\"`)",
     ["tests/test_state_dtype.py", "tests/test_kernels_bf16_states.py"],
     ["tests_bf16_states_cuda", "tests_state_dtype_cuda"], []),
    ("bf16 masters kept as a remainder under the bf16 parameter in stages 0-2 (`master_remainder`, on by "
     "default): 2 bytes and a tie bit per shard element instead of 4, bit-identical",
     ["tests/test_split_master.py", "tests/test_master_split_kernels.py"],
     ["tests_engine", "tests_master_split_cuda", "memcheck_master_split"], [f"{XEON}/bench_memory_peers.json"]),
    ("Parameter offload (to host memory or NVMe)", "not implemented", [], []),
    ("`torch.compile` of a zeroified model (compile then zeroify, and zeroify then compile), stages 0-3",
     ["tests/test_compile.py"], [], []),
    ("A rank that reads alone (rank-0 evaluation, `state_dict()`, `save_pretrained`) served by the others",
     ["tests/test_rank_alone.py"], [], []),
]


def gpu_check_results() -> list[tuple[str, dict]]:
    """[(benchmarks/reference/<gpu>/gpu-check.json relative path, parsed)], newest first."""
    found = [(p.relative_to(REFERENCE).as_posix(), json.loads(p.read_text())) for p in REFERENCE.glob("*/gpu-check.json")]
    return sorted(found, key=lambda x: x[1].get("date_utc", ""), reverse=True)


def reruns(rel: str) -> dict:
    """{step: {commit, why, result, command}}: benchmarks/reference/<gpu>/reruns.json beside a
    gpu-check.json, the steps run again by hand (in the same session, on the same machine) after
    a correction; runs.md beside it says how."""
    p = (REFERENCE / rel).with_name("reruns.json")
    if not p.exists():
        return {}
    out = json.loads(p.read_text())
    for step, r in out.items():
        if set(r) != {"commit", "why", "result", "command"}:
            raise DocsError(f"{p}: {step} needs exactly commit, why, result, command")
    return out


def machine_name(rel: str) -> str:
    """The short name of the machine a reference file was measured on."""
    meta_path = REFERENCE / rel.split("/")[0] / "machine.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    name = meta.get("name") or meta.get("machine") or ref(rel).get("gpu")
    if not name:
        raise DocsError(f"benchmarks/reference/{rel}: no machine name (machine.json)")
    return name


def gen_status(arg: str = "") -> str:
    checks = gpu_check_results()
    rows = []
    for feature, tests, steps, benches in STATUS:
        if isinstance(tests, str):                    # "not implemented", "not tested"
            rows.append([feature, tests, tests, "-"])
            continue
        for t in tests:
            if not (ROOT / t).exists():
                raise DocsError(f"the status table names {t}, which does not exist")
        cpu = ", ".join(f"`{pathlib.Path(t).name}`" for t in tests) if tests else "none"
        gpu, missing = [], []
        for step in steps:
            found = [(rel, check, s) for rel, check in checks for s in check.get("steps", []) if s["name"] == step]
            if not found:
                missing.append(f"`{step}`")
                continue
            rel, check, hit = found[0]                       # the newest result file that ran it
            t = hit.get("tests")
            counts = f", {t['tests'] - t['skipped']} of {t['tests']} tests ran" if isinstance(t, dict) else ""
            rerun = reruns(rel).get(step)
            again = f"; re-run after {rerun['why']}: {rerun['result']} ({rerun['commit'][:7]})" if rerun else ""
            commit = hit.get("commit") or check.get("commit", "")   # a merged file: per step
            last = ""
            if hit["status"] != "passed":                    # the commit the GPU last passed it on
                passed = [(c, s) for _, c, s in found[1:] if s["status"] == "passed"]
                last = (f"; last passed on {passed[0][0].get('gpu')} at {str(passed[0][1].get('commit') or passed[0][0].get('commit'))[:7]}"
                        if passed else "; never passed")
            gpu.append(f"`{step}` {hit['status']} on {check.get('gpu')} ({str(commit)[:7]}{counts}{again}{last})")
        if missing:
            gpu.append("no result yet: " + ", ".join(missing))
        if not steps:
            gpu = ["not in `make gpu-check`" if any(w in feature for w in ("GPU", "CUDA", "NCCL")) else "-"]
        measured = ", ".join(f"{machine_name(b)} (`{b.split('/')[-1]}`)" for b in benches) or "-"
        rows.append([feature, cpu, "; ".join(gpu), measured])
    head = ("What ran where. CPU: the tests `make test` runs (CI runs it on every change, on CPU). "
            "GPU: the steps of `make gpu-check`, read from the result file it writes "
            "(`benchmarks/reference/<gpu>/gpu-check.json`)")
    if checks:
        head += ": " + ", ".join(f"`{rel}`" for rel, _ in checks)
        notes = [rel.split("/")[0] + "/runs.md" for rel, _ in checks if (REFERENCE / rel).with_name("runs.md").exists()]
        if notes:
            head += " (how each ran, what was re-run and what is open: " + ", ".join(f"`{n}`" for n in notes) + ")"
    else:
        head += "; no such file is in the repository yet, so no GPU test result is claimed"
    head += ". Benchmarked on: the result files under `benchmarks/reference/`, shown on the Performance page.\n\n"
    return head + table(["feature", "CPU tests (`make test`)", "GPU (`make gpu-check`)", "benchmarked on"], rows)


# ------------------------------------------------------------------ notes, options, errors, DeepSpeed keys

NOTE_DIRS = ("zero_ext", "csrc", "tests", "benchmarks", "examples")
NOTE_SUFFIXES = {".py", ".c", ".h", ".cpp", ".cu", ".cuh"}
NOTE_HEADING = re.compile(r'^\s*(?://+|#+|/\*+|\*|""")?\s*Note \[([^\]]+)\]\s*$')
COMMENT_PREFIX = re.compile(r'^\s*(?://+|#+|/\*+|\*+/?|""")?\s?')


def notes() -> list[tuple[str, str, str]]:
    """[(note name, file, its first sentence)] for every `Note [X]` heading (tests/test_notes.py's rule)."""
    found = []
    paths = [ROOT / "setup.py"] + [p for d in NOTE_DIRS for p in sorted((ROOT / d).rglob("*"))
                                   if p.is_file() and p.suffix in NOTE_SUFFIXES and "build" not in p.parts]
    for path in paths:
        lines = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            m = NOTE_HEADING.match(line)
            if not m or path.name == "test_notes.py":
                continue
            body = []
            for nxt in lines[i + 1:i + 12]:
                t = COMMENT_PREFIX.sub("", nxt).strip().rstrip("*/").strip()
                if re.fullmatch(r"[~=\-]+", t):        # an underline
                    continue
                if not t:
                    if body:
                        break
                    continue
                body.append(t)
            text = " ".join(body)
            first = re.split(r"(?<=[a-z0-9)\]`'])\.\s", text, maxsplit=1)[0]
            found.append((m.group(1), path.relative_to(ROOT).as_posix(), first[:220]))
    return sorted(found, key=lambda n: n[0].lower())


def gen_notes(arg: str = "") -> str:
    rows = [[f"Note [{name}]", f"`{path}`", _cell(text)] for name, path, text in notes()]
    return table(["note", "file", "begins"], rows)


def _cell(text: str) -> str:
    """Text for a table cell: no column breaks, no HTML, no reference-style links."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("[", "\\[")


def zeroconfig_options() -> list[tuple[str, str, str]]:
    """[(option, default as written in zero_ext/config.py, description)] from ZeroConfig's
    fields and its docstring (read as text: nothing imported)."""
    tree = ast.parse((ROOT / "zero_ext" / "config.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ZeroConfig")
    defaults = {n.target.id: ast.unparse(n.value) for n in cls.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None}
    doc = ast.get_docstring(cls, clean=True)
    entries, current, pending = {}, None, ""
    for line in doc.splitlines():
        if re.match(r"^[a-z_][a-z0-9_]*(?:,\s*[a-z_][a-z0-9_]*)*,$", line):   # a list of names going on
            pending += line + " "
            continue
        m = re.match(r"^([a-z_][a-z0-9_]*(?:,\s*[a-z_][a-z0-9_]*)*),?:\s*(.*)$", pending + line)
        pending = ""
        if m and not line.startswith(" "):
            names = [n.strip() for n in m.group(1).split(",")]
            current = names
            text = m.group(2)
            for n in names:
                entries.setdefault(n, "")
            entries[names[0]] = text
            continue
        if current and line.startswith(" "):
            entries[current[0]] += " " + line.strip()
        elif current and not line.strip():
            current = None
    grouped = {}
    for name in defaults:
        if name not in entries:
            raise DocsError(f"ZeroConfig.{name} has no entry in its docstring (zero_ext/config.py)")
        grouped[name] = entries[name] or "see above"
    return [(n, defaults[n], grouped[n]) for n in defaults]


def gen_options(arg: str = "") -> str:
    rows = [[f"`{n}`", f"`{d}`", _cell(text)] for n, d, text in zeroconfig_options()]
    return table(["option", "default", "meaning"], rows)


def deepspeed_keys() -> dict:
    tree = ast.parse((ROOT / "zero_ext" / "from_deepspeed.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "KEYS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise DocsError("zero_ext/from_deepspeed.py has no KEYS table")


def gen_deepspeed_keys(arg: str = "") -> str:
    verdicts = {"maps": "`{arg}`", "not needed": "not needed", "script": "your training loop",
                "not supported": "not supported", "if disabled": "not supported (accepted when off)"}
    rows = [[f"`{k}`", verdicts[v].format(arg=a), _cell(why)] for k, (v, a, why) in deepspeed_keys().items()]
    return table(["DeepSpeed key", "zeroify", "why"], rows)


RAISERS = {"ZeroInputError", "ZeroUsageError", "CheckpointError", "ValueError", "TypeError", "RuntimeError",
           "FileNotFoundError", "NotImplementedError", "KeyError"}
HELPERS = {"_fail": "ZeroInputError", "need": "ValueError", "_rule": "ValueError"}


def _is_rule_row(node) -> bool:
    """A tuple ending in a message lambda and an exception class: a rule of config.py's _RULES."""
    return (isinstance(node, ast.Tuple) and len(node.elts) >= 2 and isinstance(node.elts[-2], ast.Lambda)
            and isinstance(node.elts[-1], ast.Name) and node.elts[-1].id in RAISERS)


def _template(node) -> str | None:
    """A message expression as text, `{...}` for what is filled in at run time."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        out = ""
        for v in node.values:
            if isinstance(v, ast.Constant):
                out += str(v.value)
            else:
                expr = ast.unparse(v.value)
                out += "{" + (expr if len(expr) <= 24 else expr[:22] + "..") + "}"
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _template(node.left), _template(node.right)
        if a is None and b is None:
            return None
        return (a if a is not None else "{...}") + (b if b is not None else "{...}")
    return None


def python_errors() -> list[tuple[str, str, str]]:
    """[(exception, message template, file)] for every raise in zero_ext/ with a message."""
    out = []
    for path in sorted((ROOT / "zero_ext").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            call, kind = None, None
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                f = node.exc.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in RAISERS:
                    call, kind = node.exc, name
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in HELPERS:
                call, kind = node, HELPERS[node.func.id]
            elif _is_rule_row(node):   # config.py's _RULES: (..., message lambda, error)
                call, kind = ast.Call(func=ast.Name("_rule"), args=[node.elts[-2]], keywords=[]), node.elts[-1].id
            if call is None or not call.args:
                continue
            name = getattr(call.func, "id", "")
            if name == "_rule" and len(call.args) > 2:   # _rule(option, ok, message, ..., error=...)
                kind = next((k.value.id for k in call.keywords if k.arg == "error"), kind)
            arg = (call.args[-1] if kind == "ValueError" and name == "need" else
                   call.args[2] if name == "_rule" and len(call.args) > 2 else call.args[0])
            msg = _template(arg.body if isinstance(arg, ast.Lambda) else arg)
            if msg is None:
                continue
            if getattr(call.func, "id", "") in HELPERS and not msg.startswith("zero_ext:"):
                msg = "zero_ext: " + msg
            if "internal" in msg.split(":", 2)[1:2] or "zero_ext: internal" in msg:
                continue
            out.append((kind, msg, rel))
    return out


CHECK = re.compile(r"\bTORCH_CHECK\(")
CPP_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def cpp_errors() -> list[tuple[str, str, str]]:
    """[("RuntimeError", message template, file)] for the TORCH_CHECKs in csrc/ that users can meet."""
    out = []
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix not in (".cpp", ".h", ".cu") or "core" in path.parts:
            continue
        src = path.read_text(errors="replace")
        for m in CHECK.finditer(src):
            depth, i, args, start = 1, m.end(), [], m.end()
            in_str = False
            while i < len(src) and depth:
                c = src[i]
                if in_str:
                    if c == "\\":
                        i += 1
                    elif c == '"':
                        in_str = False
                elif c == '"':
                    in_str = True
                elif c in "([{":
                    depth += 1
                elif c in ")]}":
                    depth -= 1
                    if not depth:
                        args.append(src[start:i])
                elif c == "," and depth == 1:
                    args.append(src[start:i])
                    start = i + 1
                i += 1
            parts = []
            for a in args[1:]:
                a = a.strip()
                strings = CPP_STRING.findall(a)
                if strings and CPP_STRING.sub("", a).strip() == "":
                    parts.append("".join(strings))
                else:
                    a = " ".join(a.split())
                    parts.append("{" + (a if len(a) <= 24 else a[:22] + "..") + "}")
            msg = "".join(parts).replace('\\"', '"').replace("\\n", " ")
            if not msg or "internal" in msg or "zero_ext" not in msg:
                continue
            out.append(("RuntimeError", msg, path.relative_to(ROOT).as_posix()))
    return out


def gen_errors(arg: str = "") -> str:
    seen, rows = set(), []
    order = ["ZeroInputError", "ZeroUsageError", "CheckpointError", "ValueError", "TypeError", "FileNotFoundError",
             "KeyError", "NotImplementedError", "RuntimeError"]
    for kind, msg, rel in sorted(python_errors() + cpp_errors(), key=lambda e: (order.index(e[0]), e[2], e[1])):
        if (kind, msg) in seen:
            continue
        seen.add((kind, msg))
        rows.append([f"`{kind}`", _cell(" ".join(msg.split())), f"`{rel}`"])
    return (f"{len(rows)} messages, read from the sources (`{{...}}` is filled in when raised).\n\n"
            + table(["raised as", "message", "raised in"], rows))


GENERATORS = {
    "perf-headline": gen_perf_headline, "perf-optimizer-gpu": gen_perf_optimizer_gpu,
    "perf-optimizer-cpu": gen_perf_optimizer_cpu, "perf-units": gen_perf_units, "perf-comm": gen_perf_comm,
    "perf-comm-hier": gen_perf_comm_hier, "perf-whole": gen_perf_whole, "perf-memory": gen_perf_memory,
    "perf-sequence": gen_perf_sequence, "perf-offload": gen_perf_offload, "perf-peak-gpu": gen_perf_peak_gpu,
    "perf-rank-alone": gen_perf_rank_alone,
    "perf-pretrained": gen_perf_pretrained, "perf-peak-process": gen_perf_peak_process,
    "perf-compile": gen_perf_compile, "status": gen_status,
    "notes": gen_notes, "options": gen_options, "deepspeed-keys": gen_deepspeed_keys, "errors": gen_errors,
}
# Generators whose text states figures read from benchmarks/reference/ (exempt from the stray-figure scan).
FROM_REFERENCE = {"perf-headline", "perf-optimizer-gpu", "perf-optimizer-cpu", "perf-units", "perf-comm",
                  "perf-comm-hier", "perf-whole", "perf-memory", "perf-sequence", "perf-offload", "perf-peak-gpu", "perf-rank-alone",
                  "perf-pretrained", "perf-peak-process", "perf-compile", "status"}


def generate(name: str, arg: str | None = None) -> str:
    if name not in GENERATORS:
        raise DocsError(f"unknown generated region {name!r}; known: {', '.join(GENERATORS)}")
    return GENERATORS[name](arg or "")


# ------------------------------------------------------------------ README regions, page markers

def render_regions(text: str) -> str:
    """text with every `<!-- gen:NAME -->...<!-- /gen:NAME -->` region regenerated."""
    def sub(m):
        head = f"<!-- gen:{m.group(1)}{' ' + m.group(2) if m.group(2) else ''} -->"
        return f"{head}\n{generate(m.group(1), m.group(2))}<!-- /gen:{m.group(1)} -->"
    return REGION.sub(sub, text)


def expand_markers(text: str) -> str:
    """A docs page with each lone `<!-- gen:NAME [ARG] -->` line replaced by its generated text."""
    return MARKER.sub(lambda m: generate(m.group(1), m.group(2)).rstrip("\n"), text)


# ------------------------------------------------------------------ stray figures

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK_TARGET = re.compile(r"\]\([^)]*\)")
FIGURE = re.compile(
    r"(?<![\w.\-/])(?:"
    r"\d+(?:\.\d+)?\s?%"                     # 12%, 0.5 %
    r"|\d+(?:\.\d+)?[x×](?![\w-])"           # 1.3x, 2x
    r"|\d+\.\d+(?![\w]|\.\d)"                # 0.92 (not 2.13.0)
    r")")
NOT_A_FIGURE = re.compile(
    r"(?:within|at most|under|below|bound(?: of)?|target(?: of)?|tolerance(?: of)?|up to|<=|≤|>=|≥|<|>|±)\s*$"   # tolerances, limits
    r"|(?:torch|python|Python|CUDA|cuda|version|transformers|peft|DeepSpeed|deepspeed|mkdocs|sm_|nvcc|"
    r"lightning|accelerate|mkdocstrings(?:-python)?|==)\s*$", re.I)


# Generators that quote the sources verbatim (the first sentence of each note, each error
# message): their numbers are the code's (analytic ratios, limits), not the docs' claims.
QUOTES_SOURCES = {"notes", "errors"}


def strip_for_scan(text: str, exempt: set[str] = FROM_REFERENCE | QUOTES_SOURCES) -> str:
    """text without code, comments, link targets and the regions of reference-fed generators."""
    text = REGION.sub(lambda m: "" if m.group(1) in exempt else m.group(3), text)
    text = FENCE.sub("", text)
    text = CODE_SPAN.sub("", text)
    text = HTML_COMMENT.sub("", text)
    return LINK_TARGET.sub("]", text)


def stray_figures(text: str) -> list[str]:
    """The measured-looking numbers in text that no reference-fed generator produced."""
    text = strip_for_scan(text)
    found = []
    for m in FIGURE.finditer(text):
        if NOT_A_FIGURE.search(text[max(0, m.start() - 16):m.start()]):
            continue
        line_start = text.rfind("\n", 0, m.start()) + 1
        line_end = text.find("\n", m.end())
        found.append(f"{m.group(0)!r} in: {text[line_start:line_end if line_end >= 0 else None].strip()[:160]}")
    return found


def page_with_generated(text: str) -> str:
    """A docs page as the scan sees it: markers expanded, wrapped as regions so the
    reference-fed ones are exempt."""
    return MARKER.sub(lambda m: f"<!-- gen:{m.group(1)}{' ' + m.group(2) if m.group(2) else ''} -->\n"
                                f"{generate(m.group(1), m.group(2))}<!-- /gen:{m.group(1)} -->", text)


# ------------------------------------------------------------------ mkdocs hook

def on_files(files, config):
    from mkdocs.structure.files import File
    for path, content in plots().items():
        files.append(File.generated(config, path, content=content))
    return files


REPO_LINK = re.compile(r"\[([^\]]+)\]\(((?:\.\./)+[^)#\s]+)\)")


def repo_links(markdown: str, src_uri: str) -> str:
    """Links from a docs page to repository files outside docs/ (`[x](../examples/a.py)`,
    which work when the page is read on GitHub) become the file's path in code on the site;
    one to a file that does not exist raises."""
    page_dir = (DOCS / src_uri).parent

    def sub(m):
        target = (page_dir / m.group(2)).resolve()
        if DOCS.resolve() in target.parents:
            return m.group(0)                       # inside docs/: mkdocs checks it
        if not target.exists() or ROOT not in target.parents:
            raise DocsError(f"link to {m.group(2)}: no such file in the repository")
        rel = target.relative_to(ROOT).as_posix()
        return m.group(1) if m.group(1).strip("`") == rel else f"{m.group(1)} (`{rel}`)"
    return REPO_LINK.sub(sub, markdown)


def public_names() -> list[str]:
    """zero_ext.__all__, read from zero_ext/__init__.py."""
    tree = ast.parse((ROOT / "zero_ext" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise DocsError("zero_ext/__init__.py has no __all__")


def missing_api_entries(api_markdown: str) -> list[str]:
    """The names of zero_ext.__all__ that have no `::: zero_ext.[module.]name` entry."""
    entries = set(re.findall(r"^::: zero_ext\.(?:[\w.]+\.)?(\w+)$", api_markdown, re.M))
    return [n for n in public_names() if n not in entries]


def on_page_markdown(markdown, page, config, files):
    try:
        if page.file.src_uri == "api.md" and missing_api_entries(markdown):
            raise DocsError(f"no API entry for {missing_api_entries(markdown)} (zero_ext.__all__)")
        return repo_links(expand_markers(markdown), page.file.src_uri)
    except DocsError as e:
        from mkdocs.exceptions import PluginError
        raise PluginError(f"{page.file.src_uri}: {e}") from None


# ------------------------------------------------------------------ command line

def main(argv: list[str]) -> int:
    check = "--check" in argv
    old = README.read_text()
    new = render_regions(old)
    if check:
        if new != old:
            print("README.md's generated regions are stale: run python tools/docsgen.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        README.write_text(new)
        print("README.md: generated regions rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
