"""Checkpoints that survive a change of world size and stage.

    zero_ext.save("ckpt", model, opt, extra={"step": step}, scheduler=sched)   # every rank
    extra = zero_ext.load("ckpt", model, opt, scheduler=sched)                # any N, any stage
    full = zero_ext.consolidated_state_dict(model, opt, to=0)   # {"model", "optimizer"} on rank 0
    python -m zero_ext.consolidate ckpt full.pt                 # offline, no process group

Modules, each importing only those above it (never optim.py): format.py (on disk), layout.py
(the model as a checkpoint sees it), entries.py (DCP entries), saving.py, loading.py,
consolidation.py.
"""
from .consolidation import consolidate, consolidated_state_dict, optimizer_state_dict
from .format import FORMAT, MANIFEST, OBJECTS, CheckpointError, read_manifest, resolve
from .layout import core_optimizer
from .loading import load
from .saving import save

__all__ = ["CheckpointError", "FORMAT", "MANIFEST", "OBJECTS", "consolidate", "consolidated_state_dict",
           "core_optimizer", "load", "optimizer_state_dict", "read_manifest", "resolve", "save"]
