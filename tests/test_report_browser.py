"""The nightly report as a person sees it: a real Prefect server with its UI, a tiny nightly run
through ``sluice run nightly``, and the artifact page opened in headless Chromium. Checked on
the page: the step count and final accuracy the run really had, and both charts drawn by the
browser with sane axes. On failure a screenshot is saved in the test's temp directory."""
from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import browser
from conftest import ROOT
from prefect_stack import api

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(browser.missing() is not None, reason=str(browser.missing()))]
SVG = "{http://www.w3.org/2000/svg}"
STEPS = 20


def _ticks(svg: str, axis: str) -> list[str]:
    root = ET.fromstring(svg)
    return [t.text or "" for g in root.iter(f"{SVG}g") if g.get("id", "").startswith(f"{axis}tick_")
            for t in g.iter(f"{SVG}text")]


def _series_marks(svg: str, name: str) -> int:
    root = ET.fromstring(svg)
    return sum(len(list(g.iter(f"{SVG}use"))) + len(list(g.iter(f"{SVG}path")))
               for g in root.iter(f"{SVG}g") if g.get("id") == f"series-{name}")


def test_nightly_report_reads_right_in_a_real_browser(prefect_server, tmp_path):
    data = tmp_path / "data"
    sets = {"data.ingest.limit": 600, "data.shard.workers": 1, "data.shard.formats": "[webdataset,dali]",
            "selection.method": "none", "train.max_steps": STEPS, "train.batch_size": 32,
            "nproc": 2}  # tiny: the IL lines are checked in test_report.py
    cmd = [sys.executable, "-m", "sluice.flows.cli", "run", "nightly", "--data-root", str(data)]
    cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    r = subprocess.run(cmd, env=prefect_server.env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    (metrics,) = (data / "runs").glob("*/metrics.jsonl")
    evals = [json.loads(x)["eval"] for x in metrics.read_text().splitlines() if x.startswith('{"eval"')]
    assert len(evals) == 1 and evals[0]["step"] == STEPS  # one evaluation: the case that drew nothing

    arts = api(prefect_server.url, "/artifacts/filter",
               {"artifacts": {"key": {"any_": ["nightly-summary"]}}, "sort": "CREATED_DESC", "limit": 50})
    (art,) = [a for a in arts if str(data) in (a.get("data") or "")]
    b = browser.Browser(tmp_path)
    try:
        b.open(f"{prefect_server.base}/artifacts/artifact/{art['id']}")
        text = b.wait_for("return document.body.innerText.includes('Sluice nightly run') && document.body.innerText",
                          timeout=90)
        assert f"{STEPS} steps on 2 ranks" in text, text[:3000]
        assert f"final evaluation on test: accuracy {evals[0]['acc']:.4f}" in text, text[:3000]
        imgs = b.wait_for("""
            const imgs = [...document.querySelectorAll('img')].filter(i => i.src.startsWith('data:image/svg'));
            return imgs.length == 2 && imgs.every(i => i.complete && i.naturalWidth > 0) &&
                   imgs.map(i => [i.alt, i.src, i.naturalWidth, i.naturalHeight]);""", timeout=30)
        charts = {alt: base64.b64decode(src.split(",", 1)[1]).decode() for alt, src, _, _ in imgs}
        assert set(charts) == {"training loss", "evaluation accuracy"}
        assert all(w >= 300 and h >= 150 for _, _, w, h in imgs)  # drawn at a readable size
        for name, svg in charts.items():
            xs = [int(t) for t in _ticks(svg, "x")]  # integer steps, increasing, from 0
            assert xs[0] == 0 and xs == sorted(set(xs)) and xs[-1] <= STEPS * 1.1, (name, xs)
            ys = [float(t.replace("\u2212", "-")) for t in _ticks(svg, "y")]
            assert ys == sorted(ys) and len(ys) >= 2 and ys[0] >= 0, (name, ys)
        acc_y = [float(t) for t in _ticks(charts["evaluation accuracy"], "y")]
        assert acc_y[-1] <= 1.0 and acc_y[0] <= evals[0]["acc"] <= acc_y[-1], acc_y  # the point is in view
        assert _series_marks(charts["evaluation accuracy"], "eval-accuracy") >= 1  # the one point is drawn
        assert _series_marks(charts["training loss"], "train-loss") >= 1
    except BaseException:
        with contextlib.suppress(Exception):
            b.screenshot(tmp_path / "report-page.png")
            (tmp_path / "report-page.txt").write_text(str(b.js("return document.body.innerText")))
        raise
    finally:
        b.close()
