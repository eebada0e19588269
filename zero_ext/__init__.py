"""zero_ext: ZeRO data parallelism for any PyTorch training script.

    model, opt = zero_ext.zeroify(model, opt, stage=2)

See README.md for the options and how it works.
"""
from .api import ZeroInputError, zeroify
from .checkpoint import CheckpointError, consolidated_state_dict, load, save
from .config import ZeroConfig
from .gather import gathered_parameters
from .model import ZeroModel
from .optim import ZeroOptimizer

__all__ = ["zeroify", "ZeroConfig", "ZeroModel", "ZeroOptimizer", "ZeroInputError", "gathered_parameters",
           "save", "load", "consolidated_state_dict", "CheckpointError"]
__version__ = "0.1.0"
