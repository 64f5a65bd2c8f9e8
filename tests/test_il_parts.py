"""The IL model's scoring pass in parts (stages/select/il_parts.py): runs of whole scoring
batches, the model rebuilt from its weights in the part's process, give the very losses and
accuracy one process computes (here in this process; on a Ray cluster in tests/test_ray_engine.py),
and the nightly IL task's carry path scores through them too."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.stages.data.engine import LocalParts
from sluice.stages.select import il_parts
from sluice.stages.select.config import ILModelConfig
from sluice.stages.select.il_model import fit_and_score, score_with

CFG = ILModelConfig(epochs=1, batch_size=16, model_kwargs={"width": 4}, progress=False, amp="none",
                    score_batch_size=32)


class Counting(LocalParts):
    """This process's parts, counting them and what each held."""
    def __init__(self):
        self.sizes: list[int] = []

    def ordered(self, fn, parts, window=None, gpus=0):
        for p in parts:
            self.sizes.append(len(p[5]))
            yield fn(p)


def _data(n: int, seed: int):
    g = np.random.default_rng(seed)
    y = g.integers(0, 4, n)
    x = (g.integers(0, 60, (n, 12, 12)) + 40 * y[:, None, None]).astype(np.uint8)
    return x, y


@pytest.mark.parametrize("per", [1, 3])
def test_scoring_in_parts_gives_the_losses_one_process_gives(monkeypatch, per):
    monkeypatch.setattr(il_parts, "PART_BATCHES", per)
    hx, hy = _data(200, 0)
    tx, ty = _data(301, 1)  # not a multiple of the batch: the last part is short
    torch.manual_seed(0)
    here, extra, model = fit_and_score(CFG, hx, hy, tx, ty, 4)
    parts = Counting()
    again, acc = score_with(model, CFG, tx, ty, 4, score=il_parts.scorer(parts, CFG, 4))
    assert np.array_equal(again, here) and acc == extra["scored_accuracy"]
    assert sum(parts.sizes) == 301 and len(parts.sizes) == -(-301 // (per * 32))
    assert max(parts.sizes) == per * 32


def test_a_part_rebuilds_the_model_from_its_weights_alone():
    """What crosses to a part is plain data: the weights as torch.save tensors (loaded
    weights_only), the config's JSON, the images; no pickled module."""
    from sluice.stages.select.il_store import model_bytes
    hx, hy = _data(64, 2)
    _, _, model = fit_and_score(CFG, hx, hy, hx, hy, 4)
    x = torch.randn(8, 1, 12, 12)
    y = torch.zeros(8, dtype=torch.long)
    values, hits = il_parts.score_part((model_bytes(model), CFG.model_dump_json(), 1, 4, x, y))
    want = torch.nn.functional.cross_entropy(model.eval()(x), y, reduction="none").detach().numpy()
    assert np.allclose(values, want, atol=1e-6) and 0 <= hits <= 8
