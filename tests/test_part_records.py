"""The shard parts' completion records and the strict merge (storage/part_records.py): the
merge reads every planned shard's record back from storage, whatever ran the parts, and refuses
a part that is missing (after a bounded wait), partial or written for another plan, naming it;
a rerun reuses exactly the recorded parts and rewrites the rest."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.errors import ShardError
from sluice.stages.data.config import IngestConfig, ShardConfig
from sluice.stages.data.shard import shard_dataset, write_shard_from_spec
from sluice.storage import part_records
from sluice.storage.artifact import open_artifact

pytestmark = pytest.mark.timeout(300)
ING = IngestConfig(source="fashion-mnist", limit=600)
CFG = ShardConfig(shard_samples=100, formats=["webdataset", "dali", "ffcv"], progress=False, workers=1,
                  merge_wait_s=1.0)


def all_but(skip: str):
    """A shard map (the callable form a Prefect task runner is handed) that leaves one part out."""
    def run(spec, tasks):
        out = []
        for t in tasks:
            r = write_shard_from_spec(spec, t)
            if t["tar"].endswith(skip):
                part_records.record_path(t["tar"]).unlink()  # as if its node died before the record
            out.append(r)
        return out
    return run


def then(change):
    """A shard map that writes every part, then does ``change`` to the parts' files."""
    def run(spec, tasks):
        out = [write_shard_from_spec(spec, t) for t in tasks]
        change([Path(t["tar"]) for t in tasks])
        return out
    return run


def _sums(out: Path) -> list[str]:
    return [f.sha256 for f in open_artifact(out).manifest.files()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[str]:
    out = tmp_path_factory.mktemp("ref")
    shard_dataset(ING, out, CFG)
    return _sums(out)


def test_a_missing_part_is_refused_by_name_after_the_wait_and_a_rerun_writes_only_it(tmp_path, reference):
    with pytest.raises(ShardError, match=r"refused 1 of \d+ parts:\n  train/shard-000002.tar: missing, no "
                                         r"completion record after 1 s"):
        shard_dataset(ING, tmp_path, CFG, map_shards=all_but("train/shard-000002.tar"))
    version = next(p for p in tmp_path.iterdir() if p.is_dir())
    assert not (version / "manifest.json").exists()  # nothing visible
    again = shard_dataset(ING, tmp_path, CFG)
    assert again.shards_written == 1 and again.shards_reused >= 5, again.format()
    assert "1 shards written" in again.format() and f"{again.shards_reused} reused" in again.format()
    assert _sums(tmp_path) == reference
    assert not list(version.rglob("*" + part_records.SUFFIX))  # the records go with the scratch files


def test_a_partial_part_is_refused_at_once(tmp_path):
    def truncate(tars):
        with open(tars[1], "r+b") as f:
            f.truncate(1024)
    with pytest.raises(ShardError, match=r"train/shard-000001.tar: partial, shard-000001.tar holds 1024 bytes, "
                                         r"its record says \d+"):
        shard_dataset(ING, tmp_path, CFG.model_copy(update={"merge_wait_s": 3600.0}), map_shards=then(truncate))


def test_a_part_recorded_for_another_plan_is_refused_as_foreign(tmp_path):
    def other_plan(tars):
        path = part_records.record_path(tars[0])
        rec = json.loads(path.read_text())
        path.write_text(json.dumps({**rec, "plan": "0" * 64}))
    with pytest.raises(ShardError, match=r"train/shard-000000.tar: foreign, its completion record "
                                         r"shard-000000.tar.done.json is for plan 000000000000"):
        shard_dataset(ING, tmp_path, CFG, map_shards=then(other_plan))


def test_a_part_whose_result_differs_from_its_record_is_refused(tmp_path):
    def lie(spec, tasks):
        out = [write_shard_from_spec(spec, t) for t in tasks]
        out[0] = {**out[0], "tar_sha": "f" * 64}
        return out
    with pytest.raises(ShardError, match=r"train/shard-000000.tar: foreign"):
        shard_dataset(ING, tmp_path, CFG, map_shards=lie)


def test_a_rerun_rewrites_what_is_not_recorded_for_its_plan_and_reuses_the_rest(tmp_path, reference):
    def damage(tars):  # one part of another plan, one whose record went, one cut short
        path = part_records.record_path(tars[0])
        path.write_text(json.dumps({**json.loads(path.read_text()), "plan": "1" * 64}))
        part_records.record_path(tars[1]).unlink()
        with open(tars[2], "r+b") as f:
            f.truncate(512)
    with pytest.raises(ShardError, match="refused"):
        shard_dataset(ING, tmp_path, CFG, map_shards=then(damage))
    again = shard_dataset(ING, tmp_path, CFG)
    assert again.shards_written == 3, again.format()
    assert _sums(tmp_path) == reference
    open_artifact(tmp_path).verify()  # raises on any damage


def test_the_merge_waits_for_a_record_that_shows_late(tmp_path):
    """Storage that shows a part's record late (a shared filesystem): the merge polls until its
    bounded wait, and takes the part once the record is there."""
    import threading
    import time
    target = tmp_path / "part.bin"
    target.write_bytes(b"x" * 10)

    def late():
        time.sleep(0.5)
        part_records.finish(target, "p", {"n": 1}, [target])
    t = threading.Thread(target=late)
    t.start()
    assert part_records.merge([(target, "p")], wait_s=60, poll_s=0.05) == [{"n": 1}]
    t.join()
    with pytest.raises(part_records.PartRefused, match="other.bin: missing, no completion record after 0.2 s"):
        part_records.merge([(target, "p"), (tmp_path / "other.bin", "p")], wait_s=0.2, poll_s=0.05,
                           name=lambda p: p.name)
