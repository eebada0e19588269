"""Compile every CUDA source in csrc/cuda with nvcc for sm_80, and the CUDA host code with
the host compiler: all compiles at once, as many at a time as there are cores (the
`compiled` fixture). One architecture, the oldest the build targets (setup.py
cuda_arch_flags: sm_80, sm_90): the sources have no per-architecture code (no
__CUDA_ARCH__ branch, checked here), so sm_90 would find no error sm_80 does not, and each
architecture is a device pass of its own (the fixture took 118 s with both on 2 cores).

Nothing here runs a kernel: it only makes a syntax or type error in the CUDA code
fail CI on machines without a GPU. Skipped when nvcc is not on PATH.
Run: pytest tests/test_cuda_compile.py -v
"""
import os
import pathlib
import re
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.slow   # nvcc and the host compiler, per file

ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "csrc" / "cuda"
CUDA_SOURCES = sorted(CUDA_DIR.glob("*.cu"))
ARCHS = ["sm_80"]


def test_cuda_sources_exist():
    assert CUDA_SOURCES, f"no .cu files found in {CUDA_DIR}"


def test_no_per_architecture_code():
    """Compiling one architecture checks them all only while no source branches on it."""
    sources = sorted(CUDA_DIR.glob("*.cu*")) + sorted(CUDA_DIR.glob("*.h"))
    found = [p.name for p in sources if "__CUDA_ARCH__" in p.read_text()]
    assert not found, f"{found} branch on __CUDA_ARCH__: compile every architecture of setup.py here (ARCHS)"


def _nvcc(source: pathlib.Path, out_dir: pathlib.Path):
    """nvcc on one source for every arch of ARCHS at once (one host pass, a device pass per arch)."""
    nvcc = shutil.which("nvcc")
    obj = out_dir / f"{source.stem}.o"
    cmd = [nvcc, "-c", *[f"-gencode=arch=compute_{a[3:]},code={a}" for a in ARCHS], "-std=c++17", "-O3",
           "-Xcompiler", "-Wall", "-I", str(ROOT / "csrc" / "core"), "-o", str(obj), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    return cmd, proc, obj


def _host_cmd(source: pathlib.Path, shim_dir: pathlib.Path):
    """The host compiler's syntax check of source with -DZX_WITH_CUDA (None: no toolkit)."""
    import sysconfig

    import torch
    from torch.utils import cpp_extension
    nvcc = shutil.which("nvcc")
    homes = [cpp_extension.CUDA_HOME, str(pathlib.Path(nvcc).resolve().parents[1]), "/usr/local/cuda"]
    cuda_home = next((h for h in homes if h and os.path.exists(os.path.join(h, "include", "cuda_runtime.h"))), None)
    if cuda_home is None:
        return None, f"nvcc found but no cuda_runtime.h under {homes}: the CUDA host code is not compiled"
    cxx = shutil.which("c++") or shutil.which("g++")
    includes = cpp_extension.include_paths() + [str(shim_dir), str(ROOT / "csrc"), str(ROOT / "csrc" / "core"),
                                                os.path.join(cuda_home, "include"), sysconfig.get_paths()["include"]]
    cmd = [cxx, "-std=c++20", "-fsyntax-only", "-DZX_WITH_CUDA", "-DTORCH_EXTENSION_NAME=_C",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-Wall", "-Wno-unused-parameter"] + [f"-I{p}" for p in includes] + [str(source)]
    return cmd, None


def _run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every compile of this module run once, as many at a time as there are cores: nvcc on
    each CUDA source (source -> (cmd, proc, obj)); the host compiler's syntax check of each
    host source (source -> (cmd, proc) or (None, why it is not compiled)), and for the
    engine's, its preprocessed text (("E", source) -> proc)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: CUDA sources not compiled (install the CUDA toolkit to check them)")
    from concurrent.futures import ThreadPoolExecutor
    out = tmp_path_factory.mktemp("nvcc")
    # The one header a CPU wheel lacks: CMake generates it for CUDA builds of torch.
    shim = tmp_path_factory.mktemp("shim")
    (shim / "c10" / "cuda" / "impl").mkdir(parents=True)
    (shim / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    jobs = {}
    for source in HOST_SOURCES:
        cmd, why = _host_cmd(source, shim)
        jobs[source] = (lambda c=cmd, w=why: (c, _run(c)) if c else (None, w))
        if cmd and source.parent.name == "engine":
            jobs[("E", source)] = (lambda c=cmd: _run([a if a != "-fsyntax-only" else "-E" for a in c]))
    for source in CUDA_SOURCES:
        jobs[source] = (lambda s=source: _nvcc(s, out))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {k: pool.submit(f) for k, f in jobs.items()}
        return {k: f.result() for k, f in futures.items()}


@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_nvcc_compiles(source, compiled):
    cmd, proc, obj = compiled[source]
    assert proc.returncode == 0, f"nvcc failed on {source.name} ({', '.join(ARCHS)}):\n{' '.join(cmd)}\n{proc.stderr}"
    assert obj.exists()
    # Warnings are not errors, but show them (pytest -s / on failure of a later assert).
    if proc.stderr.strip():
        print(f"nvcc warnings for {source.name}:\n{proc.stderr}")


# The host side of the CUDA build (the CUDA kernel table of the engine and the CUDA
# bindings) only compiles in the CUDA extension; check it here with the CPU wheel's
# headers (which include c10/cuda and ATen/native/cuda) and the toolkit's, so that a
# type error in it fails CI without a GPU machine.
HOST_SOURCES = [ROOT / "csrc" / "engine" / "kernels_cuda.cpp", ROOT / "csrc" / "cuda_binding.cpp"]


@pytest.mark.parametrize("source", HOST_SOURCES, ids=lambda p: p.name)
def test_cuda_host_code_compiles(source, compiled):
    cmd, proc = compiled[source]
    if cmd is None:
        pytest.skip(proc)
    assert proc.returncode == 0, f"{source.name} does not compile with -DZX_WITH_CUDA:\n{proc.stderr[-4000:]}"
    if source.parent.name == "engine":
        # the engine includes no pybind11/Python header (tests/test_engine_headers.py), its CUDA branch neither
        pre = compiled[("E", source)]
        assert pre.returncode == 0, pre.stderr[-4000:]
        reached = sorted({f for f in re.findall(r'^# \d+ "([^"]+)"', pre.stdout, re.M)
                          if "/pybind11/" in f or f.endswith("/Python.h")})
        assert not reached, f"{source.name} with -DZX_WITH_CUDA includes pybind11/Python headers: {reached[:12]}"
