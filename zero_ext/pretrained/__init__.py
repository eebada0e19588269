"""Pretrained weights in and out of shards: each rank reads only its fragments' bytes of a
safetensors checkpoint (load.py, reading through files.py); save_pretrained (save.py) streams
a zeroified model out in Hugging Face's format, never whole in one process.

    model, opt = zero_ext.zeroify(model, opt, stage=3, weights="llama/")      # every rank
    zero_ext.save_pretrained(model, "out/")                                    # rank 0 writes
"""
from .load import Weights, WeightsReport, load_weights
from .save import save_pretrained

__all__ = ["Weights", "WeightsReport", "load_weights", "save_pretrained"]
