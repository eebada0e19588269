"""The README's multi-GPU launch, executed as written.

README.md's "GPUs" section holds the launch line (the first line starting with
"torchrun --standalone"); the script it runs is shown in full on the docs page
docs/guide/gpus.md (its first ```python block), which must be examples/train_multigpu.py
byte for byte. This writes the script as the page shows it to a temporary file and runs
the README's launch line with python -m torch.distributed.run, two processes instead of
eight, the checkpoint in a temporary directory and fewer steps:

- CPU: ZX_BACKEND=gloo (the script's override of "nccl"): exit 0, rank 0 prints the
  documented lines, the loss falls; then one process resumes from the 2-process
  checkpoint, as the docs say a restarted job does (any world size).
- GPU (skipped without CUDA): ZX_BACKEND=cuda:gloo, two ranks sharing one GPU.

About 40 s on 2 CPU cores.
"""
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
GPU_PAGE = os.path.join(ROOT, "docs", "guide", "gpus.md")
EXAMPLE = os.path.join(ROOT, "examples", "train_multigpu.py")
TIMEOUT_S = 240
LINE = re.compile(r"^step (\d+) loss ([0-9.]+) world size (\d+) (cpu|cuda)$")


def _gpu_section() -> str:
    text = open(README, encoding="utf-8").read()
    start = text.index("\n## GPUs")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def readme_script() -> str:
    """The script as the docs show it: docs/guide/gpus.md's first ```python block."""
    m = re.search(r"```python\n(.*?)```", open(GPU_PAGE, encoding="utf-8").read(), re.S)
    assert m, "docs/guide/gpus.md has no ```python block"
    return m.group(1)


def readme_launch() -> list[str]:
    lines = [line.split("#")[0].strip() for line in _gpu_section().splitlines()
             if line.startswith("torchrun --standalone")]
    assert lines, "README's GPUs section has no line starting with 'torchrun --standalone'"
    return shlex.split(lines[0])


def _command(script, nproc, checkpoint, steps):
    """The README's launch line with python -m torch.distributed.run for torchrun, nproc
    processes, the script at `script` and the checkpoint at `checkpoint`."""
    argv = readme_launch()
    assert argv[0] == "torchrun" and "--standalone" in argv, argv
    out = [sys.executable, "-m", "torch.distributed.run"]
    for a in argv[1:]:
        if a.startswith("--nproc_per_node="):
            a = f"--nproc_per_node={nproc}"
        elif a == "examples/train_multigpu.py":
            a = script
        out.append(a)
    assert script in out, f"the launch line does not run examples/train_multigpu.py: {argv}"
    i = out.index("--checkpoint")
    out[i + 1] = checkpoint
    return out + ["--steps", str(steps)]


def _run(cmd, backend):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["ZX_BACKEND"] = backend
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "examples"), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{shlex.join(cmd)} did not finish in {TIMEOUT_S} s:\n{output[-4000:]}")
    assert proc.returncode == 0, f"{shlex.join(cmd)} exited with {proc.returncode}:\n{output[-4000:]}"
    return output


def _steps(output):
    return [(int(m.group(1)), float(m.group(2)), int(m.group(3)), m.group(4))
            for m in (LINE.match(line.strip()) for line in output.splitlines()) if m]


def test_readme_shows_the_example_verbatim():
    assert readme_script() == open(EXAMPLE, encoding="utf-8").read(), \
        "docs/guide/gpus.md's script differs from examples/train_multigpu.py: make them the same"
    assert 'dist.init_process_group(backend)' in readme_script() and '"nccl"' in readme_script()
    assert "examples/train_multigpu.py" in _gpu_section() and "docs/guide/gpus.md" in _gpu_section()
    assert "ZX_BACKEND" in open(GPU_PAGE, encoding="utf-8").read()


def _launch_and_resume(tmp_path, backend, device):
    script = tmp_path / "train_multigpu.py"
    script.write_text(readme_script(), encoding="utf-8")
    ckpt = str(tmp_path / "ckpt")
    out = _run(_command(str(script), 2, ckpt, 60), backend)
    steps = _steps(out)
    assert [s for s, *_ in steps] == [0, 50, 59], out[-4000:]
    assert all(w == 2 and d == device for _, _, w, d in steps), steps
    first, last = steps[0][1], steps[-1][1]
    assert last < first - 0.8, f"the loss did not fall: {steps}"
    assert os.path.isdir(ckpt), "no checkpoint at step 50"
    # a restarted job, at another world size, resumes from the last checkpoint
    out = _run(_command(str(script), 1, ckpt, 70), backend)
    assert f"resumed from {ckpt} at step 50, world size 1" in out, out[-4000:]
    resumed = _steps(out)
    assert [s for s, *_ in resumed] == [50, 69] and all(w == 1 for _, _, w, _ in resumed), resumed
    assert resumed[-1][1] < first - 0.8, resumed


@pytest.mark.dist
def test_readme_launch_on_cpu(tmp_path):
    _launch_and_resume(tmp_path, "gloo", "cpu")


@pytest.mark.dist
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False")
def test_readme_launch_on_one_gpu(tmp_path):
    from zero_ext import _C
    if not hasattr(_C, "cuda_adam_step"):
        pytest.skip("no CUDA build: zero_ext._C was built without CUDA (no cuda_adam_step)")
    _launch_and_resume(tmp_path, "cuda:gloo", "cuda")
