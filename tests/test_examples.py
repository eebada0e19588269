"""Run every example at a tiny size, on one process and under torchrun with 2 ranks.

Each run is a subprocess with a timeout; a test fails with the run's output when the
return code is non-zero, the summary line is missing, or the numbers it reports
(--json where the example has it, else the summary line) show no learning. The runs
are deterministic (fixed seeds, one thread per rank), so the thresholds are not flaky.
About a minute in all on 2 CPU cores; torchrun launches are kept to four.
"""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
TIMEOUT_S = 300


def run_example(script, args, nproc=1):
    """Run examples/<script> with args on nproc processes (torchrun when > 1). Returns stdout+stderr."""
    path = os.path.join(EXAMPLES, script)
    if nproc == 1:
        cmd = [sys.executable, path, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               path, *args]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    # Own session, so a timed-out torchrun is killed together with its ranks.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {TIMEOUT_S} s; output:\n{output[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}; output:\n{output[-6000:]}")
    return output


def summary_line(output, prefix="summary:"):
    """The one line starting with prefix; fails the test (with the output) when there is not exactly one."""
    lines = [line for line in output.splitlines() if line.startswith(prefix)]
    if len(lines) != 1:
        pytest.fail(f"expected one line starting with {prefix!r}, found {len(lines)}; output:\n{output[-6000:]}")
    return lines[0]


def run_classifier(script, tmp_path, args, nproc=1):
    """Run a classifier example (train_cnn.py / train_encoder.py) with --tiny --json; returns the JSON summary."""
    out = tmp_path / f"{script}-{nproc}-{'_'.join(a.strip('-') for a in args)}.json"
    output = run_example(script, ["--tiny", "--threads", "1", "--json", str(out), *args], nproc)
    summary_line(output)
    assert out.exists(), f"{script} wrote no --json file; output:\n{output[-6000:]}"
    return json.loads(out.read_text())


def assert_learned(summary, min_accuracy):
    assert summary["final_loss"] < 0.7 * summary["initial_loss"], (
        f"loss did not fall: initial {summary['initial_loss']:.4f}, final {summary['final_loss']:.4f}")
    assert summary["eval_accuracy"] >= min_accuracy, (
        f"held-out accuracy {summary['eval_accuracy']:.3f} < {min_accuracy}")
    assert all(total > 0 for total in summary["model_state_bytes_per_rank"])


# ----------------------------------------------------------------------------- one process

@pytest.mark.parametrize("script, min_accuracy", [("train_cnn.py", 0.5),        # chance 0.1
                                                  ("train_encoder.py", 0.75)])  # chance 0.5
def test_classifier_one_process(script, min_accuracy, tmp_path):
    summary = run_classifier(script, tmp_path, ["--stage", "2", "--steps", "60"])
    assert summary["world_size"] == 1 and summary["stage"] == 2
    assert_learned(summary, min_accuracy)


@pytest.mark.parametrize("script, min_accuracy", [("train_cnn.py", 0.5), ("train_encoder.py", 0.75)])
def test_classifier_bf16_stage3_one_process(script, min_accuracy, tmp_path):
    """--dtype bf16 at stage 3: bf16 compute (BatchNorm statistics included) with fp32
    master weights still learns."""
    summary = run_classifier(script, tmp_path, ["--stage", "3", "--dtype", "bf16", "--steps", "60"])
    assert summary["zero_ext_stats"]["param_dtype"] == "bf16" and summary["stage"] == 3
    assert summary["model_state_bytes"]["master_weights"] > 0
    assert_learned(summary, min_accuracy)


def test_classifier_rejects_fp16_for_ddp():
    path = os.path.join(EXAMPLES, "train_cnn.py")
    result = subprocess.run([sys.executable, path, "--tiny", "--ddp", "--dtype", "fp16"], cwd=ROOT,
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode != 0
    assert "--dtype fp16 is for zero_ext" in result.stderr, result.stderr


def parse_linear_regression(output):
    line = summary_line(output)
    numbers = {key: float(re.search(rf"{key} ([0-9.eE+-]+)", line).group(1))
               for key in ("initial loss", "final loss", "max weight error")}
    assert numbers["final loss"] < 1e-3 * numbers["initial loss"], line
    assert numbers["max weight error"] < 0.02, line


def test_linear_regression_one_process():
    parse_linear_regression(run_example("linear_regression.py", []))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpt_one_process(tmp_path, dtype):
    # train_gpt.py prints no "summary:" line; its last report starts with "final |".
    out = tmp_path / "gpt.json"
    output = run_example("train_gpt.py", ["--stage", "2", "--dtype", dtype, "--steps", "10", "--warmup", "1", "--lr-warmup", "1",
                                          "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
                                          "--block-size", "16", "--batch-size", "4", "--eval-iters", "2",
                                          "--sample-chars", "0", "--threads", "1", "--json", str(out)])
    summary_line(output, prefix="final |")
    summary = json.loads(out.read_text())
    assert summary["final_train_loss"] < summary["losses"][0] - 0.05, (summary["losses"], summary["final_train_loss"])
    assert summary["dtype"] == dtype == summary["zero_ext_stats"]["param_dtype"]


# ----------------------------------------------------------------------------- torchrun, 2 ranks

def test_cnn_two_ranks_stage2_matches_ddp(tmp_path):
    """Stage 2 on 2 ranks learns, shards the model state, and follows DDP's loss curve
    (BatchNorm buffers broadcast from rank 0 as DDP does, SGD momentum as torch's)."""
    zero = run_classifier("train_cnn.py", tmp_path, ["--stage", "2", "--steps", "40"], nproc=2)
    ddp = run_classifier("train_cnn.py", tmp_path, ["--ddp", "--steps", "40"], nproc=2)
    assert zero["world_size"] == 2 and ddp["world_size"] == 2
    assert_learned(zero, min_accuracy=0.5)
    assert zero["losses"] == pytest.approx(ddp["losses"], rel=1e-3, abs=1e-4)
    assert zero["eval_loss"] == pytest.approx(ddp["eval_loss"], rel=1e-3)   # running stats as DDP's
    assert zero["eval_accuracy"] == pytest.approx(ddp["eval_accuracy"], abs=0.02)
    # SGD with momentum: DDP holds 12 bytes per parameter, stage 2 about 4 + 8/N.
    assert max(zero["model_state_bytes_per_rank"]) < 0.75 * min(ddp["model_state_bytes_per_rank"])


def test_encoder_two_ranks_stage1(tmp_path):
    summary = run_classifier("train_encoder.py", tmp_path, ["--stage", "1", "--steps", "60"], nproc=2)
    assert summary["world_size"] == 2 and summary["stage"] == 1
    assert_learned(summary, min_accuracy=0.75)
    stats = summary["zero_ext_stats"]
    assert stats["comm"]["reduce_scatter"]["calls"] > 0 and stats["comm"]["all_gather"]["calls"] > 0


def test_linear_regression_two_ranks():
    parse_linear_regression(run_example("linear_regression.py", [], nproc=2))
