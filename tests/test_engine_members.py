"""The engine stays a set of small owners (csrc/engine/): no class there holds more than
OWNER_LIMIT data members, and Engine itself, the facade over them, no more than
ENGINE_LIMIT. Lower ENGINE_LIMIT when an owner takes members over from it, and MEMBER_FILES
when a member's users move into fewer files.

csrc/engine/README.md maps every file of csrc/engine/ (test_readme_maps_every_engine_file).

A data member is a declarator in a class body, counted from the header's text (comments
and template arguments stripped): in a `class`, every one (`rank_`, and a public `meter`
too); in a `struct` (plain data: Layout, Bucket, EngineOptions), those named with a trailing
underscore only.
"""
import pathlib
import re

ENGINE_DIR = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "engine"
ENGINE_LIMIT = 11
OWNER_LIMIT = 12
# test_engine_members_spread_over_no_more_files: (member, file) pairs, Engine's members named
# by Engine's functions over csrc/engine/*.cpp. 11 = ENGINE_LIMIT: each member is used in one
# file, the facade's engine.cpp (construction lends the owners to build.h's steps; 83 when this
# came, counting other classes' same-named members too)
MEMBER_FILES = 11
CLASS = re.compile(r"^(?:class|struct)\s+(\w+)[^;{]*\{", re.M)
# test_engine_facade_stays_short: lines of `class Engine { ... };` in engine.h (144 when this came;
# 315 lines of engine.h before, with the file map and the owners' documentation in it)
FACADE_LINES = 150


def _body(text: str, start: int) -> str:
    depth, i = 0, start
    while True:
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1


def _top_level(body: str) -> str:
    """The class body without nested braces (inline function bodies, nested types)."""
    out, depth = [], 0
    for ch in body:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            out.append(";")
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def data_members(text: str, name: str) -> list[str]:
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"=\s*\{\s*\}", "= 0", text)   # a default argument `= {}` is no body
    m = next(m for m in CLASS.finditer(text) if m.group(1) == name)
    every = m.group(0).startswith("class")
    names = []
    for stmt in _top_level(_body(text, m.end() - 1)).split(";"):
        stmt = re.sub(r"\b(public|private|protected):", "", stmt).strip()
        if not stmt or "(" in stmt.split("=")[0] or "operator" in stmt or stmt.startswith(("using", "friend", "static", "template",
                                                                       "struct", "class", "enum", "typedef")):
            continue
        flat, depth = "", 0
        for ch in stmt:                       # drop template arguments: their commas are not declarators
            depth += ch == "<"
            depth -= ch == ">"
            if depth == 0 and ch not in "<>":
                flat += ch
        for decl in flat.split(","):
            word = re.search(r"(\w+)\s*$", decl.split("=")[0].strip())
            if word and (every or word.group(1).endswith("_")):
                names.append(word.group(1))
    return names


def classes() -> dict[str, list[str]]:
    out = {}
    for header in sorted(ENGINE_DIR.glob("*.h")):
        text = header.read_text()
        for m in CLASS.finditer(re.sub(r"//[^\n]*", "", text)):
            members = data_members(text, m.group(1))
            if members:
                out[f"{header.name}:{m.group(1)}"] = members
    return out


def test_the_counter_counts():
    text = "class A {\n int a_ = 0, b_;  // c_\n std::map<int, int> m_;\n void f() { int x_; }\n}"
    assert data_members(text, "A") == ["a_", "b_", "m_"]
    text = ("class B {\npublic:\n struct J { int k; };\n void g(int a, const T &t = {});\n B &operator=(const B &) = delete;"
            "\n int open;\n int shut_;\n}\nstruct C { int x, y_; };")
    assert data_members(text, "B") == ["open", "shut_"]
    assert data_members(text, "C") == ["y_"]


def test_engine_and_its_owners_stay_small():
    found = classes()
    engine = found.pop("engine.h:Engine")
    print(f"Engine: {len(engine)} data members")
    assert len(engine) <= ENGINE_LIMIT, (f"Engine holds {len(engine)} data members (limit {ENGINE_LIMIT}): give "
                                         f"new state to an owner class (csrc/engine/*.h), not to Engine")
    big = {k: len(v) for k, v in found.items() if len(v) > OWNER_LIMIT}
    assert not big, f"owner classes over the limit of {OWNER_LIMIT} data members (split them): {big}"
    assert len(found) >= 10, sorted(found)   # the owners were found at all


def test_engine_facade_stays_short():
    """Engine is a facade: each call one line handing the work to an owner, documented where the
    owner does it. A call that needs more belongs to an owner (csrc/engine/README.md)."""
    text = (ENGINE_DIR / "engine.h").read_text()
    start = re.search(r"^class Engine\b", text, re.M).start()
    end = text.index("\n};", start)
    lines = text[start:end].count("\n") + 2
    print(f"class Engine: {lines} lines")
    assert lines <= FACADE_LINES, (f"class Engine is {lines} lines (limit {FACADE_LINES}): move what grew into "
                                   f"the owner that does it, and document it there")


ENGINE_FUNCTION = re.compile(r"\bEngine::~?\w+\s*\(")


def engine_code(text: str) -> str:
    """The definitions of Engine's own functions in a .cpp text (parameter lists,
    initializer lists and bodies), without those of other classes in the same file (an
    owner's `params_` there is its own, not Engine's)."""
    out = []
    for m in ENGINE_FUNCTION.finditer(text):
        i, depth = m.end(), 1
        while depth:                                  # past the parameter list
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        brace, semi = text.find("{", i), text.find(";", i)
        if brace < 0 or 0 <= semi < brace:
            continue                                  # a call or a declaration, not a definition
        j, depth = brace, 0
        while True:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        out.append(text[m.start():j + 1])
    return "\n".join(out)


def member_files() -> dict[str, list[str]]:
    """Each Engine data member: the csrc/engine/*.cpp files whose Engine functions name it as
    the engine's own (not as `x.member` or `p->member` of another object)."""
    members = data_members((ENGINE_DIR / "engine.h").read_text(), "Engine")
    sources = {p.name: engine_code(re.sub(r"//[^\n]*", "", p.read_text())) for p in sorted(ENGINE_DIR.glob("*.cpp"))}
    return {m: [name for name, text in sources.items() if re.search(rf"(?<![\w.>]){re.escape(m)}\b", text)]
            for m in members}


def test_engine_code_is_found():
    text = ("void Owner::f() { a_ = 1; }\nEngine::Engine(int x) : b_(x), c_(0) {\n  if (x) { d_++; }\n}\n"
            "int Engine::g(int y) const { return e_ + y; }\nvoid Other::h() { Engine::g(1); f_(); }")
    code = engine_code(text)
    assert all(name in code for name in ("b_", "c_", "d_", "e_")), code
    assert "a_" not in code and "f_" not in code, code


def test_engine_members_spread_over_no_more_files():
    """Where an Engine member is used: the aim is one file per member (an owner's state used
    by the code of that owner). MEMBER_FILES is the sum over members of the files using each;
    lower it when code moves into the owner of the state it uses."""
    spread = member_files()
    print("\n".join(f"{m}: {len(f)} {' '.join(f)}" for m, f in spread.items()))
    total = sum(len(f) for f in spread.values())
    assert all(spread.values()), f"members no .cpp file uses (or the search broke): {spread}"
    assert total <= MEMBER_FILES, (f"Engine's members are used in {total} (member, file) pairs, more than "
                                   f"{MEMBER_FILES}: use an owner's state through the owner, in its own file")


def file_map_names(head: str) -> set[str]:
    """The files a comment names: `x.h`, `x.cpp`, and `x.h/.cpp` as both."""
    names = set()
    for stem, ext in re.findall(r"\b(\w+)\.(h/\.cpp|cpp|h)\b", head):
        names |= {f"{stem}.h", f"{stem}.cpp"} if ext == "h/.cpp" else {f"{stem}.{ext}"}
    return names


def test_file_map_parser():
    assert file_map_names("//   fill.h/.cpp  cut\n//   a.cpp b.h (c.cuh)") == {"fill.h", "fill.cpp", "a.cpp", "b.h"}


def test_readme_maps_every_engine_file():
    """csrc/engine/README.md is the file map a newcomer reads first (engine.h and docs/design.md
    point there): it names every file of csrc/engine/, and names none that is gone."""
    named = file_map_names((ENGINE_DIR / "README.md").read_text())
    files = {p.name for p in ENGINE_DIR.iterdir() if p.suffix in (".h", ".cpp")}
    assert not files - named, f"README.md's file map does not name {sorted(files - named)}: add a line for each"
    assert not named - files, f"README.md's file map names files that do not exist: {sorted(named - files)}"


def mutable_globals(text: str) -> list[str]:
    """Variables in a C++ text that outlive every call and no object owns: at namespace scope,
    or `static` anywhere (a function's or a class's), unless const or constexpr."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    text = re.sub(r"^\s*#[^\n]*", "", text, flags=re.M)
    found = [m.group(1) for m in re.finditer(
        r"\bstatic\s+(?!constexpr\b|const\b|inline\b)(?:thread_local\s+)?[\w:<>,\s*&]*?\b(\w+)\s*(?:=|;|\{|\[)", text)
        if not re.match(r"(?:constexpr|const)\b", m.group(0).split("static", 1)[1].strip())]
    stack, stmt = [], ""
    for ch in text:
        if ch == "{":
            s = " ".join(stmt.split())
            if all(k == "ns" for k in stack) and re.fullmatch(r"[\w:<>,\s*&]+\s(\w+)", s) and not re.match(
                    r"(?:template|typedef|struct|class|enum|union|namespace|(?:static\s+|inline\s+)*(?:constexpr|const)\b)", s):
                found.append(s.split()[-1])   # a variable initialized with braces
            stack.append("ns" if re.search(r'\b(?:namespace\s*\w*|extern\s*"")\s*$', stmt)
                         else "typedef" if s.startswith("typedef") else "block")
            stmt = ""
        elif ch == "}":
            stmt = "typedef " if stack.pop() == "typedef" else ""   # its declarators name types
        elif ch == ";":
            s = " ".join(stmt.split())
            if all(k == "ns" for k in stack) and s and "(" not in s.split("=")[0] and not re.match(
                    r"(?:using|typedef|template|struct|class|enum|union|extern|static_assert|friend|"
                    r"(?:static\s+|inline\s+)*(?:constexpr|const)\b)", s):
                found.append(re.search(r"(\w+)\s*(?:=.*|\[.*\])?$", s).group(1))
            stmt = ""
        else:
            stmt += ch
    return sorted(set(found))


def test_the_globals_finder_finds():
    text = ('namespace zx {\nint64_t g_next_group = 0;\nconstexpr int kA = 1;\nstruct B { int b; };\n'
            'static const char *kName = "x{";\nvoid f() { static int calls = 0; int local = 1; }\n'
            'class C { static int count_; static C of(int x); };\nstd::atomic<int> live{0};\n}')
    assert mutable_globals(text) == ["calls", "count_", "g_next_group", "live"], mutable_globals(text)


def test_engine_keeps_no_globals():
    """No hidden globals: whatever the engine keeps between calls is a member of an owner (an
    argument that a global carried once is an argument again: Note [Groups as an argument])."""
    found = {p.name: g for p in sorted(ENGINE_DIR.glob("*.[ch]*")) if (g := mutable_globals(p.read_text()))}
    assert not found, f"mutable globals in csrc/engine/ (make them an owner's members or arguments): {found}"
