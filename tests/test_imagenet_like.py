"""The ImageNet-like benchmark dataset (benchmarks/imagenet_like.py) and the GPU loader benchmark's
CPU mode (benchmarks/gpu_loader.py): deterministic and prefix-stable images with the documented
sizes, classes and quality, written atomically; sharded into every format at their own sizes;
the benchmark's pieces (its goals, one training window, the CPU mode end to end) on a tiny n."""
from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from benchmarks import imagenet_like as il


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.glob("*/*.jpg"))}


def test_the_photos_come_with_the_repo_and_the_generator_needs_no_sklearn():
    paths = il.photo_paths()
    assert [p.parent for p in paths] == [il.DATA, il.DATA] and [p.name for p in paths] == list(il.PHOTOS)
    # the module imports neither scikit-learn nor anything beyond PIL and NumPy to make an image
    code = ("import sys; sys.modules['sklearn'] = None; from benchmarks.imagenet_like import make_image; "
            "c, im = make_image(0, 3); print(c, im.size)")
    r = subprocess.run([sys.executable, "-c", code], cwd=il.HERE.parent, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_images_are_deterministic_and_any_n_is_a_prefix_of_a_larger_one(tmp_path):
    small = il.make_imagenet_like(6, tmp_path / "small", workers=1, progress=False)
    large = il.make_imagenet_like(10, tmp_path / "large", workers=2, progress=False)
    a, b = _files(small), _files(large)
    assert len(a) == 6 and len(b) == 10
    assert all(b[name] == data for name, data in a.items())  # the same bytes, by one process or two
    other = il.make_imagenet_like(6, tmp_path / "seed1", seed=1, workers=1, progress=False)
    assert _files(other) != a  # the seed matters
    # a class folder per class (1,000), sample i in class i % 1000
    assert len([d for d in small.iterdir() if d.is_dir()]) == il.CLASSES == 1000
    for p in small.glob("*/*.jpg"):
        assert p.parent.name == il.class_name(int(p.stem) % 1000)


def test_sizes_quality_and_recorded_stats_are_as_documented(tmp_path):
    from PIL import Image
    # the size distribution: the table's sizes at their shares, a spread for the rest, mean near 500×375
    rng = np.random.default_rng(0)
    sizes = [il.draw_size(rng) for _ in range(20_000)]
    table = {(w, h): p for w, h, p in il.SIZE_TABLE}
    for wh, p in table.items():
        assert abs(sum(s == wh for s in sizes) / len(sizes) - p) < 0.015, wh
    spread = [s for s in sizes if s not in table]
    assert abs(len(spread) / len(sizes) - (1 - sum(table.values()))) < 0.015
    assert all(64 <= min(s) and max(s) <= il.SPREAD_LONG_SIDE[1] for s in spread)
    mean_pixels = np.mean([w * h for w, h in sizes])
    assert 0.9 * 500 * 375 < mean_pixels < 1.1 * 500 * 375
    # the files: JPEG quality 90 (the bytes are PIL's at that quality), RGB at the drawn size
    root = il.make_imagenet_like(8, tmp_path / "q", workers=1, progress=False)
    for i in range(8):
        c, im = il.make_image(0, i)
        path = root / il.class_name(c) / f"{i:08d}.jpg"
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=90)
        assert path.read_bytes() == buf.getvalue()
        with Image.open(path) as f:
            drawn = il.draw_size(np.random.default_rng([0, i, il.VERSION]))
            assert f.format == "JPEG" and f.mode == "RGB" and f.size == drawn
    st = il.stats(root)
    on_disk = [p.stat().st_size for p in root.glob("*/*.jpg")]
    assert st["n"] == 8 and st["quality"] == 90 and st["total_bytes"] == sum(on_disk)
    assert st["mean_bytes"] == pytest.approx(np.mean(on_disk))
    assert 60e3 < st["mean_bytes"] < 170e3  # ~110 KB on average; 8 images vary
    assert "KB" in il.describe(root)


def test_written_atomically_and_a_partial_folder_is_never_reused(tmp_path):
    root = tmp_path / "ds"
    # a half-written folder (no .complete) and a dead run's temporary folder, both with junk
    (root / il.class_name(0)).mkdir(parents=True)
    (root / il.class_name(0) / "00000000.jpg").write_bytes(b"not a jpeg")
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = tmp_path / f"ds.tmp-{dead.pid}"
    (leftover / "c0000").mkdir(parents=True)
    (leftover / "c0000" / "00000001.jpg").write_bytes(b"junk")
    got = il.make_imagenet_like(3, root, workers=1, progress=False)
    assert got == root and (root / ".complete").exists() and not leftover.exists()
    files = _files(root)
    assert len(files) == 3 and b"not a jpeg" not in files.values()
    assert not list(tmp_path.glob("ds.tmp-*"))  # its own temporary folder was renamed into place
    # complete: reused as it is (nothing rewritten)
    mtime = (root / ".complete").stat().st_mtime_ns
    assert il.make_imagenet_like(3, root, workers=1, progress=False) == root
    assert (root / ".complete").stat().st_mtime_ns == mtime


def test_sharded_into_every_format_at_their_own_sizes(tmp_path):
    from sluice.storage.artifact import open_artifact
    folder = il.make_imagenet_like(12, tmp_path / "ds", workers=2, progress=False)
    formats = ["webdataset", "dali"] + (["ffcv"] if importlib.util.find_spec("ffcv") else [])
    root = il.shard_imagenet_like(folder, tmp_path / "art", formats=formats, workers=2)
    art = open_artifact(root)
    m = art.manifest
    assert m.splits["train"].count == 12 and sorted(m.formats) == sorted(formats)
    assert m.fields.image.encoding == "jpg" and m.fields.image.shape is None  # variable sizes
    assert m.fields.label.num_classes == 1000
    names = {p.suffix for p in Path(root).rglob("*") if p.is_file()}
    assert ".tar" in names and ".idx" in names and (".beton" in names or "ffcv" not in formats)
    # the JPEG bytes go into the tar shards as they are: each image keeps its own size
    source = {hash(b) for b in _files(folder).values()}
    stored = []
    for tar in sorted(Path(root).rglob("*.tar")):
        with tarfile.open(tar) as t:
            stored += [t.extractfile(mem).read() for mem in t.getmembers() if mem.name.endswith(".jpg")]
    assert len(stored) == 12 and {hash(b) for b in stored} == source
    from PIL import Image
    assert len({Image.open(io.BytesIO(b)).size for b in stored}) > 1
    # cached by content: the same folder gives the same artifact
    assert il.shard_imagenet_like(folder, tmp_path / "art", formats=formats, workers=2) == root


def test_goals_are_judged_per_size_from_the_medians():
    from benchmarks import gpu_loader as gl

    def arm(ips, wait, cores):
        return {"summary": gl.summarise([{"images_per_s": ips, "data_wait_frac": wait, "cores_busy": cores,
                                          "images_per_s_per_core": ips / cores}])}
    arms = {"synthetic": arm(3000, 0.0, 1.0), "pil_dataloader": arm(1800, 0.4, 16.0),
            "sluice-webdataset-cpu": arm(2400, 0.2, 15.0), "sluice-device": arm(2900, 0.01, 4.0)}
    g = gl.goals(arms, "gpu")
    assert g["best_sluice"] == "sluice-device"
    assert g["vs_synthetic"]["met"] and g["vs_synthetic"]["value"] == pytest.approx(2900 / 3000)
    assert g["vs_pil"]["met"] and g["data_wait"]["met"] and g["cores_busy_vs_pil"]["value"] == pytest.approx(0.25)
    arms["sluice-device"] = arm(2000, 0.2, 10.0)
    g = gl.goals(arms, "gpu")
    assert g["best_sluice"] == "sluice-webdataset-cpu"
    assert not g["vs_synthetic"]["met"] and not g["vs_pil"]["met"] and not g["data_wait"]["met"]
    del arms["synthetic"]
    assert gl.goals(arms, "gpu")["vs_synthetic"] == {"value": None, "wanted": ">= 0.9", "met": None}
    cpu = gl.goals(arms, "cpu")
    assert cpu["indicative"] and "met" not in json.dumps(cpu) and cpu["images_per_core_vs_pil"] is not None
    res = {"sizes": {"224": {"arms": arms, "goals": g}}}
    text = gl.report_table(res)
    assert "MISSED" in text and "sluice-webdataset-cpu" in text


def test_a_training_window_measures_throughput_wait_and_cores():
    import torch

    from benchmarks import gpu_loader as gl
    from benchmarks.resnet50 import ResNet50
    assert sum(p.numel() for p in ResNet50().parameters()) == 25_557_032  # torchvision's ResNet-50
    device = torch.device("cpu")
    small = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(8, 1000))
    trainer = gl.Trainer(device, small)
    r = gl.window(gl.synthetic_feed(32, 2, device), 2, device, warmup_s=0, window_s=0.2, trainer=trainer)
    assert r["steps"] >= 3 and r["images"] == 2 * r["steps"] and r["images_per_s"] > 0
    assert 0 <= r["data_wait_frac"] <= 1  # a share of the window (its size is the benchmark's to report)
    assert r["cores_busy"] is None or r["cores_busy"] > 0
    assert gl.cpu_seconds() > 0 and gl._proc_cpu_seconds() > 0

@pytest.mark.parametrize("w, h", [(400, 100), (100, 400), (300, 240)])
def test_the_plain_loaders_fallback_crop_stays_inside_the_image(monkeypatch, tmp_path, w, h):
    """When none of RandomResizedCrop's ten draws fits (rare: a flaky CI failure, PIL's 'box offset
    can't be negative'), the plain loader takes torchvision's central crop at the nearest allowed
    ratio, inside the image, for wide, tall and ordinary images alike."""
    import random

    from PIL import Image

    from benchmarks import gpu_loader as gl
    ds = gl.PilFolder(tmp_path, 32)
    monkeypatch.setattr(random, "uniform", lambda a, b: b * 4)  # every draw too large: the fallback
    x = ds._own(Image.new("RGB", (w, h), (120, 60, 30)))
    assert tuple(x.shape) == (3, 32, 32)



@pytest.mark.slow
def test_the_cpu_mode_runs_end_to_end_on_a_tiny_dataset(tmp_path):
    import torch

    from benchmarks import gpu_loader as gl
    if torch.cuda.is_available():
        pytest.skip("the CPU mode runs where there is no GPU")
    from benchmarks.common import RESULTS
    arms = ["pil_dataloader", "sluice-webdataset-cpu", "sluice-device"]
    out = tmp_path / "gpu_loader_cpu.json"
    res = gl.main(["--n", "40", "--window-s", "0.5", "--warmup-s", "0", "--repeats", "2", "--sizes", "64",
                   "--batch", "8", "--workers", "2", "--data-workers", "2", "--arms", *arms,
                   "--cache", str(tmp_path / "cache"), "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["mode"] == "cpu" and d["host_class"] and d["command"].startswith("python -m benchmarks.gpu_loader")
    assert "synthetic" in d["skipped"] or "synthetic" not in arms
    per = d["sizes"]["64"]["arms"]
    assert set(per) == set(arms)
    for arm in arms:
        runs = per[arm]["runs"]
        assert len(runs) == 2 and all("images_per_s" in r for r in runs), runs
        assert per[arm]["summary"]["images_per_s"]["median"] > 0
        assert all(r["data_wait_frac"] is None for r in runs)  # no training in cpu mode
    assert "OpenCV" in (per["sluice-device"].get("decode") or "") or per["sluice-device"].get("backend_reason")
    assert d["sizes"]["64"]["goals"]["indicative"] and res["data"]["folder_stats"]["n"] == 40
    with pytest.raises(SystemExit, match="refusing"):  # a CPU run is never written as GPU figures
        gl.main(["--n", "40", "--arms", "pil_dataloader", "--cache", str(tmp_path / "cache"),
                 "--out", str(RESULTS / "gpu_loader.json")])


def test_the_results_page_shows_gpu_figures_with_their_goals_and_cpu_figures_as_cpu_ones():
    from benchmarks import gpu_loader as gl
    from benchmarks import report

    def arm(ips, wait, cores):
        return {"runs": [{"images_per_s": ips}], "summary": gl.summarise([{
            "images_per_s": ips, "data_wait_frac": wait, "cores_busy": cores, "images_per_s_per_core": ips / cores}])}
    arms = {"synthetic": arm(3000, 0.0, 1.0), "pil_dataloader": arm(1500, 0.4, 16.0),
            "sluice-device": arm(2950, 0.01, 4.0), "sluice-ffcv-cpu": {"runs": [{"error": "boom"}], "summary": None}}
    base = {"batch": 256, "workers": 16, "window_s": 30.0, "warmup_s": 10.0, "repeats": 3, "skipped": {"x": "y"},
            "command": "python -m benchmarks.gpu_loader", "commit": "abc", "host": {"model": "cpu", "cores": 16},
            "data": {"folder_stats": {"n": 20000, "mean_width": 463, "mean_height": 399, "mean_bytes": 110e3,
                                      "quality": 90, "classes": 1000}}}
    gpu = {**base, "gpu": {"gpu": "H100", "torch": "2", "cuda": "12"}, "mode": "gpu",
           "sizes": {"224": {"arms": arms, "goals": gl.goals(arms, "gpu")}}}
    text = "\n".join(report.gpu_loader(gpu))
    assert "0.98× (met)" in text and "1.97× (met)" in text and "1.0% (met)" in text and "0.25× (met)" in text
    assert "failed: boom" in text and "20,000 ImageNet-like JPEGs" in text
    cpu = {**base, "mode": "cpu quick", "sizes": {"224": {"arms": arms, "goals": gl.goals(arms, "cpu")}}}
    text = "\n".join(report.gpu_loader_cpu(cpu, "gpu_loader_cpu-avx2_quick.json"))
    assert "CPU mode" in text and "met" not in text.replace("ImageNet", "") and "(indicative)" in text
