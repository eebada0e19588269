"""Pretrained weights in and out of shards (DESIGN §19): each rank reads only its own
fragments' bytes of a safetensors checkpoint; save_pretrained streams a zeroified model
back out as Hugging Face-format safetensors, never whole in one process.

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
