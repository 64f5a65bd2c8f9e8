"""Every built-in image model takes any input size from its ``min_size`` up (issue #48): square or
not, 1 or 3 channels, any number of classes; below ``min_size`` a clear error. ``bn_cnn`` at
28×28 stays the plain architecture it was (same outputs, gradients, steps and checkpoints)."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from sluice.stages.models import MODELS, BNCNN, build_model, min_input_size, model_task

IMAGE_MODELS = [n for n in MODELS.names()
                if MODELS.get(n).__module__.startswith("sluice.stages.models.")
                and model_task(n) != "language_model"]
SIZES = ["min", 28, (61, 97), 128, 160]
CLASSES = 7


def _small(name: str, **kw) -> dict:
    """A narrow build (``width=4`` where the factory takes one): the shapes, not the capacity, matter."""
    factory = MODELS.get(name)
    params = inspect.signature(factory).parameters
    return {"width": 4, **kw} if "width" in params else kw


def _side(name: str, size) -> tuple[int, int]:
    if size == "min":
        return (min_input_size(name),) * 2
    return size if isinstance(size, tuple) else (size, size)


def test_the_registry_holds_the_image_models():
    assert {"bn_cnn", "small_cnn", "resnet_small"} <= set(IMAGE_MODELS)
    assert "gpt" not in IMAGE_MODELS


def test_min_input_size():
    assert {n: min_input_size(n) for n in ("bn_cnn", "small_cnn", "resnet_small")} == \
        {"bn_cnn": 4, "small_cnn": 4, "resnet_small": 5}
    assert min_input_size("gpt") is None  # a language model has no image side
    for name in IMAGE_MODELS:
        assert min_input_size(name) == MODELS.get(name).min_size


@pytest.mark.parametrize("size", SIZES, ids=str)
@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_forward_backward_at_any_size(name, channels, size):
    torch.manual_seed(0)
    h, w = _side(name, size)
    variants = [{}, {"hidden": 16}] if name == "small_cnn" else [{}]
    for extra in variants:
        model = build_model(name, in_channels=channels, num_classes=CLASSES, **_small(name, **extra)).train()
        out = model(torch.randn(2, channels, h, w))
        assert out.shape == (2, CLASSES)
        out.square().sum().backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert any(g.abs().sum() > 0 for g in grads)
        model.eval()
        with torch.no_grad():
            assert model(torch.randn(3, channels, h, w)).shape == (3, CLASSES)


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_min_size_trains_on_a_single_image(name):
    """``min_size`` is the smallest side that trains on any batch: one image, BatchNorm and all."""
    s = min_input_size(name)
    model = build_model(name, in_channels=3, num_classes=CLASSES, **_small(name)).train()
    model(torch.randn(1, 3, s, s)).sum().backward()


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_below_min_size_is_a_clear_error(name):
    s = min_input_size(name)
    model = build_model(name, in_channels=1, num_classes=CLASSES, **_small(name))
    for h, w in [(s - 1, s - 1), (s - 1, 28), (28, s - 1)]:
        with pytest.raises(ValueError, match=rf"{name}.*at least {s}×{s} px; got {h}×{w}"):
            model(torch.randn(2, 1, h, w))


class _OldBNCNN(nn.Module):
    """bn_cnn as it was before it took any size: the 7×7 map flattened straight into the linear
    layer (built from plain layers here, so that nothing in the registry can change it)."""

    def __init__(self, in_channels: int, num_classes: int, width: int):
        super().__init__()
        w = width

        def cbr(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))
        self.features = nn.Sequential(cbr(in_channels, w), cbr(w, w), nn.MaxPool2d(2),
                                      cbr(w, 2 * w), cbr(2 * w, 2 * w), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * w * 7 * 7, num_classes))

    def forward(self, x):
        return self.head(self.features(x))


@pytest.mark.parametrize("channels_last", [False, True])
def test_bn_cnn_at_28_is_the_old_architecture(channels_last):
    torch.manual_seed(1)
    old = _OldBNCNN(3, CLASSES, width=8)
    new = BNCNN(in_channels=3, num_classes=CLASSES, width=8)
    assert list(new.state_dict()) == list(old.state_dict())
    new.load_state_dict(old.state_dict(), strict=True)  # an old checkpoint loads as it is
    old.load_state_dict(new.state_dict(), strict=True)  # and the other way round
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    old, new = old.to(memory_format=fmt), new.to(memory_format=fmt)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (old, new)]
    for step in range(3):  # training steps: outputs, gradients and weights stay bit-identical
        x = torch.randn(8, 3, 28, 28).contiguous(memory_format=fmt)
        y = torch.randint(0, CLASSES, (8,))
        outs = []
        for model, opt in zip((old, new), opts):
            opt.zero_grad()
            out = model.train()(x)
            nn.functional.cross_entropy(out, y).backward()
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), step
        for (k, a), b in zip(old.named_parameters(), new.parameters()):
            assert torch.equal(a.grad, b.grad), (step, k)
        for opt in opts:
            opt.step()
    for a, b in zip(old.state_dict().values(), new.state_dict().values()):
        assert torch.equal(a, b)
    x = torch.randn(4, 3, 28, 28).contiguous(memory_format=fmt)
    with torch.no_grad():
        assert torch.equal(old.eval()(x), new.eval()(x))


def test_bn_cnn_elsewhere_pools_to_the_heads_grid():
    """Away from 28 px the feature map is average-pooled to the head's 7×7 grid; ``size`` moves
    the grid (its own size then goes straight to the head)."""
    torch.manual_seed(2)
    model = BNCNN(in_channels=1, num_classes=CLASSES, width=4).eval()
    x = torch.randn(2, 1, 64, 48)
    with torch.no_grad():
        pooled = nn.functional.adaptive_avg_pool2d(model.features(x), 7)
        assert torch.equal(model(x), model.head(pooled))
    big = BNCNN(in_channels=1, num_classes=CLASSES, width=4, size=64)
    assert big.head[1].in_features == 8 * 16 * 16
    assert big(torch.randn(2, 1, 64, 64)).shape == big(torch.randn(2, 1, 30, 90)).shape == (2, CLASSES)
    with pytest.raises(ValueError, match="size must be at least 4"):
        BNCNN(size=3)
