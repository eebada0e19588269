"""No module of zero_ext reads another's private attributes: each capability keeps its own.

Read with `ast` from the sources (nothing is imported). A module may touch `x._name` only
when x is self, cls or super(), or `_name` is defined in that same module (a def or class,
an assignment to `_name` or to `anything._name`, or a name in __slots__). getattr, setattr,
hasattr and delattr with a constant name count too, and so does `from zero_ext... import
_name`. What a module needs from another is passed to it or read through a public name.
Torch's (and the frameworks') own privates are allowed by name in ALLOWED, each with why.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zero_ext"

ALLOWED = {
    # torch.nn.Module's own tables: moving or swapping tensors without its hooks
    "_parameters": "nn.Module's parameter table",
    "_buffers": "nn.Module's buffer table",
    "_apply": "nn.Module._apply, behind .to()/.cuda()/.half() (Note [Moves after zeroify])",
    "_version": "a tensor's in-place version counter (edits seen between steps)",
    "_cdata": "a storage's identity (peak.py)",
    "_make_wrapper_subclass": "torch.Tensor's constructor for a subclass (ShardedGrad)",
    "_schema": "an aten op's schema (materialize.py)",
    # torch.distributed: the store under a group, a receive's source, its device types
    "_world": "c10d's group registry: the store under a process group",
    "_device_types": "a ProcessGroup's backends' device types",
    "_source_rank": "a recv-from-any work's source rank",
    "_process_group": "a ShardedTensor built from local shards (what its constructor sets)",
    "_init_from_local_shards_and_global_metadata": "ShardedTensor's constructor from shards",
    # torch.optim: the global hooks, and the flags LR schedulers set and read
    "_global_optimizer_pre_hooks": "torch.optim's global hooks (a hook would miss sharded params)",
    "_global_optimizer_post_hooks": "torch.optim's global hooks",
    "_opt_called": "an LR scheduler's 'step was called' flag",
    "_wrapped_by_lr_sched": "an LR scheduler's mark on a wrapped optimizer.step",
    # transformers' PreTrainedModel attributes and Trainer's overridable steps
    "_keys_to_ignore_on_load_missing": "transformers' names a checkpoint may lack",
    "_keys_to_ignore_on_load_unexpected": "transformers' names a checkpoint may hold besides",
    "_keys_to_ignore_on_save": "transformers' names save_pretrained leaves out",
    "_tied_weights_keys": "transformers' tied weights",
    "_init_weights": "transformers' per-module initializer",
    "_wrap_model": "transformers.Trainer's hook",
    "_save_optimizer_and_scheduler": "transformers.Trainer's hook",
    "_load_optimizer_and_scheduler": "transformers.Trainer's hook",
    # Lightning and accelerate
    "_trainer": "a LightningModule's trainer or None (as DDPStrategy.teardown reads it)",
    "_original_forward": "accelerate's saved forward",
    # this package's own compiled core, built by setup.py
    "_C": "zero_ext._C, the C++ engine's binding",
}
SELF = {"self", "cls"}


def _defined(tree: ast.Module) -> set:
    """The private names this module defines."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                  for t in node.targets):
            out.update(e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant))
    return {n for n in out if isinstance(n, str) and n.startswith("_") and not n.startswith("__")}


def _own(value: ast.AST) -> bool:
    """self, cls or super()."""
    return (isinstance(value, ast.Name) and value.id in SELF) or (
        isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super")


def crossings(path: pathlib.Path) -> list:
    """(line, text) of every private of another module this file touches."""
    tree = ast.parse(path.read_text(), str(path))
    defined = _defined(tree)
    private = lambda n: n.startswith("_") and not n.startswith("__") and n not in defined  # noqa: E731
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and not _own(node.value):
            if node.attr not in ALLOWED and not _torch_module(node.value):
                out.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and private(node.args[1].value) and node.args[1].value not in ALLOWED and not _own(node.args[0]):
            out.append((node.lineno, f"{node.func.id}({ast.unparse(node.args[0])}, {node.args[1].value!r})"))
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("zero_ext")):
            out += [(node.lineno, f"from {'.' * node.level}{node.module or ''} import {a.name}")
                    for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
                    and a.name not in ALLOWED]
    return sorted(out)


def _torch_module(value: ast.AST) -> bool:
    """torch.x._y, dist.distributed_c10d._world: a private module or table of torch itself."""
    while isinstance(value, ast.Attribute):
        value = value.value
    return isinstance(value, ast.Name) and value.id in ("torch", "dist", "c10d", "nn")


def _files():
    return sorted(p for p in PACKAGE.rglob("*.py") if "build" not in p.relative_to(ROOT).parts)


def test_no_private_crossings():
    over = [f"  {p.relative_to(ROOT)}:{line} {text}" for p in _files() for line, text in crossings(p)]
    assert not over, "privates of another module (pass the object in, or name it publicly):\n" + "\n".join(over)


def test_the_scan_can_fail(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from .a import _hidden\nfrom .b import shown\n\n"
                 "class A:\n    __slots__ = ('_slot',)\n\n    def f(self, other):\n"
                 "        self._mine = 1\n        return other._slot, other._engine, self._x, super()._y\n\n"
                 "def g(model, m):\n    m._parameters.clear()\n    return getattr(model, '_guard', None), torch._C\n")
    assert crossings(f) == [(1, "from .a import _hidden"), (9, "other._engine"),
                            (13, "getattr(model, '_guard')")]
