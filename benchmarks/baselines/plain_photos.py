"""A strong plain-PyTorch loop for a folder of photos, in one process, importing nothing from Sluice:
what a competent user writes with torchvision's ``ImageFolder`` + ``RandomResizedCrop``.

torchvision's CPU build cannot be installed on these machines (the only wheel offline is a CUDA
build that fails to import against CPU torch), so its three pieces are written out here as
torchvision does them: ``ImageFolder`` (PIL open, ``convert("RGB")``), ``RandomResizedCrop``
(torchvision's ``get_params``: ten tries of an area in ``scale`` and a log-uniform aspect ratio in
3/4..4/3, else the whole image clamped to the ratio range; the crop resized with PIL's bilinear
filter, as ``resized_crop`` does on PIL images) and ``RandomHorizontalFlip``. Evaluation resizes
the whole image to the square (``Resize((s, s))``), as Sluice's evaluation does; ``--eval-center``
also grades the final weights on ``Resize(s) + CenterCrop(s)``, the other common choice.

The rest is the plain recipe of ``plain_bn_cnn.py``: the same BN CNN as Sluice's ``bn_cnn`` (its
7x7 head average-pooled to from any size), SGD with Nesterov momentum 0.9, weight decay 5e-4 on
weights only, one-cycle (momentum cycling), flip test-time augmentation, bf16 autocast where the
CPU has it (``--amp bf16``), channels-last. Batches come from a ``DataLoader`` with ``--workers``
processes decoding and cropping, persistent across epochs. The test images are decoded once.

The train and test lists (``--lists``, JSON ``{"train": [[path, label], ...], "test": [...]}``)
are the Sluice artifact's own splits, so both sides train and are graded on the same photos.
Prints one JSON line per evaluation with the wall-clock seconds since this process started.

    python -m benchmarks.baselines.plain_photos --lists LISTS.json --epochs 16 --seed 0
        [--size 32] [--scale 0.85 1] [--mean M M M --std S S S] [--workers 2] [--threads 2] [--amp bf16]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time

START = time.time()  # before torch's import: the baseline pays its own start-up

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from PIL import Image  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402


def rrc_params(w: int, h: int, scale: tuple[float, float], ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``: (top, left, height, width)."""
    area = h * w
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * random.uniform(*scale)
        aspect = math.exp(random.uniform(*log_ratio))
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            return random.randint(0, h - ch), random.randint(0, w - cw), ch, cw
    in_ratio = w / h
    if in_ratio < min(ratio):
        cw, ch = w, int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        ch, cw = h, int(round(h * max(ratio)))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


class Photos(Dataset):
    """``ImageFolder``-like: (path, label) pairs; train: random resized crop + flip; eval: resize."""

    def __init__(self, items: list[tuple[str, int]], size: int, train: bool, scale: tuple[float, float],
                 mean: list[float], std: list[float], center: bool = False):
        self.items, self.size, self.train, self.scale, self.center = items, size, train, scale, center
        self.mean = torch.tensor(mean).view(3, 1, 1)
        self.std = torch.tensor(std).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[i]
        with Image.open(path) as im:
            im = im.convert("RGB")
        s = self.size
        if self.train:
            top, left, ch, cw = rrc_params(im.width, im.height, self.scale)
            im = im.resize((s, s), Image.BILINEAR, box=(left, top, left + cw, top + ch))
            if random.random() < 0.5:
                im = im.transpose(Image.FLIP_LEFT_RIGHT)
        elif self.center:  # torchvision's Resize(s) + CenterCrop(s): the short side to s, the long side's ends cut
            w, h = im.size
            nw, nh = (s, max(s, int(s * h / w))) if w <= h else (max(s, int(s * w / h)), s)
            im = im.resize((nw, nh), Image.BILINEAR)
            left, top = int(round((nw - s) / 2)), int(round((nh - s) / 2))
            im = im.crop((left, top, left + s, top + s))
        else:
            im = im.resize((s, s), Image.BILINEAR)
        x = torch.from_numpy(np.asarray(im, np.uint8).copy()).permute(2, 0, 1).float().div_(255)
        return (x - self.mean) / self.std, label


def seed_worker(worker_id: int) -> None:
    """Python's ``random`` per worker, from the seed torch gives each (as torchvision's docs advise)."""
    random.seed(torch.initial_seed() % 2 ** 32)


class BNCNN(nn.Module):
    """Sluice's ``bn_cnn``: conv3x3-BN-ReLU 32, 32, max-pool, 64, 64, max-pool, a 7x7 grid, linear."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10):
        super().__init__()

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
        self.features = nn.Sequential(*block(in_channels, 32), *block(32, 32), nn.MaxPool2d(2),
                                      *block(32, 64), *block(64, 64), nn.MaxPool2d(2))
        self.pool = nn.AdaptiveAvgPool2d(7)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 49, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.head(x if x.shape[-2:] == (7, 7) else self.pool(x))


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, amp: str) -> float:
    model.eval()
    hits = 0
    for i in range(0, len(y), 500):
        xb = x[i:i + 500].contiguous(memory_format=torch.channels_last)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
            logits = (model(xb).float() + model(xb.flip(-1)).float()) / 2
        hits += int((logits.argmax(1) == y[i:i + 500]).sum())
    model.train()
    return hits / len(y)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lists", required=True)
    ap.add_argument("--epochs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--scale", type=float, nargs=2, default=(0.85, 1.0))
    ap.add_argument("--mean", type=float, nargs=3, default=(0.5, 0.5, 0.5))
    ap.add_argument("--std", type=float, nargs=3, default=(0.25, 0.25, 0.25))
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1, help="peak lr (0.2 per 256 samples, as Sluice's recipe)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--amp", choices=["none", "bf16"], default="none")
    ap.add_argument("--eval-center", action="store_true",
                    help="after training, evaluate the test split centre-cropped too (Resize + CenterCrop)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    lists = json.loads(open(args.lists).read())
    train = Photos([tuple(t) for t in lists["train"]], args.size, True, tuple(args.scale), args.mean, args.std)
    test = Photos([tuple(t) for t in lists["test"]], args.size, False, tuple(args.scale), args.mean, args.std)
    tx = torch.stack([test[i][0] for i in range(len(test))])  # decoded once
    ty = torch.tensor([label for _, label in test.items])
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=args.workers,
                        persistent_workers=args.workers > 0, worker_init_fn=seed_worker,
                        generator=torch.Generator().manual_seed(args.seed))
    model = BNCNN(num_classes=int(ty.max()) + 1 if len(ty) else 10).to(memory_format=torch.channels_last)
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": rest, "weight_decay": 0.0}],
                          lr=args.lr, momentum=0.9, nesterov=True)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.25)
    print(json.dumps({"event": "ready", "wall_s": time.time() - START}), flush=True)
    step, samples, train_s = 0, 0, 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        for xb, yb in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp == "bf16"):
                logits = model(xb.contiguous(memory_format=torch.channels_last))
            loss = F.cross_entropy(logits.float(), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            samples += len(yb)
        train_s += time.time() - t0  # the epoch's training, its data waits included, not the evaluation
        acc = evaluate(model, tx, ty, args.amp)
        print(json.dumps({"event": "eval", "epoch": epoch + 1, "step": step, "acc": acc, "samples": samples,
                          "train_s": train_s, "wall_s": time.time() - START}), flush=True)
    if args.eval_center:  # the same weights, the test photos centre-cropped instead of resized whole
        center = Photos(test.items, args.size, False, tuple(args.scale), args.mean, args.std, center=True)
        cx = torch.stack([center[i][0] for i in range(len(center))])
        print(json.dumps({"event": "eval_center", "acc": evaluate(model, cx, ty, args.amp)}), flush=True)
    print(json.dumps({"event": "done", "steps": step, "wall_s": time.time() - START}), flush=True)


if __name__ == "__main__":
    main()
