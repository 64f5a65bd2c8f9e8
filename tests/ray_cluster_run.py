"""Run inside a network namespace that has only loopback (tests/test_ray_engine.py starts it):
a real 3-node Ray cluster (a 0-CPU head, two 1-CPU workers, 100 MiB object stores, token
authentication, every node on 127.0.0.1), Fashion-MNIST sharded through ``engine: ray`` and on
this machine, a worker node removed while the shard map runs, clients without the token, and
``sluice shard --engine ray``. Prints one JSON line: what the test checks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = "sluice-test-" + os.urandom(16).hex()
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from sluice.stages.data.config import IngestConfig, ShardConfig  # noqa: E402
from sluice.stages.data.engine import EngineConfig, engine_parts  # noqa: E402
from sluice.stages.data.shard import shard_dataset  # noqa: E402

MIB = 2**20
out = Path(sys.argv[1])
limit = int(sys.argv[2])
t0 = time.time()
cluster = Cluster(initialize_head=True, head_node_args={"node_ip_address": "127.0.0.1", "num_cpus": 0,
                                                         "object_store_memory": 100 * MIB, "include_dashboard": False})
workers = [cluster.add_node(node_ip_address="127.0.0.1", num_cpus=1, object_store_memory=100 * MIB) for _ in range(2)]
cluster.wait_for_nodes()
report: dict = {"started_s": round(time.time() - t0, 1), "address": cluster.address}
listening = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout.split("\n")
report["listening"] = sorted({line.split()[3].rsplit(":", 1)[0] for line in listening if line.strip()})

ing = IngestConfig(source="fashion-mnist", limit=limit)
cfg = ShardConfig(shard_samples=100, formats=["webdataset", "dali", "ffcv"], progress=False)
engine = EngineConfig(name="ray", address=cluster.address)


def sums(summary) -> list[str]:
    return [f.sha256 for f in summary.manifest.files()]


run = engine_parts(engine, log=lambda line: None)


def engine_saying(lines: list[str]):  # the engine, saying what ran where into ``lines``
    return engine_parts(engine, log=lines.append)


on_ray = shard_dataset(ing, out / "ray", cfg, map_shards=run)
report["ray"] = sums(on_ray)
report["nodes"] = len([n for n in ray.nodes() if n["Alive"]])
report["pool"] = sums(shard_dataset(ing, out / "pool", cfg.model_copy(update={"workers": 2})))
report["one_process"] = sums(shard_dataset(ing, out / "one", cfg.model_copy(update={"workers": 1})))

# the source grown: a version written on top of the newest one, its new shards on the cluster and here
grown = ing.model_copy(update={"limit": limit + 300})
grown_ray = shard_dataset(grown, out / "ray", cfg, map_shards=run)
grown_pool = shard_dataset(grown, out / "pool", cfg.model_copy(update={"workers": 2}))
report["grown"] = {"ray": sums(grown_ray), "pool": sums(grown_pool), "parent": grown_ray.manifest.parent,
                   "written": grown_ray.shards_written, "first": Path(on_ray.root).name,
                   "shards": sum(len(x.shards) for x in grown_ray.manifest.splits.values())}

# a worker node removed while the shard map runs: its parts run again on the node that is left
started, removed_during = threading.Event(), {}


def while_running(spec, tasks):  # the shard map alone, as a callable that says when it started
    from sluice.stages.data.shard import write_part
    started.set()
    result = run.all(write_part, [(spec, t) for t in tasks], "shard parts")
    removed_during.setdefault("finished", time.time())
    return result


def remove_a_node():
    """Once a few parts are written (and the others are running or queued on both workers)."""
    started.wait(120)
    while len(list((out / "lost").rglob("*.tar*"))) < 4 and "finished" not in removed_during:
        time.sleep(0.01)
    removed_during["at"] = time.time()
    removed_during["parts_before"] = len(list((out / "lost").rglob("*.tar*")))
    cluster.remove_node(workers[0])


killer = threading.Thread(target=remove_a_node)
killer.start()
report["node_lost"] = sums(shard_dataset(ing, out / "lost", cfg, map_shards=while_running))
killer.join()
report["removed_mid_stage"] = removed_during["at"] < removed_during["finished"]
report["parts_before_removal"] = removed_during["parts_before"]
report["nodes_after"] = len([n for n in ray.nodes() if n["Alive"]])

# clients: without the token, with another one, and with it
probe = "import ray, sys; ray.init(address=sys.argv[1]); print('JOINED')"
clients = {}
for label, env in (("no_token", {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}),
                   ("wrong_token", {**os.environ, "RAY_AUTH_TOKEN": "sluice-test-" + os.urandom(16).hex()}),
                   ("right_token", dict(os.environ))):
    try:
        r = subprocess.run([sys.executable, "-c", probe, cluster.address], env=env, capture_output=True, text=True,
                           timeout=90)
        clients[label] = {"joined": "JOINED" in r.stdout, "refused": "Authentication" in r.stderr
                          or "InvalidAuthToken" in r.stderr or "Unauthenticated" in r.stderr}
    except subprocess.TimeoutExpired:
        clients[label] = {"joined": False, "refused": True, "timed_out": True}
report["clients"] = clients

# text: MinHash signatures and tokenizing as Ray parts (parts of 150 documents here, so there
# are many), against the same stage on this machine; exact and near copies in the corpus
from sluice.stages.data.text import parts as text_parts  # noqa: E402
from sluice.stages.data.text.config import TextShardConfig  # noqa: E402
from sluice.stages.data.text.debian import gcide_jsonl  # noqa: E402
from sluice.stages.data.text.shard import shard_text  # noqa: E402

text_parts.PART_DOCS = 150
corpus = gcide_jsonl(out / "text-src", limit=1500)
rows = corpus.read_text().splitlines()
extra = []
for i, line in enumerate(rows[:40]):
    rec = json.loads(line)
    text = rec["text"] if i % 2 else rec["text"].replace(" ", "  ", 1) + " again"  # exact, then near copies
    extra.append(json.dumps({"id": f"copy-{i}", "text": text}))
corpus.write_text("\n".join(rows + extra) + "\n")
tcfg = TextShardConfig(vocab_size=600, progress=False)


def token_sums(summary) -> dict:
    m = summary.manifest
    return {"files": [m.tokenizer.file.sha256] + [f.sha256 for s in m.splits.values() for f in s.files()],
            "content": m.content_sha256, "dropped": m.dropped.model_dump(mode="json"), "counts": m.counts()}


said: list[str] = []
report["text_ray"] = token_sums(shard_text(tcfg, corpus, out / "text-ray", engine_saying(said)))
report["text_local"] = token_sums(shard_text(tcfg, corpus, out / "text-local"))
report["text_said"] = said

# sluice verify on the cluster: a tar shard's parts and the .beton's record ranges (500 records a
# part here) as Ray tasks; the same report as here, for a sound copy and a damaged one
import shutil  # noqa: E402

from sluice.stages.data import verify as verify_mod  # noqa: E402
from sluice.stages.kinds import kind_of  # noqa: E402

verify_mod.BETON_PART = 500
damaged = out / "damaged" / Path(on_ray.root).name
shutil.copytree(on_ray.root, damaged)
first = on_ray.manifest.split("train").shards[0]
line = (damaged / first.dali_index.path).read_text().split("\n")[3].split()  # the third sample's members
j = line.index(on_ray.manifest.fields.image.encoding)
at = int(line[j + 1]) + int(line[j + 2]) // 2
with open(damaged / first.tar.path, "r+b") as f:  # one byte inside that sample's image member
    f.seek(at)
    byte = f.read(1)
    f.seek(at)
    f.write(bytes([byte[0] ^ 0xFF]))
checks_said: list[str] = []
report["verify"] = {name: {"ray": verify_mod.verify_artifact(root, parts=engine_saying(checks_said)).to_dict(),
                           "local": verify_mod.verify_artifact(root).to_dict()}
                    for name, root in (("sound", on_ray.root), ("damaged", str(damaged)))}
report["verify_said"] = checks_said
report["verify_text"] = kind_of("tokens").verify_artifact(out / "text-ray", full=True, parts=run)[:2]
vcli = subprocess.run([sys.executable, "-m", "sluice.flows.cli", "verify", str(damaged), "--engine", "ray",
                       "--address", cluster.address], capture_output=True, text=True, timeout=300)
report["verify_cli_rc"], report["verify_cli_tail"] = vcli.returncode, (vcli.stdout + vcli.stderr)[-1500:]

tcli = subprocess.run([sys.executable, "-m", "sluice.flows.cli", "shard", str(corpus), "--out", str(out / "text-cli"),
                       "--engine", "ray", "--address", cluster.address, "--quiet", "--set", "vocab_size=600"],
                      capture_output=True, text=True, timeout=300)
report["text_cli_rc"], report["text_cli_tail"] = tcli.returncode, (tcli.stdout + tcli.stderr)[-1500:]

cli = subprocess.run([sys.executable, "-m", "sluice.flows.cli", "shard", "fashion-mnist", "--out", str(out / "cli"),
                      "--engine", "ray", "--address", cluster.address, "--quiet", "--set", f"ingest.limit={limit}",
                      "--set", "shard.shard_samples=100", "--set", "shard.formats=[webdataset,dali,ffcv]"],
                     capture_output=True, text=True, timeout=300)
report["cli_rc"], report["cli_tail"] = cli.returncode, (cli.stdout + cli.stderr)[-1500:]

# a stage interrupted as a whole: ``sluice shard --engine ray`` killed (-9) once a few shard parts
# are recorded; the rerun reuses exactly the recorded parts, says how many, and ends with the same bytes
from sluice.storage.part_records import SUFFIX  # noqa: E402

kcmd = [sys.executable, "-m", "sluice.flows.cli", "shard", "fashion-mnist", "--out", str(out / "killed"), "--quiet",
        "--engine", "ray", "--address", cluster.address, "--set", "ingest.limit=600",
        "--set", "shard.shard_samples=50", "--set", "shard.formats=[webdataset,dali,ffcv]"]
victim = subprocess.Popen(kcmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
deadline = time.time() + 240
while time.time() < deadline and victim.poll() is None and len(list((out / "killed").glob(f"*/*/*{SUFFIX}"))) < 4:
    time.sleep(0.005)
victim.kill()
victim.wait()
recorded = len(list((out / "killed").glob(f"*/*/*{SUFFIX}")))
rerun = subprocess.run(kcmd, capture_output=True, text=True, timeout=300)
from sluice.storage.artifact import open_artifact  # noqa: E402

report["resume"] = {"killed_rc": victim.returncode, "recorded_before": recorded, "rerun_rc": rerun.returncode,
                    "tail": (rerun.stdout + rerun.stderr)[-1500:],
                    "same": rerun.returncode == 0 and [f.sha256 for f in open_artifact(out / "killed").manifest.files()]
                    == sums(shard_dataset(ing.model_copy(update={"limit": 600}), out / "pool-50",
                                         cfg.model_copy(update={"shard_samples": 50, "workers": 2})))}

# the nightly flow's preparation through the front door, on the cluster (Prefect's temporary API on loopback)
night = subprocess.run([sys.executable, "-m", "sluice.flows.cli", "run", "prepare", "--data-root", str(out / "night"),
                        "--set", "data.source=fashion-mnist", "--set", f"data.ingest.limit={limit}",
                        "--set", "data.shard.progress=false", "--set", "engine.name=ray",
                        "--set", f"engine.address={cluster.address}"],
                       capture_output=True, text=True, timeout=300)
report["prepare_rc"], report["prepare_tail"] = night.returncode, (night.stdout + night.stderr)[-3000:]
report["prepare_engine"] = [line for line in (night.stdout + night.stderr).splitlines() if "engine ray" in line]
# IL scoring (RHO-LOSS's irreducible-loss model) on the cluster: the model trained here, its
# scoring pass as Ray parts (one scoring batch a part here, so there are many); the same losses
import numpy as np  # noqa: E402

from sluice.stages.load import split_arrays  # noqa: E402
from sluice.stages.select import il_parts  # noqa: E402
from sluice.stages.select.config import ILModelConfig  # noqa: E402
from sluice.stages.select.il_model import fit_and_score, score_with  # noqa: E402

il_parts.PART_BATCHES = 1
ilcfg = ILModelConfig(epochs=1, batch_size=32, model_kwargs={"width": 4}, progress=False, amp="none",
                      score_batch_size=128)
with open_artifact(on_ray.root) as art:
    hx, hy = split_arrays(art, "holdout", live_only=True)
    tx, ty = split_arrays(art, "train")
il_here, il_extra, il_model = fit_and_score(ilcfg, hx, hy, tx, ty, 10)
il_said: list[str] = []
il_there, il_acc = score_with(il_model, ilcfg, tx, ty, 10, score=il_parts.scorer(engine_saying(il_said), ilcfg, 10))
report["il"] = {"same": bool(np.array_equal(il_here, il_there)), "n": int(len(ty)),
                "max_diff": float(np.abs(il_here - il_there).max()), "acc": [il_acc, il_extra["scored_accuracy"]],
                "said": il_said}

# text with a worker node lost mid-stage: a replacement node joins, then a worker node is removed
# once the first part's result is in (the others running or queued on both workers); the parts it
# held run again on the node that is left, and the artifact is the same bytes
from sluice.stages.data.engine import RayParts  # noqa: E402

workers.append(cluster.add_node(node_ip_address="127.0.0.1", num_cpus=1, object_store_memory=100 * MIB))
cluster.wait_for_nodes()
lost_text: dict = {"nodes_before": len([n for n in ray.nodes() if n["Alive"]])}


class LosingANode(RayParts):
    def ordered(self, fn, parts, window=None):
        for n, result in enumerate(super().ordered(fn, parts, window)):
            if n == 0 and "part" not in lost_text:
                cluster.remove_node(workers[-1])
                lost_text["part"] = fn.__name__
            elif "part" in lost_text and lost_text["part"] == fn.__name__:
                lost_text["results_after"] = lost_text.get("results_after", 0) + 1
            yield result


text_parts.PART_DOCS = 30
report["text_node_lost"] = token_sums(shard_text(tcfg, corpus, out / "text-lost", LosingANode(ray, engine, print)))
lost_text["nodes_after"] = len([n for n in ray.nodes() if n["Alive"]])
report["text_lost"] = lost_text
ray.shutdown()
cluster.shutdown()
print("REPORT " + json.dumps(report), flush=True)
