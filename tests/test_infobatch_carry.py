"""InfoBatch's table carried by key into a warm run: the champion's per-sample
losses and seen flags reach tonight's index for unchanged samples, bit for bit; new, changed and
relabelled samples start unseen; the selector built from the job starts from the table and a
resumed run's own checkpoint replaces it; a checkpoint without an InfoBatch table carries nothing
and the plan says why."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from sluice.errors import SelectionError
from sluice.stages.data.config import IngestConfig, ShardConfig
from sluice.stages.data.shard import shard_dataset
from sluice.stages.select import build_selector
from sluice.stages.select.config import SelectionConfig
from sluice.stages.select.infobatch import InfoBatchSelector
from sluice.stages.select.infobatch_carry import load_table
from sluice.stages.select.spec import SelectionSpec
from sluice.stages.train.config import TrainConfig
from sluice.stages.train.job import TrainJob
from warm_plans import job as assembled, plan as planned
from sluice.stages.run.warm import Start, WarmStartConfig
from sluice.storage.artifact import open_artifact
from sluice.storage.checkpoint import save_checkpoint
from sluice.storage.lineage import split_key_hashes
from sluice.storage.registry import Candidate, Registry

CFG = ShardConfig(workers=1, progress=False, shard_samples=200, formats=["webdataset"])
IB = SelectionConfig(method="infobatch", params={"prune": 0.5, "sync_every": 1000})
WARM = WarmStartConfig(init="champion", replay_ratio=1.0)


def _shard(d, out, x, y, keys) -> str:
    src = d / "src.npz"
    np.savez(src, images=x[keys], labels=y[keys], keys=np.array([f"s{k}" for k in keys]))
    return shard_dataset(IngestConfig(source=str(src)), out, CFG).root


def _art(root) -> tuple[list[str], np.ndarray, str]:
    with open_artifact(root) as a:
        return a.keys("train"), a.live("train"), a.fingerprint


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """v0: s0..s399. v1: s400..s499 added; of v0's train samples one deleted, one given new
    pixels (removed at its index, appended again), one relabelled."""
    d = tmp_path_factory.mktemp("ibcarry")
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 256, (500, 8, 8, 1), dtype=np.uint8), rng.integers(0, 10, 500)
    out = d / "out"
    v0 = _shard(d, out, x, y, list(range(400)))
    deleted, changed, relabelled = (int(k[1:]) for k in _art(v0)[0][:3])
    x[changed] = 255 - x[changed]
    y[relabelled] = (y[relabelled] + 1) % 10
    v1 = _shard(d, out, x, y, [k for k in range(500) if k != deleted])
    return {"v0": v0, "v1": v1, "deleted": f"s{deleted}", "touched": {f"s{changed}", f"s{relabelled}"}}


def _rank_states(n: int) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """Two ranks' selector states as the trainer checkpoints them (identical gathered tables, each
    rank's own pending observations), and the table a final all-gather would have made of them."""
    rng = np.random.default_rng(2)
    base = InfoBatchSelector(IB, _ctx(n))
    trained = np.union1d(np.flatnonzero(rng.random(n) < 0.7), [0, 1, 2])  # the deleted, changed, relabelled
    base.observe(torch.as_tensor(trained), torch.as_tensor(rng.gamma(2.0, 0.5, trained.size), dtype=torch.float32))
    base.flush()
    states, final = [], InfoBatchSelector(IB, _ctx(n))
    final.load_state_dict(base.state_dict())
    for r in range(2):
        sel = InfoBatchSelector(IB, _ctx(n))
        sel.load_state_dict(base.state_dict())
        idx = torch.as_tensor(rng.choice(n, 20, replace=False))
        val = torch.as_tensor(rng.gamma(2.0, 0.5, 20), dtype=torch.float32)
        sel.observe(idx, val)  # pending: sync_every is far off
        final.observe(idx, val)
        states.append({"rng": {}, "loader": {}, "comm": {}, "selector": sel.state_dict()})
    final.flush()  # one process: the gather is rank 0's pending then rank 1's, as under DDP
    return states, final.loss.numpy().copy(), final.seen.numpy().copy()


def _ctx(n: int):
    from sluice.stages.select.base import SelectorContext
    return SelectorContext(split_size=n)


def _champion(reg: Registry, root: str, path, ranks: list | None) -> None:
    cfg = TrainConfig(model="small_cnn")
    state = {"config": cfg.model_dump(mode="json"), "compat": {"model": "small_cnn"}}
    if ranks is not None:
        state["ranks"] = ranks
    ckpt = save_checkpoint(path, state)
    fp = _art(root)[2]
    rec = reg.register(Candidate(ckpt, dataset_fingerprint=fp, eval_split=f"{fp[:16]}/val", metric="acc", value=0.5,
                                 trained_on=(fp, ["train"], split_key_hashes(root, ["train"]))))
    assert reg.promote_if_better(rec).promoted


def _job(root: str, sel: SelectionConfig | None = IB, start: Start | None = None) -> TrainJob:
    return assembled(root, sel or SelectionConfig(method="none"), start)


@pytest.fixture(scope="module")
def carried(versions, tmp_path_factory):
    d = tmp_path_factory.mktemp("ibplan")
    n0 = len(_art(versions["v0"])[0])
    ranks, loss, seen = _rank_states(n0)
    reg = Registry(d / "reg")
    _champion(reg, versions["v0"], d / "c.pt", ranks)
    start = planned(WARM, reg, versions["v1"], d / "run", IB)
    plan, why = start.plan, start.why
    assert plan is not None, why
    return {"plan": plan, "loss": loss, "seen": seen, "ranks": ranks}


def test_unchanged_samples_carry_their_loss_and_seen_flag_bit_for_bit(versions, carried):
    plan = carried["plan"]
    assert plan.selector_state and "starts from the champion's table" in plan.selector_why
    summary = Start(plan=plan, why="x").summary()
    assert summary["selector_state"] == plan.selector_state and summary["selector_rows_carried"] > 0
    k0, live0, _ = _art(versions["v0"])
    k1, live1, fp1 = _art(versions["v1"])
    at0 = {k0[i]: int(i) for i in live0}
    table = np.load(plan.selector_state, allow_pickle=False)
    loss, seen = table["loss"], table["seen"]
    assert str(table["fingerprint"]) == fp1 and loss.shape == seen.shape == (len(k1),)
    assert loss.dtype == np.float32 and seen.dtype == bool
    same = [int(i) for i in live1 if k1[i] in at0 and k1[i] not in versions["touched"]]
    src = [at0[k1[i]] for i in same]
    assert plan.selector_rows_carried == len(same) > 250
    # bit for bit: the champion's final table (pending observations gathered) at the new index
    assert np.array_equal(loss[same].view(np.uint32), carried["loss"][src].view(np.uint32))
    assert np.array_equal(seen[same], carried["seen"][src])
    assert carried["seen"][src].sum() > 150 and (~carried["seen"][src]).sum() > 50  # both kinds carried
    rest = np.setdiff1d(np.arange(len(k1)), same)  # new, changed, relabelled, deleted
    assert not seen[rest].any() and not loss[rest].any()
    for k in versions["touched"]:  # learnt by the champion under other pixels or another label
        assert carried["seen"][at0[k]] and not any(seen[i] for i in range(len(k1)) if k1[i] == k)
    new = [i for i in range(len(k1)) if int(k1[i][1:]) >= 400]
    assert len(new) > 50 and not seen[new].any()


def test_the_warm_jobs_selector_starts_from_the_table_and_prunes_on_its_first_call(versions, carried):
    plan = carried["plan"]
    job = _job(versions["v1"], start=Start(plan=plan, why="warm"))
    assert job.selection.carried_table == plan.selector_state
    job = TrainJob.model_validate_json(job.model_dump_json())  # as a worker reads job.json
    sel = job.selection.build()
    table = np.load(plan.selector_state)
    assert np.array_equal(sel.loss.numpy(), table["loss"]) and np.array_equal(sel.seen.numpy(), table["seen"])
    seen = table["seen"]
    mean = float(table["loss"][seen].mean())
    assert sel._mean == pytest.approx(mean)
    below = np.flatnonzero(seen & (table["loss"] < mean))[:64]
    x, y = torch.zeros(64, 1, 8, 8), torch.zeros(64, dtype=torch.int64)
    out = sel(None, x, y, torch.as_tensor(below))
    assert out.stats["ib_eligible"] == 64 and out.stats["ib_pruned"] > 0 and out.inputs.shape[0] < 64
    unseen = np.flatnonzero(~seen)[:64]  # new, changed, relabelled: never pruned
    assert sel(None, x, y, torch.as_tensor(unseen)).stats["ib_pruned"] == 0
    fresh = _job(versions["v1"]).selection.build()  # the same job cold: nothing known, nothing pruned
    assert fresh(None, x, y, torch.as_tensor(below)).stats["ib_pruned"] == 0


def test_a_resumed_run_restores_its_own_table_over_the_carried_one(versions, carried):
    job = _job(versions["v1"], start=Start(plan=carried["plan"], why="warm"))
    n = job.selection.split_size
    own = InfoBatchSelector(IB, _ctx(n))
    own.observe(torch.arange(0, n, 3), torch.full((len(range(0, n, 3)),), 0.25))
    own.flush()
    sel = job.selection.build()
    assert not torch.equal(sel.seen, own.seen)
    sel.load_state_dict(own.state_dict())  # what the loop's maybe_resume does after building it
    assert torch.equal(sel.loss, own.loss) and torch.equal(sel.seen, own.seen)


@pytest.mark.parametrize("kind", ["none", "no_selector", "other_method", "other_size", "tonight_uniform"])
def test_no_infobatch_table_carries_nothing_and_says_why(versions, tmp_path, kind):
    n0 = len(_art(versions["v0"])[0])
    rank = {"rng": {}, "loader": {}, "comm": {}}
    ranks = {"none": None, "no_selector": [{**rank, "selector": None}],
             "other_method": [{**rank, "selector": {"generator": torch.Generator().get_state(),
                                                    "history": torch.zeros(8)}}],
             "other_size": [{**rank, "selector": InfoBatchSelector(IB, _ctx(n0 + 7)).state_dict()}],
             "tonight_uniform": _rank_states(n0)[0]}[kind]
    reg = Registry(tmp_path / "reg")
    _champion(reg, versions["v0"], tmp_path / "c.pt", ranks)
    sel = SelectionConfig(method="uniform") if kind == "tonight_uniform" else IB
    start = planned(WARM, reg, versions["v1"], tmp_path / "run", sel)
    plan, why = start.plan, start.why
    assert plan is not None, why
    assert plan.selector_state is None and plan.selector_rows_carried == 0
    expect = {"none": "no per-rank training state", "no_selector": "without a selection method",
              "other_method": "another method's", "other_size": f"holds {n0 + 7} rows",
              "tonight_uniform": "selection method is uniform"}[kind]
    assert expect in plan.selector_why, plan.selector_why
    assert not (tmp_path / "run" / "infobatch_carried.npz").exists()
    assert _job(versions["v1"], sel, start).selection.carried_table is None


def test_a_carried_table_is_checked_where_it_is_used(versions, carried):
    spec = _job(versions["v1"]).selection
    with pytest.raises(ValidationError, match="keeps no per-sample table"):
        SelectionSpec(config=SelectionConfig(method="uniform"), candidate_size=64, split_size=spec.split_size,
                      carried_table=carried["plan"].selector_state)
    with pytest.raises(SelectionError, match="is for dataset version"):
        load_table(carried["plan"].selector_state, spec.split_size, "0" * 64)
    with pytest.raises(SelectionError, match="split has"):
        load_table(carried["plan"].selector_state, spec.split_size + 1, None)
    table = load_table(carried["plan"].selector_state, spec.split_size, spec.fingerprint)
    with pytest.raises(SelectionError, match="keeps no per-sample table"):
        build_selector(SelectionConfig(method="uniform"), split_size=spec.split_size, carried=table)
