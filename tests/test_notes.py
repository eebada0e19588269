"""Every `Note [X]` reference resolves to exactly one heading, in the file it names.

A heading is a comment or docstring line that holds `Note [X]` alone (after `//`, `#`,
`/*`, `*` or `\"\"\"`); the note's text follows on the next lines. Every other
`Note [X]` is a reference; a reference followed by a path in the repository
(`Note [X] (csrc/engine/comm.cpp)`, `Note [X] in zero_ext/model.py`) must name the file
that holds the heading. So a note that moves, is renamed or loses its heading fails here.
"""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DIRS = ("zero_ext", "csrc", "tests", "benchmarks", "examples")
SUFFIXES = {".py", ".c", ".h", ".cpp", ".cu", ".cuh"}
HEADING = re.compile(r'^\s*(?://+|#+|/\*+|\*|""")?\s*Note \[([^\]]+)\]\s*$')
REFERENCE = re.compile(r"Note \[([^\]]+)\]")
NAMED_FILE = re.compile(r"\s*(?:\(|in |, )\s*((?:csrc|zero_ext|tests|benchmarks|examples|core|engine|cuda)/[\w/.\-]+)")


def _sources():
    yield ROOT / "setup.py"
    for d in DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            if (p.is_file() and p.suffix in SUFFIXES and "build" not in p.relative_to(ROOT).parts
                    and p != pathlib.Path(__file__).resolve()):   # this file's examples are not notes
                yield p


def _scan():
    headings, references = {}, []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = HEADING.match(line)
            if m:
                headings.setdefault(m.group(1), []).append(rel)
                continue
            for m in REFERENCE.finditer(line):
                named = NAMED_FILE.match(line[m.end():])
                references.append((rel, no, m.group(1), named.group(1).rstrip(".,);:") if named else None))
    return headings, references


def _same_file(named: str, heading_file: str) -> bool:
    # "core/zx_core.h" names csrc/core/zx_core.h; "engine/comm.h" csrc/engine/comm.h
    return heading_file == named or heading_file.endswith("/" + named)


def test_every_note_has_one_heading_and_references_name_its_file():
    headings, references = _scan()
    assert headings, "no Note headings found: the scan is broken"
    twice = {n: fs for n, fs in headings.items() if len(fs) > 1}
    assert not twice, f"notes with more than one heading: {twice}"
    missing = [f"{f}:{no}: Note [{n}]" for f, no, n, _ in references if n not in headings]
    assert not missing, "references to notes that have no heading:\n" + "\n".join(missing)
    wrong = [f"{f}:{no}: Note [{n}] names {named}, its heading is in {headings[n][0]}"
             for f, no, n, named in references if named is not None and not _same_file(named, headings[n][0])]
    assert not wrong, "references naming the wrong file:\n" + "\n".join(wrong)
