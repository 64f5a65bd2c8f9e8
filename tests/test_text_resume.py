"""A text stage interrupted as a whole resumes from its finished parts (stages/data/text/resume.py):
``kill -9`` while it tokenises, and the rerun takes every signature and token part the killed
run had stored for the very same documents, says how many, computes the rest, and writes the
artifact an uninterrupted run writes; a stored part is never taken for other documents."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT
from sluice.stages.data.text import TextShardConfig, shard_text
from sluice.stages.data.text import parts as text_parts
from sluice.stages.data.text.resume import PARTS_DIR, KeptParts

pytestmark = pytest.mark.timeout(600)

SCRIPT = """
import sys, time
from sluice.stages.data.text import TextShardConfig, shard_text
from sluice.stages.data.text import parts
parts.PART_DOCS = 25
slow = parts.encode_part
def encode_slowly(p):  # the killed run: slow enough to be caught while it tokenises
    time.sleep(float(sys.argv[3]))
    return slow(p)
encode_slowly.__name__, encode_slowly.__qualname__ = slow.__name__, slow.__qualname__  # the same plans
encode_slowly.__module__ = slow.__module__
import sluice.stages.data.text.shard as shard
if float(sys.argv[3]):
    shard.encode_part = encode_slowly
s = shard_text(TextShardConfig(vocab_size=400, progress=False), sys.argv[1], sys.argv[2])
print("RESUMED", repr(s.resumed))
print(s.format())
"""


def _corpus(path):
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(300)]
    with open(path, "w") as f:
        for i in range(600):
            f.write(json.dumps({"id": f"d{i:04d}", "text": " ".join(rng.choice(words, 60))}) + "\n")
        for i in range(20):  # exact copies: the dedup still sees them on the rerun
            f.write(json.dumps({"id": f"copy{i}", "text": json.loads(open(path).readline())["text"]}) + "\n")
    return path


def _files(root):
    from sluice.storage.tokens import read_token_manifest
    m = read_token_manifest(root)
    return [m.tokenizer.file.sha256] + [f.sha256 for s in m.splits.values() for f in s.files()], m.dropped.model_dump()


def test_kill_9_while_tokenising_then_the_rerun_reuses_the_finished_parts(tmp_path):
    corpus = _corpus(tmp_path / "c.jsonl")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, str(corpus), str(out), "0.3"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline and len(list(out.glob(f"*/{PARTS_DIR}/encode_part-*.done.json"))) < 3 \
            and p.poll() is None:
        time.sleep(0.02)
    assert p.poll() is None, p.communicate()  # still tokenising
    p.send_signal(signal.SIGKILL)
    p.wait()
    signed = len(list(out.glob(f"*/{PARTS_DIR}/sign_part-*.done.json")))
    encoded = len(list(out.glob(f"*/{PARTS_DIR}/encode_part-*.done.json")))
    assert signed >= 20 and encoded >= 3
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(corpus), str(out), "0"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESUMED"))
    reused = int(line.split("resumed an interrupted run: ")[1].split()[0])
    assert reused >= signed + encoded, (line, signed, encoded)
    assert "parts reused" in r.stdout  # the summary says so
    version = next(d for d in out.iterdir() if d.is_dir())
    assert not (version / PARTS_DIR).exists()  # gone once the version is written

    text_parts_docs = text_parts.PART_DOCS
    try:
        text_parts.PART_DOCS = 25
        whole = shard_text(TextShardConfig(vocab_size=400, progress=False), corpus, tmp_path / "whole")
    finally:
        text_parts.PART_DOCS = text_parts_docs
    assert _files(version) == _files(whole.root)
    assert _files(version)[1]["exact_duplicates"] >= 19


def test_a_stored_part_is_taken_only_for_the_same_documents(tmp_path):
    from sluice.stages.data.text.parts import sign_part
    kept = KeptParts(None, tmp_path / PARTS_DIR)
    params = (16, 3, 0)
    first = list(kept.ordered(sign_part, [(params, [0, 1], ["a b c d", "e f g h"])]))
    assert kept.ran == 1 and kept.reused == 0
    again = KeptParts(None, tmp_path / PARTS_DIR)
    same = list(again.ordered(sign_part, [(params, [0, 1], ["a b c d", "e f g h"]),
                                          (params, [0, 1], ["a b c d", "e f g X"]),  # one text differs
                                          (params, [5, 6], ["a b c d", "e f g h"])]))  # other ids
    assert again.reused == 1 and again.ran == 2
    assert same[0][0] == first[0][0] and np.array_equal(same[0][1], first[0][1])
    assert not np.array_equal(same[1][1], first[0][1]) and same[2][0] == [5, 6]
    assert "1 of 3 parts reused" in again.said()
