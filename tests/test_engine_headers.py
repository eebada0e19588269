"""The engine (csrc/engine/) is C++ on ATen and c10d alone: no pybind11, no Python.

Only the binding (csrc/*.cpp) includes torch/extension.h and builds Python objects; the
engine returns plain data (Note [Engine stats], csrc/engine/stats.h) that the binding
converts. Checked twice:
1. the text: no file under csrc/engine/ includes torch/extension.h, torch/python.h, a
   pybind11 header or Python.h, or mentions `py::`; nor does a header of this repository
   that such a file includes (kernels_binding.h would bring torch/extension.h along);
2. the preprocessor: every csrc/engine/*.cpp together, as the unity build compiles them
   (Note [Unity build] in setup.py), reaches no pybind11 or Python header through any
   include, torch's own included (about 2 s; skipped without a C++ compiler). The CUDA
   kernel table's ZX_WITH_CUDA branch is checked likewise in tests/test_cuda_compile.py.
"""
import pathlib
import re
import shutil
import subprocess
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
ENGINE = CSRC / "engine"
BANNED_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]*(?:torch/extension\.h|torch/python\.h|pybind11|Python\.h)'
                            r'[^>"]*)[>"]', re.M)
QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
# A line marker of the preprocessor's output: # <line> "<file>" [flags]
LINE_MARKER = re.compile(r'^# \d+ "([^"]+)"', re.M)


def _engine_files():
    files = sorted(p for p in ENGINE.rglob("*") if p.is_file())
    assert any(p.suffix == ".cpp" for p in files) and any(p.suffix == ".h" for p in files), "no engine sources found"
    return files


def _resolve(name: str, includer: pathlib.Path):
    for base in (includer.parent, CSRC, CSRC / "core"):   # setup.py's include_dirs: csrc, csrc/core
        if (base / name).is_file():
            return (base / name).resolve()
    return None


def test_engine_sources_include_no_python():
    problems = []
    seen, todo = set(), [(p, p) for p in _engine_files()]
    while todo:
        path, via = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        text = path.read_text(errors="replace")
        rel = path.relative_to(ROOT).as_posix()
        where = rel if via == path else f"{rel} (included from {via.relative_to(ROOT).as_posix()})"
        problems += [f"{where} includes {m.group(1)}" for m in BANNED_INCLUDE.finditer(text)]
        if via == path:   # the engine's own files: no Python objects either
            problems += [f"{rel}:{text.count(chr(10), 0, m.start()) + 1} mentions py::"
                         for m in re.finditer(r"\bpy::", text)]
        for m in QUOTED_INCLUDE.finditer(text):
            target = _resolve(m.group(1), path)
            if target is not None:
                todo.append((target, via))
    assert not problems, ("the engine must not depend on pybind11 or Python (build plain C++ data and convert it "
                          "in the binding, csrc/stats_binding.cpp or binding.cpp):\n  " + "\n  ".join(problems))


def python_headers(preprocessed: str) -> list:
    """The pybind11 and Python headers the preprocessed text came through."""
    return sorted({f for f in LINE_MARKER.findall(preprocessed) if "/pybind11/" in f or f.endswith("/Python.h")})


def test_engine_translation_unit_reaches_no_python_header(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH: the engine's includes are not preprocessed")
    from torch.utils import cpp_extension
    unity = tmp_path / "engine.cpp"
    unity.write_text("".join(f'#include "engine/{p.name}"\n' for p in _engine_files() if p.suffix == ".cpp"))
    includes = cpp_extension.include_paths() + [str(CSRC), str(CSRC / "core"), sysconfig.get_paths()["include"]]
    cmd = [cxx, "-std=c++20", "-E", "-DTORCH_EXTENSION_NAME=_C"] + [f"-I{p}" for p in includes] + [str(unity)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, f"preprocessing the engine failed:\n{proc.stderr[-4000:]}"
    reached = python_headers(proc.stdout)
    assert not reached, (f"the engine's translation unit includes {len(reached)} pybind11/Python headers:\n  " +
                         "\n  ".join(reached[:12]))
