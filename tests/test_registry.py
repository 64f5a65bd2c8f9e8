"""Registry: immutable records; the champion moves only for a better model on the same split."""
from __future__ import annotations

import threading

import pytest

from sluice.storage.registry import Candidate, Registry, RegistryError


def _ckpt(tmp_path, name="c.pt", data=b"weights"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _reg(reg, tmp_path, value, split="fp/test", fp="fp"):
    return reg.register(Candidate(_ckpt(tmp_path), dataset_fingerprint=fp, eval_split=split, metric="test_acc", value=value,
                                  config={"lr": 0.1}))


def test_first_model_becomes_champion_and_records_are_immutable(tmp_path):
    reg = Registry(tmp_path / "reg")
    a = _reg(reg, tmp_path, 0.80)
    d = reg.promote_if_better(a)
    assert d.promoted and d.reason == "no champion yet"
    assert reg.champion().model_id == a.model_id
    assert reg.checkpoint_path(a).read_bytes() == b"weights"
    assert reg.get(a.model_id) == a


def test_only_a_better_model_by_the_margin_moves_the_pointer(tmp_path):
    reg = Registry(tmp_path / "reg")
    a = _reg(reg, tmp_path, 0.80)
    reg.promote_if_better(a)
    worse = _reg(reg, tmp_path, 0.79)
    assert not reg.promote_if_better(worse).promoted
    slightly = _reg(reg, tmp_path, 0.804)
    assert not reg.promote_if_better(slightly, margin=0.005).promoted
    better = _reg(reg, tmp_path, 0.81)
    d = reg.promote_if_better(better, margin=0.005)
    assert d.promoted and d.champion_before == a.model_id
    assert reg.champion().model_id == better.model_id
    assert [h["model_id"] for h in reg.history()] == [a.model_id, better.model_id]
    assert len(reg.list()) == 4
    assert "* " + better.model_id in reg.format_list()


def test_different_eval_split_needs_reevaluation(tmp_path):
    reg = Registry(tmp_path / "reg")
    reg.promote_if_better(_reg(reg, tmp_path, 0.9, split="old/test", fp="old"))
    cand = _reg(reg, tmp_path, 0.85, split="new/test", fp="new")
    with pytest.raises(RegistryError, match="re-evaluate the champion"):
        reg.promote_if_better(cand)
    assert reg.promote_if_better(cand, champion_value_now=0.84).promoted


def test_bad_candidates_are_refused(tmp_path):
    reg = Registry(tmp_path / "reg")
    with pytest.raises(RegistryError, match="nan"):
        reg.register(Candidate(_ckpt(tmp_path), dataset_fingerprint="f", eval_split="f/test", metric="test_acc",
                               value=float("nan")))
    with pytest.raises(RegistryError, match="checkpoint not found"):
        reg.register(Candidate(tmp_path / "missing.pt", dataset_fingerprint="f", eval_split="f/test", metric="test_acc",
                               value=0.5))
    assert reg.list() == [] and reg.champion() is None


def test_concurrent_promotions_keep_the_best(tmp_path):
    reg = Registry(tmp_path / "reg")
    cands = [_reg(reg, tmp_path, v) for v in (0.70, 0.90, 0.80, 0.85, 0.60)]
    threads = [threading.Thread(target=reg.promote_if_better, args=(c,)) for c in cands]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reg.champion().value == 0.90
