"""The documentation's examples run, so they cannot drift from the code.

* Every fenced ``python`` block of README.md and docs/*.md runs as a script in a fresh
  subprocess, in a temporary directory that holds what ``make demo`` leaves on disk: the dataset
  root ``sluice-data/datasets/fashion-mnist``, written by the real sharding code with the
  pipeline's default config (so, like the demo's, it has no holdout), and the token artifact the
  README's text commands write (``sluice-data/datasets/pydocs``). ``SLUICE_FASHION_MNIST``
  points at a small copy of Fashion-MNIST, so a block that shards ``fashion-mnist`` itself
  shards a few hundred images, and a loop over the training split is short. A block that needs
  what a test cannot give (a Prefect server, root, hours) is preceded by
  ``<!-- not-run: the reason -->``; the reason is required. Running them is slow (each starts
  torch), so those tests are marked ``slow``.
* ``bash`` blocks are not run, but each ``sluice ...`` line is parsed by the CLI's own parser
  (its subcommand and flags must exist), each ``make X`` must name a Makefile target and each
  ``python -m X`` a module of this repository.
* Relative links resolve to files inside the repository; the README stays short.
"""
from __future__ import annotations

import gzip
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^<!--\s*not-run:(.*?)-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
README_MAX_LINES = 200
# The small Fashion-MNIST the examples see: the first images of each source split.
SMALL_TRAIN, SMALL_TEST = 640, 160


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None  # the reason, when marked

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, each with the ``not-run`` marker on the line before it."""
    out, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        before = lines[start - 1] if start else ""
        marker = NOT_RUN.match(before.strip())
        out.append(Block(page, start + 1, m.group(1), "\n".join(body) + "\n",
                         marker.group(1).strip() if marker else None))
        i += 1
    return out


ALL = [b for p in PAGES for b in blocks(p)]
PYTHON = [b for b in ALL if b.lang == "python"]


# ------------------------------------------------------------------ fast checks

def test_the_docs_have_examples_and_every_marker_has_a_reason():
    assert len(PYTHON) >= 5, "the README and docs/ should hold their python examples"
    assert [b for b in PYTHON if b.page.name == "README.md" and b.not_run is None], \
        "the README's examples must run"
    for page in PAGES:
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines):
            if not (line.lstrip().startswith("<!--") and "not-run" in line):
                continue
            m = NOT_RUN.match(line.strip())
            assert m and m.group(1).strip(), \
                f"{page.name}:{n + 1}: write the marker as <!-- not-run: the reason -->"
            nxt = lines[n + 1] if n + 1 < len(lines) else ""
            assert nxt.startswith("```python"), \
                f"{page.name}:{n + 1}: a not-run marker must sit on the line just before a ```python block"


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; keep it to {README_MAX_LINES} (details go to docs/)"


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings: lower case, punctuation dropped, spaces to '-'."""
    heads = re.findall(r"^#{1,6} (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_links_stay_in_the_repository_and_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            assert path.is_relative_to(ROOT), f"{page.name} links outside the repository: {target}"
            assert path.exists(), f"{page.name} links to a missing file: {target}"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{page.name} links to a missing heading: {target}"


def _commands(code: str) -> list[list[str]]:
    """The simple commands of a bash block: comments dropped, continuations joined, split at
    ``&&``, ``||``, ``;`` and ``|``; leading ``VAR=value`` assignments dropped."""
    text = code.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        for part in re.split(r"&&|\|\||;|\|", line):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:
                words = part.split()
            while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                words = words[1:]
            if words:
                out.append(words)
    return out


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def test_bash_blocks_name_real_commands_and_flags():
    from sluice.flows.cli import build_parser
    targets, checked = _make_targets(), 0
    for b in (b for b in ALL if b.lang in ("bash", "sh", "console")):
        for words in _commands(b.code):
            cmd = Path(words[0]).name
            if cmd == "sluice":
                try:
                    build_parser().parse_args(words[1:])
                except SystemExit as e:  # argparse: an unknown subcommand or flag, a missing argument
                    assert e.code == 0, f"{b.id}: `{shlex.join(words)}` is not a valid sluice command line"
                checked += 1
            elif cmd == "make":
                wanted = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
                assert set(wanted) <= targets, f"{b.id}: `{shlex.join(words)}`: no such Makefile target"
                checked += 1
            elif cmd.startswith("python") and "-m" in words:
                module = words[words.index("-m") + 1]
                if module.split(".")[0] in ("benchmarks", "deploy", "sluice"):
                    assert importlib.util.find_spec(module) is not None, f"{b.id}: no module {module}"
                    checked += 1
    assert checked >= 10


# ------------------------------------------------------------------ the examples, run

def _write_idx(path: Path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(header + np.ascontiguousarray(arr, dtype=np.uint8).tobytes())


@pytest.fixture(scope="session")
def demo_like(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A directory holding what ``make demo`` leaves (sluice-data/datasets/fashion-mnist, sharded
    with the pipeline's default config from a small Fashion-MNIST) and what the README's text
    commands leave (sluice-data/datasets/pydocs, a token artifact of a few of the Python docs'
    sources), and the environment that makes ``fashion-mnist`` mean that small copy."""
    from sluice.flows.pipeline import PipelineConfig
    from sluice.stages.data.shard import shard_dataset
    from sluice.stages.load.arrays import fashion_mnist
    small = tmp_path_factory.mktemp("fashion-mnist-small")
    for split, prefix, n in (("train", "train", SMALL_TRAIN), ("test", "t10k", SMALL_TEST)):
        x, y = fashion_mnist(split)
        _write_idx(small / f"{prefix}-images-idx3-ubyte.gz", x[:n])
        _write_idx(small / f"{prefix}-labels-idx1-ubyte.gz", y[:n])
    env = {**os.environ, "SLUICE_FASHION_MNIST": str(small), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    template = tmp_path_factory.mktemp("demo-data")
    old = os.environ.get("SLUICE_FASHION_MNIST")
    os.environ["SLUICE_FASHION_MNIST"] = str(small)
    try:
        cfg = PipelineConfig(data_root=str(template / "sluice-data"))
        p = cfg.data.prepare_config(cfg.data.sources[0].source)
        shard_dataset(p.ingest, cfg.datasets_dir() / cfg.data.sources[0].name,
                      p.shard.model_copy(update={"progress": False, "workers": 1}))
        # what the README's text commands leave: the Python docs' sources as a token artifact
        from sluice.stages.data.text import TextShardConfig, shard_text
        from sluice.stages.data.text.debian import pydocs_folder
        corpus = pydocs_folder(tmp_path_factory.mktemp("text-corpus"), limit=40)
        shard_text(TextShardConfig(vocab_size=2048, progress=False), corpus, cfg.datasets_dir() / "pydocs")
    finally:
        if old is None:
            os.environ.pop("SLUICE_FASHION_MNIST")
        else:
            os.environ["SLUICE_FASHION_MNIST"] = old
    return template, env


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in PYTHON if b.not_run is None], ids=lambda b: b.id)
def test_python_example_runs(block: Block, demo_like, tmp_path):
    template, env = demo_like
    shutil.copytree(template, tmp_path, dirs_exist_ok=True)
    script = tmp_path / "example.py"
    script.write_text(block.code)
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"{block.id} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
