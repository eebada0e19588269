"""No import cycle in zero_ext, counting the imports inside functions.

The graph is read with `ast` from the sources (nothing is imported): every `import` and
`from ... import` anywhere in a module, relative or absolute. `from . import x` and
`from .p import x` lead to the submodule x when there is one (zero_ext._C, built by
setup.py, counts as one), else to the module that defines x. Importing zero_ext.a.b runs
zero_ext/a/__init__.py first, so it leads there too (except from inside package a).
"""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "zero_ext"


def _modules() -> dict:
    """module name -> its source file, for every .py file of the package, and the
    extension modules setup.py builds (zero_ext._C: no source here, imports nothing)."""
    out = {name: None for name in re.findall(r'name="([\w.]+)"', (ROOT / "setup.py").read_text())}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict) -> str | None:
    """The longest prefix of dotted `name` that is a module of the package."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) if parts else None


def import_graph() -> dict:
    """module -> the set of package modules it imports (anywhere in its source)."""
    modules = _modules()
    graph = {}
    for mod, path in modules.items():
        if path is None:
            graph[mod] = set()
            continue
        is_pkg = path.name == "__init__.py"
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]   # the package `.` means
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                stem = ".".join(base + ([node.module] if node.module else []))
                # a submodule when it is one, else a name the module `stem` defines
                targets.update(f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names)
        edges = set()
        for t in targets:
            hit = _resolve(t, modules)
            if hit is None or hit == mod:
                continue
            # importing a.b.c runs the __init__ of a and a.b first (packages this module is not inside)
            parts = hit.split(".")
            edges.update(".".join(parts[:k]) for k in range(1, len(parts))
                         if not (mod + ".").startswith(".".join(parts[:k]) + "."))
            edges.add(hit)
        graph[mod] = edges
    return graph


def find_cycle(graph: dict) -> list | None:
    """One cycle of `graph` (node -> successors) as [a, b, ..., a], or None."""
    state = {}                       # node -> 1 on the current path, 2 done
    path: list = []

    def visit(n):
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": {"z"}, "z": {"y"}}) == ["y", "z", "y"]


def test_graph_counts_imports_in_functions_and_relative_submodules(tmp_path, monkeypatch):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from .. import a\n")
    (pkg / "sub" / "b.py").write_text("import zero_ext.c\n")
    (pkg / "c.py").write_text("from . import _C\n")
    (tmp_path / "setup.py").write_text('Extension(name="zero_ext._C")')
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    g = import_graph()
    assert g["zero_ext.a"] == {"zero_ext.sub", "zero_ext.sub.b"}
    assert g["zero_ext.sub"] == {"zero_ext.a"}
    assert g["zero_ext.sub.b"] == {"zero_ext.c"}
    assert g["zero_ext.c"] == {"zero_ext._C"}
    assert find_cycle(g) == ["zero_ext.a", "zero_ext.sub", "zero_ext.a"]


def test_zero_ext_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 30 and graph["zero_ext"], "the scan found no modules: it is broken"
    cycle = find_cycle(graph)
    assert cycle is None, "zero_ext imports in a circle: " + " -> ".join(cycle)
