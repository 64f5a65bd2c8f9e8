"""``launch.engine: ray`` (stages/run/ray_nodes.py) on a real 3-node Ray cluster on this machine
(a 0-CPU head and two 1-CPU worker nodes in a namespace holding only loopback, token
authentication): the same job gives the same losses, evaluations and weights on two Ray nodes as
two torchrun ranks on one machine, and a node removed mid-run costs a restart from the last
checkpoint on the node left, never the run; on nodes that share no file system the checkpoints
live in object storage (a real S3-protocol server) and the run's files come back to the driver."""
from __future__ import annotations

import pytest

from ray_netns import run_in_loopback_namespace
from sluice.errors import ConfigError
from sluice.stages.run.nodes import LaunchConfig

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_in_loopback_namespace("ray_training_run.py", [str(tmp_path_factory.mktemp("raytrain"))], 540)


def test_the_cluster_is_three_nodes_on_loopback(trained):
    assert trained["nodes"] == 3 and trained["address"].startswith("127.0.0.1:")
    assert trained["listening"] and set(trained["listening"]) <= {"127.0.0.1", "[::ffff:127.0.0.1]"}, \
        trained["listening"]


def test_two_ray_nodes_train_the_same_bits_as_two_ranks_on_one_machine(trained):
    s = trained["same"]
    assert s["launch"]["engine"] == "ray" and len(s["launch"]["attempts"]) == 1, s["launch"]
    a = s["launch"]["attempts"][0]
    assert a["ended"] == "done" and a["world_size"] == 2 and len({n["node_id"] for n in a["nodes"]}) == 2, a
    assert s["world"] == 2 and s["steps"] == [24, 24]
    assert s["digests"][0] == s["digests"][1] and len(set(s["digests"][0])) == 1  # every rank, both runs
    assert s["acc"][0] == s["acc"][1] and s["n_evals"] >= 2 and s["evals"]
    assert s["n_losses"] >= 2 and s["losses"]
    assert s["node_lines"] > 0  # the nodes' torchrun output reached the caller's log


def test_a_node_lost_mid_run_costs_a_restart_from_the_last_checkpoint(trained):
    """The node hosting the rendezvous removed once a checkpoint is written: the agents' runs
    are stopped, the ranks start again on the one node left (world size 1), resume from the
    checkpoint, and finish the budget; the summary says what happened."""
    lost = trained["lost"]
    assert lost["checkpoint_before"] and lost.get("removed"), lost
    assert lost["error"] is None, lost
    assert lost["alive_nodes_after"] == 2
    attempts = lost["launch"]["attempts"]
    assert [x["ended"] for x in attempts] == ["lost", "done"], attempts
    assert attempts[0]["world_size"] == 2 and attempts[1]["world_size"] == 1
    assert attempts[1]["nodes"][0]["node_id"] != attempts[0]["nodes"][0]["node_id"]
    assert lost["launch"]["node_losses"] == 1
    assert lost["steps"] == 60 and lost["resumed_from"] is not None and lost["resumed_from"] >= lost["killed_at"]
    assert lost["world"] == 1
    assert any("lost; the ranks restart from the last checkpoint" in line for line in lost["said"]), lost["said"]
    assert not trained["orphans"], trained["orphans"]  # no rank left training after its node went


def test_nodes_sharing_no_file_system_train_the_same_bits_through_object_storage(trained):
    """``launch.ray.storage: s3://...``: each node runs the job from a local directory of its
    own (none under out_dir, all removed after), the checkpoints are written to the bucket, and
    the run is the same bits as on a shared path: losses (streamed back to out_dir's metrics
    file), evaluations, weights; the last checkpoint is copied into out_dir for grading."""
    s3, same = trained["s3"], trained["same"]
    assert s3["ended"] == "done" and s3["world"] == 2 and s3["steps"] == 24, s3
    assert s3["digests"] == same["digests"][1] and s3["acc"] == same["acc"][1]
    assert s3["evals"] and s3["losses"]
    assert s3["storage"].startswith("s3://sluice-test/runs/s3-") and s3["storage"].endswith("/checkpoints")
    assert any(x.endswith("/checkpoints/last.pt") for x in s3["stored"]), s3["stored"]
    assert any(x.endswith("/job.json") for x in s3["stored"]), s3["stored"]
    assert len(set(s3["job_files"])) == 2 and not any(p.startswith(s3["out"]) for p in s3["job_files"]), s3
    assert not s3["node_dirs_left"], s3["node_dirs_left"]
    assert s3["local_checkpoint"].startswith(s3["out"]) and s3["same_checkpoint"]


def test_a_replacement_node_is_waited_for_and_taken(trained):
    """The same removal with a node added right after it, the checkpoints in object storage:
    the restart waits for the new node (``replace_wait_s``), reads the checkpoint from the
    bucket and trains on two nodes again, one of them the new one."""
    rep = trained["replaced"]
    assert rep["launch"]["storage"].startswith("s3://sluice-test/runs/replaced-"), rep["launch"]
    assert rep["removed"] and rep["error"] is None, rep
    attempts = rep["launch"]["attempts"]
    assert [x["ended"] for x in attempts] == ["lost", "done"], attempts
    assert attempts[0]["world_size"] == attempts[1]["world_size"] == 2
    before, after = ({n["node_id"] for n in x["nodes"]} for x in attempts)
    assert len(after) == 2 and len(after - before) == 1  # the survivor and the replacement
    assert rep["steps"] == 60 and rep["resumed_from"] >= rep["killed_at"] and rep["world"] == 2
    assert len(set(rep["digests"])) == 1


def test_the_nightly_flow_trains_on_the_clusters_nodes(trained):
    """``sluice run nightly --set launch.engine=ray --set engine.address=...``: the flow's train
    task places its ranks on two nodes of the cluster; their output and the attempt reach the
    flow's log, and the night's report says where it trained."""
    night = trained["night"]
    assert night["rc"] == 0, night["tail"]
    assert any("2 node(s) x 1 rank(s)" in x for x in night["attempts"]), night["tail"]
    assert night["node_lines"] > 0
    assert "launched on a Ray cluster: attempt 1: 2 ranks on 2 node(s), done" in night["report"], night["report"]


def test_launch_engine_ray_takes_no_node_list():
    with pytest.raises(ValueError, match="places the ranks"):
        LaunchConfig(engine="ray", nodes=[{"address": "10.0.0.1"}, {"address": "10.0.0.2"}])
    assert LaunchConfig.model_validate({"engine": "ray", "ray": {"nodes": 2}}).ray.nodes == 2
    with pytest.raises(ValueError):
        LaunchConfig.model_validate({"engine": "ray", "ray": {"nodes": 0}})


def test_launch_ray_refuses_the_torchrun_engine():
    from sluice.stages.run.ray_nodes import launch_ray
    with pytest.raises(ConfigError, match="launch.engine: ray"):
        launch_ray({}, LaunchConfig())


def test_object_storage_for_the_checkpoints_is_checked_before_anything_is_placed(tmp_path):
    """``launch.ray.storage`` needs out_dir (its key), refuses a local checkpoint_dir the nodes
    could not share, and a storage that takes no write stops the run before Ray is reached."""
    from conftest import npz_specs
    from sluice.stages.run.launch import make_job
    from sluice.stages.run.ray_nodes import launch_ray
    train, test = npz_specs(tmp_path, 64, 32)
    unreachable = {"name": "ray", "address": "127.0.0.1:1"}  # never reached: each call fails first
    with pytest.raises(ConfigError, match="give out_dir"):
        launch_ray(make_job({"max_steps": 1}, train, test), {"ray": {"storage": "memory://x"}}, unreachable)
    with pytest.raises(ConfigError, match="is a local path"):
        launch_ray(make_job({"max_steps": 1, "checkpoint_dir": str(tmp_path / "c")}, train, test),
                   {"ray": {"storage": "memory://x"}}, unreachable, out_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match="cannot write the run's files there.*fsspec package"):
        launch_ray(make_job({"max_steps": 1}, train, test), {"ray": {"storage": "nosuchscheme://bucket"}},
                   unreachable, out_dir=tmp_path / "run")


def test_the_node_agent_hands_back_the_files_the_ranks_write():
    """The agent imports no torch, so it names the rank's result and error files itself."""
    from sluice.stages.run.node_agent import OUTCOME_FILES
    from sluice.stages.train.rank import FATAL, RESULT
    assert set(OUTCOME_FILES) == {RESULT, FATAL}
