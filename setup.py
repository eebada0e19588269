"""Build zero_ext: the C11 core (static library), the C++ binding and, when
torch has CUDA and nvcc is on the PATH, the CUDA kernels.

    pip install --no-build-isolation .          # uses the torch already installed
    python setup.py build_clib build_ext --inplace   # what `make build` runs (incremental)

The C core becomes a static library (build_clib, -std=c11) that build_ext links
into zero_ext._C (build_ext adds the library when the distribution has one).
"""
import glob
import os
import shutil

from setuptools import setup
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

# The C++ standard is torch's choice (C++20 for 2.13): its headers need it.
cxx_flags = ["-O3", "-Wall", "-Wno-unused-parameter", "-fvisibility=hidden"]
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
    name="zero_ext",
    version="0.1.0",
    packages=["zero_ext"],
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
    )],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
