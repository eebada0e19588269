"""Stage 3 built sharded: a meta-device model gets untouched CPU parameters, the engine keeps
their shards, and the CPU build is replayed (each module's reset_parameters(), children first,
then model.apply(init_fn)) with a few units whole at a time.

Note [Meta builds lose nothing]
  A call is one reset_parameters() or init_fn(m); it may write any parameter, not only m's
  (HF's _init_weights on GPT2Attention writes c_proj.weight).
  * Every write lands. A torch-function mode opens (gathers in fp32) the unit of each
    parameter a call touches before the op runs; it stays whole until the call returns. A
    unit is committed (broadcast from rank 0, kept as shards) when a later call needs another,
    and reopened if touched again. Peak: the root, one call's units, this rank's shards.
  * Nothing stays unset silently. Parameters first hold a NaN with a payload no init writes;
    each commit notes those still holding it. A dispatch mode watches frozen parameters and
    buffers outside the engine. What no call wrote is named in one error on every rank, with
    the fix: an init_fn (HF: model._init_weights), or zero_ext.meta_parameters() for buffers a
    constructor computes.
  * Equality. With rank 0's seed the result is the CPU build's bit for bit when constructors
    draw random numbers only in reset_parameters(), in registration order (all of torch.nn).
    Other orders (HF's post_init) give equal distributions, not equal values.
"""
from __future__ import annotations

import collections
import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

_UNSET_BITS = 0x7FC0BEEF   # a quiet NaN with a payload: a parameter no init wrote yet


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers())


@contextlib.contextmanager
def meta_parameters():
    """`with zero_ext.meta_parameters(): model = MyModel(config)` builds parameters on the meta
    device but buffers on the CPU (RoPE's inv_freq, which torch.device("meta") loses)."""
    def to_meta(module, name, param):
        if param is None or param.is_meta:
            return None
        return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    with nn.modules.module.register_module_parameter_registration_hook(to_meta):
        yield


def replace_meta(model: nn.Module, optimizers: list, float_dtype: torch.dtype | None = None) -> set:
    """Swap every meta parameter/buffer for an untouched CPU one (no resident pages), keeping
    ties and the optimizers' references; float_dtype: of the new float parameters (None: their
    own). Returns the new tensors' ids (what initialize_by_unit must see written)."""
    new: dict[int, nn.Parameter] = {}
    born: set = set()
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in new:
                    dtype = float_dtype if float_dtype is not None and p.is_floating_point() else p.dtype
                    new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype), requires_grad=p.requires_grad)
                m._parameters[name] = new[id(p)]
                born.add(id(new[id(p)]))
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)
                born.add(id(m._buffers[name]))
    for opt in optimizers:
        for g in opt.param_groups:
            g["params"] = [new.get(id(p), p) for p in g["params"]]
        opt.state = collections.defaultdict(dict, {new.get(id(p), p): s for p, s in opt.state.items()})
    return born


def _post_order(m: nn.Module):
    for c in m.children():
        yield from _post_order(c)
    yield m


class _Units(TorchFunctionMode):
    """Which units are whole while initializing, and what is still unset. As a mode: before any
    torch function runs on a managed parameter, its unit is made whole."""

    def __init__(self, engine, unit_of: dict, members: dict, only: set | None, pieces: dict | None, comm):
        super().__init__()
        self.engine = engine
        self.unit_of = unit_of          # id(parameter) -> unit
        self.members = members          # unit -> its parameters
        self.only = only                # ids of the parameters to initialize (None: all)
        self.pieces = pieces            # with only: id -> [(offset in it, this rank's shard view)]
        self.comm = comm
        self.whole: set = set()
        self.in_call: set = set()       # units the running call touched
        self.opened: set = set()        # units opened at least once
        self.views: dict = {}           # id(parameter) -> data_ptr while whole
        self.unset: dict = {}           # id(parameter) -> unset elements left at its unit's last commit

    def need(self, u: int) -> None:
        self.in_call.add(u)
        if u in self.whole:
            return
        for v in sorted(self.whole - self.in_call - {0}):
            self.close(v)
        with _disable_current_modes():     # the engine's own tensor work is not an init's write
            self.engine.open_unit_fp32(u)
        self.whole.add(u)
        for p in self.members.get(u, ()):
            if u not in self.opened and self.wanted(p):
                p.data.view(torch.int32).fill_(_UNSET_BITS)
            self.views[id(p)] = p.data_ptr()
        self.opened.add(u)

    def wanted(self, p) -> bool:
        return self.only is None or id(p) in self.only

    def close(self, u: int) -> None:
        for p in self.members.get(u, ()):
            if p.data_ptr() != self.views[id(p)]:
                raise RuntimeError(f"zero_ext: an init replaced the tensor of a parameter of shape "
                                   f"{tuple(p.shape)} (p.data = ... or a new nn.Parameter); initialize "
                                   f"parameters in place (p.copy_(...), nn.init.*)")
            if self.wanted(p):
                self.unset[id(p)] = bool((p.data.view(torch.int32) == _UNSET_BITS).any())
        with _disable_current_modes():
            if self.only is None:
                self.engine.commit_unit(u, 0)
            else:   # Note [Pretrained weights into shards]: rank 0's values of the initialized ones only
                mine = [p for p in self.members.get(u, ()) if id(p) in self.only]
                self.comm.broadcast_(mine)
                for p in mine:
                    flat = p.detach().reshape(-1)
                    for poff, view in self.pieces[id(p)]:
                        view.copy_(flat[poff:poff + view.numel()])
            self.engine.release_unit(u)
        self.whole.discard(u)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and id(t) in self.unit_of:
                self.need(self.unit_of[id(t)])
        return func(*args, **kwargs)


class _WriteLog(TorchDispatchMode):
    """Records writes into the storages of the watched plain tensors."""

    def __init__(self, storages: dict):
        super().__init__()
        self.storages = storages        # storage data_ptr -> id(tensor)
        self.written: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if i < len(args) else kwargs.get(a.name)
            for t in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    key = self.storages.get(t.untyped_storage().data_ptr())
                    if key is not None:
                        self.written.add(key)
        return func(*args, **kwargs)


@torch.no_grad()
def initialize_by_unit(model: nn.Module, engine, unit_of: dict, comm, init_fn=None,
                       born: set = frozenset(), only: set | None = None, pieces: dict | None = None) -> None:
    """Replay the CPU build, then model.apply(init_fn) (Note [Meta builds lose nothing]): each
    module's reset_parameters(), a parameter tied to an earlier module keeping its values.
    unit_of: id(parameter) -> unit of the engine's; born: ids replace_meta created.
    only: the ids to initialize (Note [Initializing what weights leave out] in
    zero_ext/pretrained/load.py); then rank 0's values of those go into `pieces`."""
    members: dict = {}
    for p in model.parameters():
        if id(p) in unit_of:
            members.setdefault(unit_of[id(p)], []).append(p)
    units = _Units(engine, unit_of, members, only, pieces, comm)
    born = only if only is not None else born
    plain = [t for t in list(model.parameters()) + list(model.buffers())
             if id(t) in born and id(t) not in unit_of and t.numel() > 0]
    log = _WriteLog({t.untyped_storage().data_ptr(): id(t) for t in plain})
    slots = {(id(m), kind, name): t for m in model.modules()   # what the modules' slots hold before the calls
             for kind, d in (("parameter", m._parameters), ("buffer", m._buffers)) for name, t in d.items()}
    done: set = set()

    def reset(m):
        own = list(m.parameters(recurse=False))
        keep = {id(p): p.detach().clone() for p in own if id(p) in done}
        if hasattr(m, "reset_parameters") and m is not model:
            m.reset_parameters()
        for p in own:
            if id(p) in keep:
                p.copy_(keep[id(p)])
            done.add(id(p))

    holders = None if only is None else {id(m) for m in model.modules()
                                         if any(id(t) in only for t in m.parameters(recurse=False))}
    with_ancestors = None if only is None else {   # the modules holding them, and every module above
        id(model.get_submodule(".".join(path.split(".")[:k]))) for path, m in model.named_modules()
        if any(id(t) in only for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
        for k in range(path.count(".") + 2)}

    def run(fn, modules):
        seen = set()
        for m in _post_order(model):
            if id(m) in seen or (modules is not None and id(m) not in modules):
                continue
            seen.add(id(m))
            units.in_call = set()
            for p in m.parameters(recurse=False):
                if id(p) in unit_of and units.wanted(p):
                    units.need(unit_of[id(p)])
            with units, log:
                fn(m)
        units.in_call = set()

    if only is None:
        units.need(0)
    run(reset, holders)
    if init_fn is not None:
        run(init_fn, with_ancestors)
    for u in sorted(units.whole):
        units.close(u)

    # raise on every rank when a call left a tensor unwritten or replaced a parameter
    names, replaced = {}, []   # names: id(parameter or buffer) -> "kind 'name' (ModuleClass)" for messages
    for path, m in model.named_modules(remove_duplicate=False):
        for kind, d in (("parameter", m._parameters), ("buffer", m._buffers)):
            for name, t in d.items():
                full = f"{path}.{name}" if path else name
                if t is not None and id(t) not in names:
                    names[id(t)] = f"{kind} {full!r} ({type(m).__name__})"
                old = slots.get((id(m), kind, name))
                if t is old:
                    continue
                if kind == "parameter" and old is not None and (id(old) in unit_of or id(old) in born):
                    replaced.append(full)
                elif old is not None:
                    log.written.add(id(old))       # a buffer replaced by a computed one
    missing = [names[k] for k, left in units.unset.items() if left]
    missing += [names[id(t)] for t in plain if id(t) not in log.written and names.get(id(t))]
    bad = comm.all_reduce([len(missing) + len(replaced)], op=dist.ReduceOp.MAX, dtype=torch.int64)[0]
    if replaced:
        raise RuntimeError(f"zero_ext: an init replaced parameters by new nn.Parameter objects "
                           f"({', '.join(replaced[:8])}); the engine holds the original ones: initialize "
                           f"them in place (p.copy_(...), nn.init.*)")
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise RuntimeError(
            f"zero_ext: building on the meta device left {len(missing)} tensor(s) uninitialized: "
            f"{', '.join(missing[:8])}{more}. No reset_parameters() wrote them and init_fn did not. Pass "
            f"an init_fn that initializes them (for a Hugging Face model: init_fn=model._init_weights); "
            f"buffers that a module computes in its constructor are kept if you build the model under "
            f"`with zero_ext.meta_parameters():` instead of `with torch.device('meta'):`")
    if bad:
        raise RuntimeError("zero_ext: another rank found tensors left uninitialized by the meta-device "
                           "build (its error names them); no rank continues. Initialize what it names (an "
                           "init_fn, or reset_parameters()) and run again")
