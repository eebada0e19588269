"""Pretrained weights in and out of shards (DESIGN §19): a model built on the meta device
is zeroified and filled from a safetensors checkpoint, each rank reading only the bytes of
its own fragments; a zeroified model is written back as Hugging Face-format safetensors,
streamed unit by unit, never whole in one process.

    model, opt = zero_ext.zeroify(model, opt, stage=3, weights="llama/")      # every rank
    zero_ext.load_weights(model, zero_ext.Weights("ckpt/", allow_missing=["score"]))
    zero_ext.save_pretrained(model, "out/")                                    # every rank; rank 0 writes

One concern per module, each importing only those above it:

    files.py   safetensors on disk (Note [Safetensors by byte range]): the files of a
               checkpoint, each tensor's byte range, reads of element ranges, planned writes
    load.py    Weights, the plan and its checks, the ranks' agreement, the model's init for
               what the checkpoint leaves out, the reads (Note [Pretrained weights into shards])
    save.py    save_pretrained (Note [Streaming save_pretrained])
"""
from .load import Weights, WeightsReport, load_weights
from .save import save_pretrained

__all__ = ["Weights", "WeightsReport", "load_weights", "save_pretrained"]
