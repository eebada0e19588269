"""The CUDA tests' guard: skip without a GPU, fail with one when the extension cannot run there.

    C = cuda_extension("cuda_adam_step")     # at the top of a CUDA test module

Without a CUDA device the module is skipped, saying so. On a machine with one, a
zero_ext._C that does not import, or was built without CUDA (it lacks `attr`), is an
error, not a skip: a GPU run whose CUDA tests all skipped would read as a pass.
"""
from __future__ import annotations

import pytest
import torch

NO_DEVICE = "no CUDA device (torch.cuda.is_available() is False)"


class CudaBuildError(RuntimeError):
    pass


def cuda_build_problem(attr: str) -> str | None:
    """Why zero_ext._C cannot run the CUDA tests on this GPU machine, or None."""
    try:
        from zero_ext import _C
    except ImportError as exc:
        return (f"zero_ext._C does not import on a machine with a GPU ({exc}); rebuild it against this "
                f"torch: make build (or make gpu-check)")
    if not hasattr(_C, attr):
        return (f"zero_ext._C was built without CUDA (it has no {attr}) on a machine with a GPU; rebuild it with "
                f"nvcc on PATH and a CUDA torch: make clean build (or make gpu-check)")
    return None


def cuda_extension(attr: str):
    """zero_ext._C for a CUDA test module (see the module docstring)."""
    if not torch.cuda.is_available():
        pytest.skip(NO_DEVICE, allow_module_level=True)
    problem = cuda_build_problem(attr)
    if problem is not None:
        raise CudaBuildError(problem)
    from zero_ext import _C
    return _C
