"""zero_ext: ZeRO data parallelism for any PyTorch training script.

    model, opt = zero_ext.zeroify(model, opt, stage=2)

See README.md for the options and how it works.
"""
from .api import ZeroInputError, zeroify
from .config import ZeroConfig
from .gather import gathered_parameters
from .model import ZeroModel
from .optim import ZeroOptimizer

__all__ = ["zeroify", "ZeroConfig", "ZeroModel", "ZeroOptimizer", "ZeroInputError", "gathered_parameters"]
__version__ = "0.1.0"
