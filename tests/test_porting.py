"""The porting guide's diff, applied and run: docs/porting.md "From DDP" turns
examples/port_from_ddp.py (a DDP script: accumulation with require_backward_grad_sync,
torch.nn.utils.clip_grad_norm_, evaluation, a checkpoint) into a stage-3 zero_ext script
with three small hunks. Both run under torchrun on 2 gloo ranks; the zero_ext one must
log the same losses (rel 1e-4), the same validation loss and the same saved weights.
A hunk that no longer applies to the script fails here, so the guide cannot drift.
"""
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "porting.md"
SCRIPT = ROOT / "examples" / "port_from_ddp.py"
REL = 1e-4


def ddp_hunks() -> list[tuple[list[str], list[str]]]:
    section = GUIDE.read_text().split("## From DDP", 1)[1].split("\n## ", 1)[0]
    hunks = []
    for block in re.findall(r"```diff\n(.*?)```", section, re.S):
        lines = block.rstrip("\n").split("\n")
        hunks.append(([l[1:] for l in lines if l.startswith("-")], [l[1:] for l in lines if l.startswith("+")]))
    return hunks


def apply(text: str, hunks) -> str:
    for old, new in hunks:
        before = "\n".join(old) + "\n"
        assert text.count(before) == 1, f"the guide's hunk does not apply to {SCRIPT.name}:\n{before}"
        text = text.replace(before, "\n".join(new) + "\n")
    return text


def run(script: pathlib.Path, out: pathlib.Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "examples")]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b), 1.0)


def test_ddp_guide_diff_trains_like_ddp(tmp_path):
    hunks = ddp_hunks()
    assert len(hunks) >= 2, f"docs/porting.md 'From DDP' has {len(hunks)} diff blocks"
    ported = tmp_path / "port_zero.py"
    ported.write_text(apply(SCRIPT.read_text(), hunks))
    assert "DDP" not in ported.read_text().split('"""', 2)[2], "the ported script still uses DDP"
    (tmp_path / "data").symlink_to(ROOT / "examples" / "data")
    ddp = run(SCRIPT, tmp_path / "ddp.json")
    zero = run(ported, tmp_path / "zero.json")
    print(f"\nlosses DDP {[round(x, 4) for x in ddp['losses']]}\n       zero {[round(x, 4) for x in zero['losses']]}")
    assert len(ddp["losses"]) == len(zero["losses"]) > 1
    bad = [(k, a, b) for k, (a, b) in enumerate(zip(ddp["losses"], zero["losses"])) if not close(a, b)]
    assert not bad, f"per-step losses differ from DDP's (step, DDP, zero_ext): {bad}"
    assert close(ddp["val"], zero["val"]), (ddp["val"], zero["val"])
    assert ddp["params"].keys() == zero["params"].keys()
    off = {k: (ddp["params"][k], zero["params"][k]) for k in ddp["params"]
           if abs(ddp["params"][k] - zero["params"][k]) > 1e-3 * max(1.0, abs(ddp["params"][k]))}
    assert not off, f"saved weights differ from DDP's (sum per tensor): {off}"
