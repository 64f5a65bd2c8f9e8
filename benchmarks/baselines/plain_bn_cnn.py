"""A strong plain-PyTorch recipe for Fashion-MNIST, in one process, importing nothing from Sluice.

The BN CNN (conv3×3-BN-ReLU 32, 32, max-pool, 64, 64, max-pool, linear), SGD with Nesterov
momentum 0.9, weight decay 5e-4 on weights (not on BatchNorm or biases), one-cycle to lr 0.2 with
momentum cycling, label smoothing 0.1 (``--label-smoothing``), random horizontal flips, batch 256,
fp32 (``--amp bf16``: bf16 autocast, for CPUs that compute it natively), channels-last, all 60,000
training images decoded once into RAM; ``--tta flip`` evaluates
the mean of each test image's and its mirror image's logits. It evaluates on the 10,000 test images
``--evals-per-epoch`` times an epoch and prints one JSON line per evaluation with the wall-clock
seconds since the process started (data loading, model building and evaluations included):
what a time-to-accuracy comparison charges it.

For a source that grows night after night (``benchmarks/nightly_growth.py``): ``--train-npz``
trains on an ``.npz``'s ``images`` and ``labels`` instead of all 60,000 (and evaluates on its
``test_images`` and ``test_labels`` where it has them, else on the 10,000 test images), ``--init``
starts from weights a run saved (fine-tuning) and ``--save`` saves the final weights
(``torch.save`` of the state dict; read back with ``weights_only=True``).

    python -m benchmarks.baselines.plain_bn_cnn --epochs 6 --seed 0 [--threads 2] [--no-channels-last]
        [--label-smoothing 0.1] [--tta none|flip] [--amp none|bf16]
        [--train-npz PATH] [--init WEIGHTS] [--save WEIGHTS]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import time
from pathlib import Path

START = time.time()  # before torch's import: the baseline pays its own start-up

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

DATA = Path(os.environ.get("SLUICE_FASHION_MNIST") or "/usr/share/datasets/fashion-mnist")
MEAN, STD = 0.2860, 0.3530


def read_idx(path: Path) -> np.ndarray:
    raw = gzip.decompress(path.read_bytes())
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * k:8 + 4 * k], "big") for k in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    prefix = "train" if split == "train" else "t10k"
    x = torch.from_numpy(read_idx(DATA / f"{prefix}-images-idx3-ubyte.gz").copy()).unsqueeze(1)
    y = torch.from_numpy(read_idx(DATA / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64))
    return x, y


def load_npz(path: Path, split: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A split's images (N, H, W) uint8 and labels (N,) from an ``.npz`` (pickles refused):
    ``images``/``labels`` for train, ``test_images``/``test_labels`` for test (None if absent)."""
    prefix = "" if split == "train" else "test_"
    with np.load(path, allow_pickle=False) as z:
        if f"{prefix}images" not in z.files:
            return None
        x, y = z[f"{prefix}images"], z[f"{prefix}labels"]
    return torch.from_numpy(np.ascontiguousarray(x)).unsqueeze(1), torch.from_numpy(y.astype(np.int64))


def bn_cnn(num_classes: int = 10) -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
    return nn.Sequential(*block(1, 32), *block(32, 32), nn.MaxPool2d(2), *block(32, 64), *block(64, 64),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 7 * 7, num_classes))


def prepare(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    x = x.float().div_(255).sub_(MEAN).div_(STD)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


DEVICE = "cpu"  # --device


def autocast(amp: str) -> torch.autocast:
    return torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16, enabled=amp == "bf16")


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, channels_last: bool, tta: str = "none",
             amp: str = "none") -> float:
    model.eval()
    hits = 0
    for i in range(0, len(y), 1000):
        xb = prepare(x[i:i + 1000], channels_last)
        with autocast(amp):
            logits = model(xb).float()
            if tta == "flip":
                logits = (logits + model(xb.flip(-1)).float()) / 2
        hits += int((logits.argmax(1) == y[i:i + 1000]).sum())
    model.train()
    return hits / len(y)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=float, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--evals-per-epoch", type=float, default=1.0)
    ap.add_argument("--no-channels-last", dest="channels_last", action="store_false")
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--tta", choices=["none", "flip"], default="none")
    ap.add_argument("--amp", choices=["none", "bf16"], default="none",
                    help="bf16 autocast for forward passes (pays only where the CPU has native bf16)")
    ap.add_argument("--max-steps", type=int, default=None, help="stop early (thread/layout probes)")
    ap.add_argument("--device", default="cpu", help="cuda: data, model and flips on the GPU (benchmarks.gpu)")
    ap.add_argument("--train-npz", type=Path, default=None,
                    help="train on this .npz's images and labels instead of all 60,000 training images "
                         "(and evaluate on its test_images and test_labels, where it has them)")
    ap.add_argument("--init", type=Path, default=None, help="start from these saved weights (fine-tune)")
    ap.add_argument("--save", type=Path, default=None, help="save the final weights here (state dict)")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    x, y = load("train") if args.train_npz is None else load_npz(args.train_npz, "train")
    tx, ty = (args.train_npz and load_npz(args.train_npz, "test")) or load("test")
    x, y, tx, ty = (t.to(args.device) for t in (x, y, tx, ty))  # all of it, once
    model = bn_cnn().to(args.device)
    if args.init is not None:
        model.load_state_dict(torch.load(args.init, map_location=args.device, weights_only=True))
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": rest, "weight_decay": 0.0}],
                          lr=args.lr, momentum=0.9, nesterov=True)
    steps_per_epoch = len(y) // args.batch_size
    total = max(1, int(round(args.epochs * steps_per_epoch)))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total)  # cycles momentum
    eval_every = max(1, int(round(steps_per_epoch / args.evals_per_epoch)))
    gen = torch.Generator().manual_seed(args.seed)
    step, t_steps = 0, 0.0
    print(json.dumps({"event": "ready", "wall_s": time.time() - START}), flush=True)
    while step < total:
        perm = torch.randperm(len(y), generator=gen)
        for b in range(steps_per_epoch):
            if step >= total or (args.max_steps and step >= args.max_steps):
                break
            t0 = time.perf_counter()
            idx = perm[b * args.batch_size:(b + 1) * args.batch_size]
            xb = x[idx]
            flip = (torch.rand(len(idx), generator=gen) < 0.5).to(xb.device)
            xb = torch.where(flip.view(-1, 1, 1, 1), xb.flip(-1), xb)
            with autocast(args.amp):
                logits = model(prepare(xb, args.channels_last))
            loss = F.cross_entropy(logits.float(), y[idx], label_smoothing=args.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            t_steps += time.perf_counter() - t0
            if step % eval_every == 0 or step == total:
                acc = evaluate(model, tx, ty, args.channels_last, args.tta, args.amp)
                print(json.dumps({"event": "eval", "step": step, "epoch": step / steps_per_epoch, "acc": acc,
                                  "time": time.time(), "wall_s": time.time() - START, "train_s": t_steps}),
                      flush=True)
        if args.max_steps and step >= args.max_steps:
            break
    if args.save is not None:
        tmp = args.save.with_name(f".{args.save.name}.tmp")
        torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, tmp)
        os.replace(tmp, args.save)  # never a half-written file under the name
    print(json.dumps({"event": "done", "steps": step, "time": time.time(), "wall_s": time.time() - START,
                      "step_s": t_steps / max(step, 1)}), flush=True)


if __name__ == "__main__":
    main()
