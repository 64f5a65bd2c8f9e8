"""The README's results section is exactly what the committed results files say (it is generated
by ``python -m benchmarks.report``): a figure no file backs cannot sit there."""
from __future__ import annotations

from conftest import ROOT


def test_readme_results_match_the_results_files():
    from benchmarks import report
    current = (ROOT / "README.md").read_text()
    assert report.splice(current, report.render()) == current, \
        "README.md's results section is stale: run `python -m benchmarks.report`"
