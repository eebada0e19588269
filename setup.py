"""Build zero_ext: the C11 core (static library), the C++ binding and, when
torch has CUDA and nvcc is on the PATH, the CUDA kernels.

    pip install --no-build-isolation .          # uses the torch already installed
    python setup.py build_clib build_ext --inplace   # what `make build` runs (incremental)

The C core becomes a static library (build_clib, -std=c11) that build_ext links
into zero_ext._C (build_ext adds the library when the distribution has one).
"""
import glob
import os
import re
import shutil

from setuptools import find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


core_sources = rel("csrc/core/*.c")
cpp_sources = rel("csrc/*.cpp") + rel("csrc/engine/*.cpp")
cuda_sources = rel("csrc/cuda/*.cu")

with_cuda = (
    os.environ.get("ZERO_EXT_NO_CUDA", "0") != "1"
    and cpp_extension.CUDA_HOME is not None
    and shutil.which("nvcc") is not None
    and __import__("torch").version.cuda is not None
)


def intra_op_flags():
    """Compile and link flags that let at::parallel_for in our C++ run on torch's
    intra-op threads.

    Note [Intra-op threads]
      at::parallel_for is an inline template. In a torch built with the OpenMP
      backend (AT_PARALLEL_OPENMP in ATen/Config.h, the pip wheels) its parallel
      branch exists only where _OPENMP is defined; compiled without -fopenmp it
      runs f(begin, end) on the calling thread. So the binding is compiled with
      -fopenmp and linked against the OpenMP runtime torch itself loaded (by path:
      the library records that runtime's soname, which the loader finds already
      loaded with torch; GNU, Intel or LLVM's, which all serve GCC's calls), never a
      second runtime beside it. Where none is found, -fopenmp links the compiler's.
      With the native backend torch exports invoke_parallel and no flag is needed.
      The C core (zxcore) has no thread runtime: it only sees the [lo, hi) ranges.
    """
    config_h = os.path.join(cpp_extension.include_paths()[0], "ATen", "Config.h")
    with open(config_h) as f:
        if "#define AT_PARALLEL_OPENMP 1" not in f.read():
            return [], []
    runtime = openmp_runtime_of_torch()
    return ["-fopenmp"], [runtime] if runtime else ["-fopenmp"]


def openmp_runtime_of_torch():
    """The OpenMP library torch loaded (imported above by cpp_extension): the one in
    this process's memory map, else one shipped in torch/lib, else None."""
    names = re.compile(r"lib(gomp|iomp5|omp)[.-].*so")
    try:
        with open("/proc/self/maps") as f:
            loaded = sorted({line.split()[-1] for line in f if "/" in line})
    except OSError:
        loaded = []
    torch_lib = os.path.join(os.path.dirname(os.path.abspath(cpp_extension.__file__)), "..", "lib")
    shipped = sorted(glob.glob(os.path.join(torch_lib, "*")))
    for path in loaded + shipped:
        if names.match(os.path.basename(path)):
            return os.path.normpath(path)
    return None


omp_compile, omp_link = intra_op_flags()
# The C++ standard is torch's choice (C++20 for 2.13): its headers need it.
cxx_flags = ["-O3", "-Wall", "-Wno-unused-parameter", "-fvisibility=hidden"] + omp_compile
if with_cuda:
    Extension = cpp_extension.CUDAExtension
    sources = cpp_sources + cuda_sources
    macros = [("ZX_WITH_CUDA", "1")]
    extra = {
        "cxx": cxx_flags + ["-DZX_WITH_CUDA"],
        "nvcc": ["-O3", "-DZX_WITH_CUDA",
                 "-gencode=arch=compute_80,code=sm_80",
                 "-gencode=arch=compute_90,code=sm_90",
                 "-gencode=arch=compute_90,code=compute_90"],
    }
else:
    Extension = cpp_extension.CppExtension
    sources = cpp_sources
    macros = []
    extra = {"cxx": cxx_flags}

setup(
    # name, version and the rest of the metadata: pyproject.toml
    packages=find_packages(include=["zero_ext", "zero_ext.*"]),
    libraries=[("zxcore", {
        "sources": core_sources,
        "include_dirs": ["csrc/core"],
        # -std=c11, not gnu11: GCC must not contract a*b+c into FMAs on its own
        # (the kernels are bit-exact against the scalar reference; see zx_kernels_simd.inc).
        "cflags": ["-O3", "-std=c11", "-fPIC", "-Wall", "-Wextra"],
        "obj_deps": {"": rel("csrc/core/*.h") + rel("csrc/core/*.inc")},
    })],
    ext_modules=[Extension(
        name="zero_ext._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc/core")],
        define_macros=macros,
        extra_compile_args=extra,
        extra_link_args=omp_link,
    )],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
