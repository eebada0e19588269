"""zero_ext: ZeRO data parallelism for any PyTorch training script.

    model, opt = zero_ext.zeroify(model, opt, stage=2)

See README.md for the options and how it works.
"""
import atexit
import gc

from .api import ZeroInputError, zeroify
from .changes import ZeroUsageError
from .checkpoint import CheckpointError, consolidated_state_dict, load, save
from .comm import delay_collectives
from .config import ZeroConfig
from .gather import gathered_parameters
from .from_deepspeed import config_from_deepspeed
from .materialize import meta_parameters
from .model import ZeroModel
from .optim import ZeroOptimizer
from .pretrained import Weights, WeightsReport, load_weights, save_pretrained
from .torch_utils import install as _install_torch_utils

_install_torch_utils()   # Note [torch's clipping utilities]: torch's clip_grad_* right on zeroified models

__all__ = ["zeroify", "ZeroConfig", "ZeroModel", "ZeroOptimizer", "ZeroInputError", "ZeroUsageError",
           "gathered_parameters", "meta_parameters", "save", "load", "consolidated_state_dict", "CheckpointError",
           "estimate_memory", "delay_collectives", "config_from_deepspeed", "Weights", "WeightsReport",
           "load_weights", "save_pretrained"]
__version__ = "0.1.0"


def __getattr__(name):
    # imported on first use, so that `python -m zero_ext.estimate` does not find itself imported
    if name == "estimate_memory":
        from .estimate import estimate_memory
        return estimate_memory
    raise AttributeError(f"module 'zero_ext' has no attribute {name!r}")

# Note [Process groups at exit]
#   An engine holds its process group. A cycle (a caught exception's traceback) can keep it
#   alive past dist.destroy_process_group(); destroyed at interpreter finalization, a gloo
#   group can abort the process. Collect such cycles at exit, while the interpreter is whole.
atexit.register(gc.collect)
