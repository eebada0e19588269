"""The front door and the docs site state only what the repository holds.

- README.md is short, keeps its two set-up commands and `pip install`, and its generated
  regions (the headline figures, the status table) are what tools/docsgen.py makes now
  from benchmarks/reference/ and the gpu-check result files;
- no page states a measured-looking number (a decimal, a percentage, a ratio) outside a
  region generated from a reference file (tools/docsgen.py's stray_figures), and the scan
  does catch one planted in the text;
- every reference result file names its machine and commit;
- every name in zero_ext.__all__ has an API entry, every page is in the site's navigation,
  every exception class has its troubleshooting entry, every repository path and README
  link points at a file that exists;
- pyproject's metadata agrees with the package (version, stages 0-3);
- the site builds with `mkdocs build --strict` (as `make docs` does), where mkdocs is installed.
"""
import ast
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

spec = importlib.util.spec_from_file_location("docsgen", ROOT / "tools" / "docsgen.py")
docsgen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docsgen)


def pages() -> list[pathlib.Path]:
    return sorted(DOCS.rglob("*.md"))


def test_readme_regions_are_generated_now():
    text = README.read_text()
    regions = {m.group(1) for m in docsgen.REGION.finditer(text)}
    assert {"perf-headline", "status"} <= regions, regions
    assert docsgen.render_regions(text) == text, "README.md's generated regions are stale: run python tools/docsgen.py"


def test_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 200, f"README.md has {len(text.splitlines())} lines (the docs hold the rest)"
    commands = [line.split("#")[0].strip() for block in re.findall(r"```\n(.*?)```", text, re.S)
                for line in block.splitlines()]
    assert "make demo" in commands and "make test" in commands, commands
    assert any(c.startswith("pip install") and c.endswith(" .") for c in commands), commands
    assert not [c for c in commands if c.startswith("make ") and c not in ("make demo", "make test")], \
        "the README's set-up is exactly `make demo` and `make test` (plus pip install)"
    assert "## GPUs" in text and "torchrun --standalone" in text and "--nnodes=" in text


@pytest.mark.parametrize("path", [README] + pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_figure_without_a_reference_file(path):
    text = path.read_text()
    if path != README:
        text = docsgen.page_with_generated(text)
    stray = docsgen.stray_figures(text)
    assert not stray, (f"{path.relative_to(ROOT)} states figures that no reference file holds; generate them "
                       f"from benchmarks/reference/ (tools/docsgen.py) or drop them:\n  " + "\n  ".join(stray))


def test_the_figure_scan_catches_a_planted_figure():
    planted = ("Stage 3 took 1.41x DDP's step and 12% of the delay, 0.92 of the bandwidth.\n\n"
               "Tolerances are fine: within 1%, at most 30%. So is code: `lr=0.1`, torch 2.13.\n\n"
               "```\nloss 2.2644\n```\n")
    assert [f.split(" in:")[0] for f in docsgen.stray_figures(planted)] == ["'1.41x'", "'12%'", "'0.92'"]
    region = "<!-- gen:perf-units -->\n1.41x\n<!-- /gen:perf-units -->\n<!-- gen:options -->\n0.5%\n<!-- /gen:options -->\n"
    assert [f.split(" in:")[0] for f in docsgen.stray_figures(region)] == ["'0.5%'"]


def test_reference_files_name_machine_and_commit():
    files = [p for p in (ROOT / "benchmarks" / "reference").glob("*/*.json") if p.name != "machine.json"]
    assert files
    for p in files:
        line = docsgen.provenance(p.relative_to(ROOT / "benchmarks" / "reference").as_posix())
        assert re.search(r"commit [0-9a-f]{7}", line), line


def test_every_generated_page_expands():
    """Every marker names a generator, and every generator's inputs exist (the build does this too)."""
    used = set()
    for p in pages():
        for m in docsgen.MARKER.finditer(p.read_text()):
            used.add(m.group(1))
            assert docsgen.generate(m.group(1), m.group(2)).strip(), (p, m.group(1))
    assert set(docsgen.GENERATORS) <= used | {"perf-headline"}, set(docsgen.GENERATORS) - used


def test_every_public_name_has_an_api_entry():
    names = docsgen.public_names()
    assert "zeroify" in names and "config_from_deepspeed" in names, names
    missing = docsgen.missing_api_entries((DOCS / "api.md").read_text())
    assert not missing, f"docs/api.md has no '::: zero_ext.<name>' entry for {missing}"
    assert docsgen.missing_api_entries("::: zero_ext.zeroify\n") != [], "the check finds nothing missing"


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for p in pages():
        rel = p.relative_to(DOCS).as_posix()
        assert f": {rel}" in nav, f"{rel} is not in mkdocs.yml's nav"


def test_every_exception_class_is_in_troubleshooting():
    text = (DOCS / "troubleshooting.md").read_text()
    for path in (ROOT / "zero_ext").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", "").endswith(("Error", "Exception")) for b in node.bases):
                assert f"zero_ext.{node.name}" in text, f"{node.name} ({path.name}) has no entry in troubleshooting.md"


PATH_SPAN = re.compile(r"`((?:examples|tests|benchmarks|csrc|zero_ext|docs|tools|\.ci)/[\w./\-]+)`")


@pytest.mark.parametrize("path", [README] + pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_paths_and_links_exist(path):
    text = path.read_text()
    if path != README:
        text = docsgen.page_with_generated(text)
    missing = [m for m in PATH_SPAN.findall(text)
               if "<" not in m and "results" not in m and not (ROOT / m.rstrip("/")).exists()]
    assert not missing, f"{path.relative_to(ROOT)} names files that do not exist: {missing}"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("img/"):      # img/: plots made when the site is built
            continue
        assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to {target}, which does not exist"


def test_pyproject_tells_the_truth():
    import tomllib
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    init = (ROOT / "zero_ext" / "__init__.py").read_text()
    assert f'__version__ = "{meta["version"]}"' in init, "pyproject's version differs from zero_ext.__version__"
    assert "stages 0-3" in meta["description"], meta["description"]
    assert meta.get("classifiers"), "pyproject has no classifiers"
    assert "stages 0-2" not in (ROOT / "pyproject.toml").read_text()


@pytest.mark.dist
def test_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (tmp_path / "site" / "performance" / "index.html").exists()
