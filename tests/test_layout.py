"""The shape of the house: one installed namespace, no import cycles, layers that only import
downward, modules of a readable size, and a wheel whose only top-level package is ``sluice``."""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGE_DIRS = {"sluice": ROOT / "sluice", "sluice.stages": ROOT / "stages",
                "sluice.storage": ROOT / "storage", "sluice.flows": ROOT / "flows"}
MAX_LINES = 600  # a signal to look, not a rule: past it a module usually does two jobs


def _modules() -> dict[str, Path]:
    """Every module of the installed namespace, by dotted name (packages by their ``__init__``)."""
    out = {}
    for pkg, root in PACKAGE_DIRS.items():
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: Path, known: set[str]) -> set[str]:
    """Project modules ``path`` imports: ``import a.b``, ``from a.b import c`` (to ``a.b.c`` when
    that is a module, else ``a.b``) and ``importlib.import_module("a.b")`` with a literal name,
    at any depth (lazy imports count); annotation-only imports under ``if TYPE_CHECKING`` do
    not. Importing ``a.b.c`` is an edge to ``a.b.c`` only, as import-linter counts it: a package
    ``__init__`` that imports its own entries (each registry's one line) is not a cycle."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found.add(full if full in known else node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" \
                and node.args and isinstance(node.args[0], ast.Constant):
            found.add(str(node.args[0].value))
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(ast.parse(path.read_text()))
    return {m for m in found if m in known}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(path, known) - {name} for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles(graph):
    assert _cycles(graph) == []


@pytest.mark.parametrize("layer,forbidden", [
    ("sluice.storage", ("sluice.stages", "sluice.flows", "prefect", "torch.distributed")),
    ("sluice.stages", ("sluice.flows", "prefect")),
    ("sluice.stages.data", ("sluice.stages.load", "sluice.stages.select", "sluice.stages.train",
                            "sluice.stages.run", "sluice.stages.kinds")),
    ("sluice.stages.load", ("sluice.stages.select", "sluice.stages.train", "sluice.stages.run",
                            "sluice.stages.kinds")),
    ("sluice.stages.select", ("sluice.stages.load", "sluice.stages.train", "sluice.stages.run",
                              "sluice.stages.kinds")),
    ("sluice.stages.train", ("sluice.stages.run", "sluice.stages.kinds")),
    ("sluice.stages.kinds", ("sluice.stages.run",)),
    ("sluice.stages.contracts", ("sluice.stages.",)),
    ("sluice.errors", ("sluice.",)),
])
def test_layers_import_only_downward(layer, forbidden):
    """Contracts and errors sit below everything; a rank (``train``) never reaches up into the
    run that launches it (``run``) or the kinds of data; a kind (``kinds``) sits above the stages
    it composes and below the run that calls it; nothing in ``stages`` imports the flows."""
    mods = _modules()
    bad = []
    for name, path in mods.items():
        if name != layer and not name.startswith(layer + "."):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            bad += [f"{name} imports {n}" for n in names if n.startswith(forbidden) and n != name]
    assert bad == []


def test_every_package_folder_is_installed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    on_disk = {n for n, p in _modules().items() if p.name == "__init__.py"}
    assert on_disk == listed, (on_disk ^ listed)
    assert {k: ROOT / v for k, v in cfg["package-dir"].items()} == PACKAGE_DIRS


def test_modules_stay_readable():
    """No module over 600 lines: past that a module usually does two jobs; look, and split it
    where it does (a short module is no goal: one concept, one module)."""
    long = [f"{n} ({len(p.read_text().splitlines())} lines)" for n, p in _modules().items()
            if len(p.read_text().splitlines()) > MAX_LINES]
    assert long == []


def test_benchmarks_and_scripts_stay_readable():
    """The same 600-line signal for every module beside the package: the benchmarks (each with
    its section of docs/results.md) and the scripts; a cache folder under them is not code."""
    files = [f for d in ("benchmarks", "scripts") for f in sorted((ROOT / d).rglob("*.py"))
             if not any(part.startswith(".") for part in f.relative_to(ROOT).parts)]
    assert files
    long = [f"{f.relative_to(ROOT)} ({n} lines)" for f in files
            if (n := len(f.read_text().splitlines())) > MAX_LINES]
    assert long == []


@pytest.mark.slow
def test_no_undefined_names():
    """A name used but never defined or imported is a NameError waiting on the one path that
    reaches it (a scorer's helper reached only from a deployed flow once shipped that way)."""
    from pyflakes import api as flakes
    from pyflakes import messages, reporter

    class Collect(reporter.Reporter):
        def __init__(self):
            super().__init__(None, None)
            self.found: list[str] = []

        def flake(self, m):
            if isinstance(m, (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)):
                self.found.append(str(m))

        def syntaxError(self, filename, msg, lineno, offset, text):
            self.found.append(f"{filename}:{lineno}: {msg}")

        def unexpectedError(self, filename, msg):
            self.found.append(f"{filename}: {msg}")

    got = Collect()
    dirs = [*PACKAGE_DIRS.values(), ROOT / "deploy", ROOT / "benchmarks", ROOT / "tests", ROOT / "scripts"]
    flakes.checkRecursive([str(d) for d in dirs if d.exists()], got)
    assert got.found == []


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_package_usable_without_prefect(tmp_path):
    """A wheel holds ``sluice`` and nothing beside it; installed alone, the loader imports
    without Prefect (or FFCV, or DALI) being imported."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next(tmp_path.glob("sluice-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        info = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert z.read(info).decode().split() == ["sluice"]
    assert top == {"sluice"}, top
    assert not any(n.startswith(("sluice/benchmarks", "sluice/tests")) for n in names)
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                        str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    code = ("import sys, sluice\n"
            "from sluice.stages.load import Loader\n"
            "from sluice.stages.train import TrainConfig, train\n"
            "print(sluice.__file__)\n"
            "print(sorted(m for m in ('prefect', 'ffcv', 'nvidia.dali') if m in sys.modules))\n")
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    where, loaded = r.stdout.splitlines()
    assert where.startswith(str(target)) and loaded == "[]"


def _hop_tables(text: str) -> list[list[tuple[str, str]]]:
    """Each hop table of docs/architecture.md: its rows ``| n | `caller` | `callee` |``, in order."""
    import re
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        m = re.match(r"^\| \d+ \| `([\w.]+)` \| `([\w.]+)` \|$", line)
        if m:
            rows.append(m.groups())
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def test_the_run_path_in_architecture_md_is_the_code(graph):
    """docs/architecture.md's tables, from ``sluice demo`` and from ``sluice run nightly`` (the
    text night's path) to ``train_step``: each caller calls the next function, imports its module,
    and each path crosses at most 6 modules."""
    tables = _hop_tables((ROOT / "docs" / "architecture.md").read_text())
    assert {t[0][0] for t in tables} >= {"sluice.flows.cli.cmd_demo", "sluice.flows.cli.cmd_run"}, \
        "docs/architecture.md needs the demo's path and the text night's"
    mods = _modules()
    for rows in tables:
        assert rows[-1][1].endswith(".step.train_step"), rows[-1]
        hops = 0
        for k, (caller, callee) in enumerate(rows):
            assert k == 0 or rows[k - 1][1] == caller, f"the path breaks before {caller}"
            (cmod, cfn), (tmod, tfn) = caller.rsplit(".", 1), callee.rsplit(".", 1)
            defs = {n.name: n for n in ast.parse(mods[tmod].read_text()).body if isinstance(n, ast.FunctionDef)}
            assert tfn in defs, f"{tmod} defines no function {tfn}"
            fn = next(n for n in ast.parse(mods[cmod].read_text()).body
                      if isinstance(n, ast.FunctionDef) and n.name == cfn)
            called = {c.func.id if isinstance(c.func, ast.Name) else c.func.attr for c in ast.walk(fn)
                      if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))}
            assert tfn in called, f"{caller} does not call {tfn}"
            if cmod != tmod:
                assert tmod in graph[cmod], f"{cmod} does not import {tmod}"
                hops += 1
        assert hops <= 6, f"the path from {rows[0][0]} crosses {hops} modules"
