"""The drill list is the truth: every drill in ``corpus.DRILLS`` is exercised by a test marked
``@pytest.mark.drill(<id>)``, no test names an unknown drill, and docs/reliability.md's
section lists every drill with its count."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from corpus import DRILLS, ROOT

HERE = Path(__file__).parent


def marked_drills() -> dict[str, list[str]]:
    """drill id -> the tests marked with it, read from the test modules' decorators."""
    out: dict[str, list[str]] = {}
    for module in sorted(HERE.glob("test_*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.FunctionDef):
                for dec in node.decorator_list:
                    if isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "drill":
                        for arg in dec.args:
                            out.setdefault(arg.value, []).append(f"{module.name}::{node.name}")
    return out


def test_every_drill_is_run_and_documented():
    marked = marked_drills()
    assert set(marked) - set(DRILLS) == set(), "tests name drills that corpus.DRILLS does not list"
    assert set(DRILLS) - set(marked) == set(), "drills without a test"
    section = (ROOT / "docs" / "reliability.md").read_text()
    listed = set(re.findall(r"`([a-z0-9-]+)`", section))
    assert set(DRILLS) <= listed, f"docs/reliability.md does not list {sorted(set(DRILLS) - listed)}"
    assert f"{len(DRILLS)} drills" in section
