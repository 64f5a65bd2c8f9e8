"""``engine: ray`` (stages/data/engine.py) on a real multi-node Ray cluster on this machine: a
0-CPU head and two 1-CPU workers in a network namespace of their own that holds only loopback
(Ray advertises the host's own address otherwise), token authentication on. The image shard map
run as Ray tasks writes the very bytes the local pool and one process write; a worker node
removed mid-stage (images, text) costs nothing but time; a stage killed as a whole resumes from
its recorded parts; clients without the token are refused; and ``sluice shard --engine ray
--address`` writes the same artifact."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from deploy.simcluster import netadmin_missing
from ray_netns import run_in_loopback_namespace
from sluice.stages.data.config import IngestConfig, ShardConfig
from sluice.stages.data.shard import shard_dataset

pytestmark = pytest.mark.timeout(600)
LIMIT = 2000


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ray")
    return {**run_in_loopback_namespace("ray_cluster_run.py", [str(out), str(LIMIT)], 540), "out": out}


def test_the_cluster_is_three_nodes_on_loopback(cluster_run):
    assert cluster_run["nodes"] == 3 and cluster_run["address"].startswith("127.0.0.1:")
    assert cluster_run["listening"] and set(cluster_run["listening"]) <= {"127.0.0.1", "[::ffff:127.0.0.1]"}, \
        cluster_run["listening"]


def test_the_shard_map_on_ray_writes_the_same_bytes_as_the_pool_and_one_process(cluster_run):
    assert len(cluster_run["ray"]) > 40
    assert cluster_run["ray"] == cluster_run["pool"] == cluster_run["one_process"]


def test_a_grown_source_gets_the_same_incremental_version_on_ray(cluster_run):
    """A grown source's version on top of the newest one: only its new shards written, on the
    cluster, and the same bytes as the pool's version on top of the pool's."""
    g = cluster_run["grown"]
    assert g["parent"] == g["first"] and 0 < g["written"] < g["shards"] / 2, g
    assert g["ray"] == g["pool"]


def test_a_worker_node_lost_mid_stage_costs_only_time(cluster_run):
    assert cluster_run["removed_mid_stage"] and cluster_run["nodes_after"] == 2
    assert cluster_run["node_lost"] == cluster_run["pool"]


def test_text_with_a_worker_node_lost_mid_stage_is_the_same_bytes(cluster_run):
    """A worker node removed once the text stage's first part is in (parts of 30 documents, so
    dozens of them): the parts it held run again on the node left, the artifact is unchanged."""
    lost = cluster_run["text_lost"]
    assert lost["nodes_before"] == 3 and lost["nodes_after"] == 2, lost
    assert lost["results_after"] >= 10, lost  # the stage went on well after the node was gone
    assert cluster_run["text_node_lost"] == cluster_run["text_local"]


def test_an_interrupted_stage_on_ray_resumes_from_its_recorded_parts(cluster_run):
    """``sluice shard --engine ray`` killed (-9) mid-stage: the rerun reuses every shard part that
    had its completion record (storage/part_records.py), says how many, writes the rest, and the
    artifact is the pool's bytes."""
    r = cluster_run["resume"]
    assert r["killed_rc"] != 0 and r["recorded_before"] >= 4, r
    assert r["rerun_rc"] == 0, r["tail"]
    m = re.search(r"(\d+) shards written, (\d+) reused from an earlier run", r["tail"])
    assert m and int(m.group(2)) >= r["recorded_before"] and int(m.group(1)) >= 1, r["tail"]
    assert r["same"]


def test_il_scoring_on_ray_gives_the_losses_scored_here(cluster_run):
    """The IL model's scoring pass as Ray parts (stages/select/il_parts.py; a scoring batch a
    part): every train sample's loss equal to this process's, and the accuracy."""
    il = cluster_run["il"]
    assert il["n"] >= LIMIT * 0.6 and il["same"], il
    assert il["acc"][0] == il["acc"][1]
    assert any("score_part parts on 2 node(s)" in line for line in il["said"]), il["said"]


def test_clients_without_the_token_are_refused(cluster_run):
    c = cluster_run["clients"]
    assert c["right_token"]["joined"]
    assert not c["no_token"]["joined"] and c["no_token"]["refused"]
    assert not c["wrong_token"]["joined"] and c["wrong_token"]["refused"]


def test_sluice_shard_with_engine_ray_writes_the_same_artifact(cluster_run, tmp_path):
    assert cluster_run["cli_rc"] == 0, cluster_run["cli_tail"]
    from sluice.storage.artifact import open_artifact
    art = open_artifact(cluster_run["out"] / "cli")
    assert [f.sha256 for f in art.manifest.files()] == cluster_run["pool"]
    assert "engine ray" in cluster_run["cli_tail"]


def test_the_nightly_preparation_runs_its_shard_map_on_the_cluster(cluster_run):
    """``sluice run prepare --set engine.name=ray --set engine.address=...``: the flow's prepare task
    hands its shard writes to the cluster, and the version it writes verifies."""
    from sluice.stages.data.verify import verify_artifact
    assert cluster_run["prepare_rc"] == 0, cluster_run["prepare_tail"]
    said = "\n".join(cluster_run["prepare_engine"])
    assert "joined the cluster at 127.0.0.1:" in said and "shard parts on 2 node(s)" in said, said
    assert "scan_part parts on 2 node(s)" in said, said  # the scan's chunks ran there too
    root = next(p for p in (cluster_run["out"] / "night" / "datasets" / "fashion-mnist").iterdir() if p.is_dir())
    assert verify_artifact(root, full=True).ok


def test_text_signatures_and_tokens_on_ray_are_the_same_bytes_as_on_this_machine(cluster_run):
    """The text stage's MinHash signatures and tokenizing as Ray parts (many: 150 documents a
    part) give the very token artifact the stage writes here: tokenizer, every file, the exact
    and near copies dropped (the LSH buckets see the same signatures), and the CLI says where."""
    ray_, local = cluster_run["text_ray"], cluster_run["text_local"]
    assert ray_ == local and len(local["files"]) >= 3
    assert local["dropped"]["exact_duplicates"] >= 15 and local["dropped"]["near_duplicates"] >= 1, local["dropped"]
    said = "\n".join(cluster_run["text_said"])
    assert "sign_part parts on 2 node(s)" in said and "encode_part parts on 2 node(s)" in said, said
    assert "bucket_part parts on 2 node(s)" in said, said  # the LSH buckets, a band a part
    assert cluster_run["text_cli_rc"] == 0, cluster_run["text_cli_tail"]
    from sluice.storage.tokens import read_token_manifest, version_dir
    m = read_token_manifest(version_dir(cluster_run["out"] / "text-cli"))
    assert m.content_sha256 == local["content"]


def test_sluice_verify_on_ray_reports_what_it_reports_here(cluster_run):
    """The per-sample checks as Ray parts (each tar shard; the .beton in ranges of 500 records):
    the same report for a sound artifact and for one with a byte flipped inside a sample's image
    member, which is named by file, index and key; ``sluice verify --engine ray`` exits 1 on it;
    a token artifact verifies on the cluster too."""
    v = cluster_run["verify"]
    for name in ("sound", "damaged"):
        ray_, local = ({k: x for k, x in r.items() if k not in ("seconds", "root")} for r in
                       (v[name]["ray"], v[name]["local"]))
        assert ray_ == local, name
    assert v["sound"]["local"]["ok"] and v["sound"]["local"]["samples"] >= LIMIT  # a check per sample and format
    bad = v["damaged"]["local"]["damaged"]
    assert [(d["file"], d["index"]) for d in bad] == [("train/shard-000000.tar", 2)], bad
    said = "\n".join(cluster_run["verify_said"])
    assert "tar_part parts on 2 node(s)" in said and "beton_part parts on 2 node(s)" in said, said
    assert cluster_run["verify_cli_rc"] == 1 and "DAMAGED train/shard-000000.tar" in cluster_run["verify_cli_tail"], \
        cluster_run["verify_cli_tail"]
    ok, text_report = cluster_run["verify_text"]
    assert ok and text_report["ok"], text_report


def test_engine_settings_are_checked_before_anything_runs(tmp_path):
    from sluice.flows.pipeline import PipelineConfig
    from sluice.stages.data.engine import EngineConfig
    assert EngineConfig.model_validate("ray").name == "ray"
    with pytest.raises(ValueError, match="both say where the shard writes run"):
        PipelineConfig.model_validate({"data": {"source": "fashion-mnist"}, "engine": "ray",
                                       "prepare_runner": "threads"})
    r = subprocess.run([sys.executable, "-m", "sluice.flows.cli", "shard", "fashion-mnist", "--out", str(tmp_path),
                        "--address", "127.0.0.1:1"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode != 0 and "--address names a Ray cluster" in r.stdout + r.stderr
    cfg = ShardConfig(shard_samples=100, progress=False)
    local = shard_dataset(IngestConfig(source="fashion-mnist", limit=300), tmp_path / "a", cfg,
                          map_shards=None)  # engine: local is the stage's own pool
    assert local.shards_written > 0


def test_an_instance_sluice_starts_listens_on_loopback_and_wants_its_token(tmp_path):
    """``engine: ray`` without an address, on a host that has an address besides loopback (a
    namespace with a veth to a second one): Sluice's own instance listens on 127.0.0.1 only,
    advertises 127.0.0.1, has token authentication with a token of its own, refuses a client
    without it, and shards the same bytes as the pool."""
    pytest.importorskip("ray", reason="make setup installs ray (the 'ray' extra)")
    why = netadmin_missing()
    if why:
        pytest.skip(why)
    a, b = f"sluice-rayown-{os.getpid()}", f"sluice-rayown-peer-{os.getpid()}"
    va, vb = f"sr{os.getpid() % 100000}a", f"sr{os.getpid() % 100000}b"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True)
    try:
        ip("netns", "add", a)
        ip("netns", "add", b)
        ip("link", "add", va, "type", "veth", "peer", "name", vb)
        ip("link", "set", va, "netns", a)
        ip("link", "set", vb, "netns", b)
        ip("-n", a, "addr", "add", "10.77.0.2/24", "dev", va)
        for ns, dev in ((a, va), (a, "lo"), (b, vb)):
            ip("-n", ns, "link", "set", dev, "up")
        r = subprocess.run(["ip", "netns", "exec", a, sys.executable, str(ROOT / "tests" / "ray_own_instance_run.py"),
                            str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "delete", ns], check=False)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-5000:]
    rep = json.loads(next(x for x in text.splitlines() if x.startswith("REPORT "))[len("REPORT "):])
    assert rep["auth_mode"] == "token" and rep["has_token"]
    assert rep["advertised"] == ["127.0.0.1"]
    assert rep["listening"] and set(rep["listening"]) <= {"127.0.0.1", "[::ffff:127.0.0.1]"}, rep["listening"]
    assert not rep["stranger_joined"]
    assert rep["ray"] == rep["local"] and len(rep["ray"]) > 4
