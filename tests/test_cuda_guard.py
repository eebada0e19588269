"""tests/cuda_guard.py: without a GPU the CUDA test modules skip, saying so; on a machine
with one, an extension that was built without CUDA (this CPU build) is an error that names
the rebuild, so a GPU run cannot pass with its CUDA tests skipped. Checked here by telling
torch there is a device."""
import pytest
import torch

import cuda_guard


def test_no_device_skips_the_module(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="no CUDA device"):
        cuda_guard.cuda_extension("cuda_adam_step")


def test_a_gpu_machine_with_a_cpu_build_fails(monkeypatch):
    from zero_ext import _C
    if hasattr(_C, "cuda_adam_step"):
        pytest.skip("this build has CUDA kernels: the CPU-build failure cannot be shown here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(cuda_guard.CudaBuildError, match="built without CUDA .*make clean build"):
        cuda_guard.cuda_extension("cuda_adam_step")


def test_a_gpu_machine_whose_build_does_not_import_fails(monkeypatch):
    import sys

    import zero_ext
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delattr(zero_ext, "_C")
    monkeypatch.setitem(sys.modules, "zero_ext._C", None)   # the import fails, as for a missing .so
    with pytest.raises(cuda_guard.CudaBuildError, match="does not import"):
        cuda_guard.cuda_extension("cuda_adam_step")


def test_every_cuda_test_module_uses_the_guard():
    """No CUDA test module skips on a missing CUDA build by itself."""
    import pathlib
    here = pathlib.Path(__file__).parent
    for name in ("test_cuda_kernels.py", "test_cuda_bf16_states.py", "test_gpu_engine.py", "test_offload_cuda.py",
                 "test_quant_cuda.py", "test_gpu_multirank.py", "test_state_dtype.py", "test_cuda_master_split.py"):
        text = (here / name).read_text()
        assert "cuda_guard" in text, f"{name} does not use tests/cuda_guard.py"
        assert "built without CUDA" not in text.replace("cuda_guard", ""), \
            f"{name} words its own skip for a build without CUDA"
