"""The package's import graph, read with `ast` (nothing is imported): no circle, imports between
packages only downward, and every import inside a function says why it is there ("lazily").

An import inside a function is how a circle is usually hidden: Python only runs it once both
modules are loaded, so the circle never shows until someone moves the import up. Here every
import counts, top-level or not, so such a circle fails the test all the same.
"""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The floors of longctx, lowest first. A module may import from its own package and from any
# package on a lower floor, never from a higher one nor from another package on its own floor.
#   errors    the failure types every layer raises
#   parallel  devices, the (dp, fsdp, sp) mesh, sequence layouts across sp
#   ops       attention over sp: masks, block tables, the ring and its kernels
#   model     the decoder that calls the ops        } side by side: the data never needs the
#   data      grain pipeline that feeds it          } model, nor the model the data
#   config    the rules of a config (reads the allowed values of model, data and ops);
#   cli       how scripts start and fail; reports   the JSON/markdown writer
#   train     state, steps, the loop, checkpoints
#   interop   Hugging Face in/out, parameter-only checkpoints (restores what train saved)
#   evals     inference, needle, ablations; plan  AOT compile and memory (compile train's step)
# scripts/ and benchmarks/ sit above them all. `longctx` itself (__init__.py) holds only the
# version and imports nothing.
FLOORS = (
    ("longctx", "errors"),
    ("parallel",),
    ("ops",),
    ("model", "data"),
    ("config", "cli", "reports"),
    ("train",),
    ("interop",),
    ("evals", "plan"),
)

# What an import inside a function must say, in a comment on its lines, just above them, or on
# an earlier such import in the same function (one comment covers a function's lazy imports).
LAZY_WORD = "lazily"


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    imported: str  # dotted module name (a longctx module) or a top-level distribution name
    line: int
    in_function: bool
    explained: bool  # a comment with LAZY_WORD goes with it


def module_files(root: str, package: str) -> dict[str, str]:
    """{dotted module name: path} for every .py file under `root` (the package's directory)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        rel = os.path.relpath(folder, root)
        parts = [package] + ([] if rel == "." else rel.split(os.sep))
        for name in files:
            if name.endswith(".py"):
                dotted = parts if name == "__init__.py" else parts + [name[:-3]]
                found[".".join(dotted)] = os.path.join(folder, name)
    return found


def _comment_lines(source_lines: list[str], node: ast.stmt) -> str:
    """The text of the import's own lines and of the comment lines right above it."""
    text = source_lines[node.lineno - 1:node.end_lineno]
    above = node.lineno - 2
    while above >= 0 and source_lines[above].strip().startswith("#"):
        text.append(source_lines[above])
        above -= 1
    return "\n".join(line.partition("#")[2] for line in text if "#" in line)


def imports_of(module: str, path: str, modules: dict[str, str], package: str) -> list[Import]:
    source = open(path).read()
    lines = source.splitlines()
    tree = ast.parse(source, path)
    is_package = os.path.basename(path) == "__init__.py"
    found: list[Import] = []

    def resolve(name: str) -> str:
        """A dotted name as the module it is: itself, or the nearest package above it."""
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:  # relative: from its package
            anchor = module.split(".")
            anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
            base = ".".join(anchor + ([base] if base else []))
        # `from pkg import mod` imports the module pkg.mod where there is one, else names of pkg
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]

    def visit(node, in_function: bool, explained_before: bool) -> None:
        explained_here = explained_before
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True, False)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                said = LAZY_WORD in _comment_lines(lines, child)
                explained_here = explained_here or (in_function and said)
                for name in targets(child):
                    top = name.split(".")[0]
                    imported = resolve(name) if top == package else top
                    found.append(Import(module, imported, child.lineno, in_function, said or explained_here))
                continue
            visit(child, in_function, explained_here)

    visit(tree, False, False)
    return found


def graph(root: str, package: str) -> tuple[dict[str, str], list[Import]]:
    modules = module_files(root, package)
    edges = [imp for module, path in sorted(modules.items()) for imp in imports_of(module, path, modules, package)]
    return modules, edges


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def dependencies(modules: dict[str, str], edges: list[Import], package: str) -> dict[str, set[str]]:
    """Module -> the package modules loading it loads first: what it imports, and the __init__ of
    each package it reaches into from outside (Python runs those before the module itself)."""
    deps: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        if e.imported.split(".")[0] != package or e.imported == e.importer:
            continue
        deps[e.importer].add(e.imported)
        own = {*_parents(e.importer), e.importer}  # (a package's __init__ is already running)
        deps[e.importer].update(p for p in _parents(e.imported) if p not in own and p != package)
    return deps


def cycles(deps: dict[str, set[str]]) -> list[list[str]]:
    """Each circle once, as the modules around it (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(deps.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in deps.get(v, ()):
                found.append(sorted(component))

    for v in sorted(deps):
        if v not in index:
            connect(v)
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def floor_of(package: str, floors=FLOORS) -> int | None:
    return next((i for i, names in enumerate(floors) if package in names), None)


def wrong_way(edges: list[Import], package: str, floors=FLOORS) -> list[str]:
    """Imports between packages that do not go down a floor, and packages missing from `floors`."""
    bad = []
    for e in edges:
        if e.imported.split(".")[0] != package:
            continue
        a, b = package_of(e.importer), package_of(e.imported)
        if a == b:
            continue
        fa, fb = floor_of(a, floors), floor_of(b, floors)
        if fa is None or fb is None:
            bad.append(f"{e.importer}:{e.line} imports {e.imported}: put "
                       f"{a if fa is None else b} on a floor in FLOORS")
        elif fb >= fa:
            how = "its own floor" if fa == fb else "a higher floor"
            bad.append(f"{e.importer}:{e.line} imports {e.imported} ({b}, on {how} than {a})")
    return bad


def unexplained_lazy_imports(edges: list[Import]) -> list[str]:
    """Imports inside functions with no comment saying "lazily" (and why). The standard library
    is no exception: it is cheap to import at the top, where a reader looks for imports."""
    return [f"{e.importer}:{e.line} imports {e.imported} inside a function"
            for e in edges if e.in_function and not e.explained]


def check(root: str, package: str, floors=FLOORS) -> list[str]:
    modules, edges = graph(root, package)
    problems = [f"import circle: {' <-> '.join(c)}" for c in cycles(dependencies(modules, edges, package))]
    return problems + wrong_way(edges, package, floors) + unexplained_lazy_imports(edges)


# ----------------------------------------------------------------------------- the package


@pytest.fixture(scope="module")
def longctx_graph():
    return graph(os.path.join(REPO, "longctx"), "longctx")


def test_no_import_circle(longctx_graph):
    modules, edges = longctx_graph
    assert cycles(dependencies(modules, edges, "longctx")) == []


def test_imports_between_packages_go_down(longctx_graph):
    _, edges = longctx_graph
    assert wrong_way(edges, "longctx") == []


def test_every_package_is_on_a_floor(longctx_graph):
    modules, _ = longctx_graph
    assert {package_of(m) for m in modules} == {p for floor in FLOORS for p in floor}


def test_imports_inside_functions_say_they_are_lazy(longctx_graph):
    _, edges = longctx_graph
    assert unexplained_lazy_imports(edges) == []


def test_train_does_not_import_evals(longctx_graph):
    """The passkey evaluator reaches the loop as a hook (longctx.train.hooks), not as an import."""
    _, edges = longctx_graph
    assert [e for e in edges if package_of(e.importer) == "train" and package_of(e.imported) == "evals"] == []


# ----------------------------------------------------------------------------- the rule itself


def _package(tmp_path, files: dict[str, str]) -> str:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)
    return str(root)


SMALL_FLOORS = (("pkg", "low"), ("high",))


def test_a_circle_hidden_in_a_function_is_found(tmp_path):
    root = _package(tmp_path, {
        "low/a.py": "from pkg.low import b\n",
        "low/b.py": "def f():\n    from pkg.low import a  # lazily, it says\n    return a\n",
    })
    assert check(root, "pkg", SMALL_FLOORS) == ["import circle: pkg.low.a <-> pkg.low.b"]


def test_a_circle_through_a_package_init_is_found(tmp_path):
    """Importing pkg.high.x from outside runs pkg/high/__init__.py first, which imports back."""
    root = _package(tmp_path, {
        "high/__init__.py": "from pkg.high import x\n",
        "high/x.py": "import numpy\n",
        "high/y.py": "from pkg.low import c\n",
        "low/c.py": "from pkg.high import x\n",
    })
    problems = check(root, "pkg", SMALL_FLOORS)
    assert problems == ["pkg.low.c:1 imports pkg.high.x (high, on a higher floor than low)"]
    (tmp_path / "pkg" / "high" / "x.py").write_text("from pkg.high import y\n")
    assert "import circle: pkg.high <-> pkg.high.x <-> pkg.high.y <-> pkg.low.c" in check(root, "pkg", SMALL_FLOORS)


def test_an_upward_import_and_an_unknown_package_are_reported(tmp_path):
    root = _package(tmp_path, {
        "low/a.py": "import pkg.high.b as b\n",
        "high/b.py": "from ..low import c\n",  # relative, downward: fine
        "low/c.py": "",
        "side/d.py": "from pkg.low import c\n",
    })
    assert check(root, "pkg", SMALL_FLOORS) == [
        "pkg.low.a:1 imports pkg.high.b (high, on a higher floor than low)",
        "pkg.side.d:1 imports pkg.low.c: put side on a floor in FLOORS",
    ]


def test_imports_inside_functions_need_a_reason(tmp_path):
    root = _package(tmp_path, {"low/a.py": (
        "def plot():\n"
        "    import matplotlib  # lazily: only when a figure is drawn\n"
        "    import matplotlib.pyplot as plt\n"  # (covered by the line above)
        "    return plt\n"
        "\n"
        "def tokenize():\n"
        "    import sentencepiece\n"
        "    return sentencepiece\n"
        "\n"
        "def model():\n"
        "    from pkg.low import b\n"
        "    return b\n"),
        "low/b.py": "",
    })
    assert check(root, "pkg", SMALL_FLOORS) == [
        "pkg.low.a:7 imports sentencepiece inside a function",
        "pkg.low.a:11 imports pkg.low.b inside a function",
    ]
