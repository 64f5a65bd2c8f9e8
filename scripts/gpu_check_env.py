"""The throwaway env of ``scripts/gpu_check.py``: the interpreter with torch (found and described),
a virtualenv that sees its torch (in the CPU dry run, only what a CUDA image brings:
``IMAGE_PACKAGES``), and the wheelhouse installed into it with ``--no-index --no-deps``. Standard
library only, as the check is.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

# its sibling in scripts/ (on sys.path already when run beside it, not when imported as scripts.gpu_check_env)
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_proc import fail, run  # noqa: E402


# What a CUDA image is assumed to bring (scripts/gpu-wheelhouse.txt); the dry run's env sees these
# and what they require from the interpreter with torch, nothing else
IMAGE_PACKAGES = ["torch", "torchvision", "timm", "transformers", "tokenizers", "safetensors",
                  "huggingface-hub", "numpy", "pillow", "opencv-python", "opencv-python-headless",
                  "matplotlib", "pyyaml", "fsspec", "tqdm", "packaging", "typing-extensions", "jinja2",
                  "requests", "regex", "pytest", "pytest-timeout"]


PROBE = r"""
import json, os, shutil, subprocess, sys, site
import torch
info = {"python": sys.executable, "version": "%d.%d" % sys.version_info[:2], "torch": torch.__version__,
        "cuda_build": torch.version.cuda, "cuda": torch.cuda.is_available(),
        "in_venv": sys.prefix != sys.base_prefix, "site": site.getsitepackages()}
if info["cuda"]:
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                capability="%d.%d" % (p.major, p.minor), memory_gib=round(p.total_memory / 2**30, 1))
smi = shutil.which("nvidia-smi")
info["nvidia_smi"] = smi
if smi:
    try:
        info["driver"] = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
print(json.dumps(info))
"""


# The interpreter with torch, in the dry run: a folder of links to what the image is assumed to
# bring (IMAGE_PACKAGES and, recursively, what each requires), each as installed in this Python
IMAGE_VIEW = r"""
import importlib.metadata as md, json, os, re, sys
dest, want = sys.argv[1], json.loads(sys.argv[2])
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
dists = {}
for d in md.distributions():
    dists.setdefault(norm(d.metadata["Name"] or ""), d)
todo, seen = [norm(n) for n in want], []
while todo:
    n = todo.pop()
    if n in seen or n not in dists:
        continue
    seen.append(n)
    for req in dists[n].requires or []:
        if not re.search(r"extra\s*==", req):
            todo.append(norm(re.match(r"[A-Za-z0-9_.-]+", req).group(0)))
for n in seen:
    d = dists[n]
    for top in sorted({f.parts[0] for f in d.files or [] if f.parts and f.parts[0] != ".."}):
        src, link = str(d.locate_file(top)), os.path.join(dest, top)
        if os.path.exists(src) and not os.path.lexists(link) and not top.endswith(".pth"):
            os.symlink(src, link)
print(json.dumps(sorted(seen)))
"""



def probe(candidates: list[str]) -> dict:
    """The first interpreter among ``candidates`` that imports torch, described."""
    tried = []
    for py in candidates:
        if not py or not (shutil.which(py) or Path(py).exists()):
            continue
        try:
            r = subprocess.run([py, "-c", PROBE], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            tried.append(f"{py} ({e})")
            continue
        if r.returncode == 0 and r.stdout.strip():
            return json.loads(r.stdout.strip().splitlines()[-1])
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        tried.append(f"{py} ({last})")
    raise fail("no Python with torch found (tried: " + "; ".join(tried or candidates) +
               "); set GPU_PY to the interpreter that has the CUDA build of torch")


def make_venv(base: dict, venv: Path, log: Path, image_only: bool = False) -> tuple[Path, list[str]]:
    """A throwaway venv seeing ``base``'s torch; (its python, the pip command for it). With
    ``image_only`` (the dry run) it sees only what a CUDA image brings (IMAGE_PACKAGES) of the
    base's packages, through a folder of links beside it."""
    py = base["python"]
    flags = [] if base["in_venv"] or image_only else ["--system-site-packages"]
    if run([py, "-m", "venv", *flags, venv], log) != 0:  # no ensurepip (Debian without python3-venv)
        shutil.rmtree(venv, ignore_errors=True)
        if run([py, "-m", "venv", "--without-pip", *flags, venv], log) != 0:
            raise fail(f"cannot create a virtualenv with {py} (see {log})")
    vpy = venv / "bin" / "python"
    site = base["site"]
    if image_only:
        view = venv.parent / "image-site"
        view.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([py, "-c", IMAGE_VIEW, str(view), json.dumps(IMAGE_PACKAGES)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            raise fail(f"cannot make the image's view of {py}: {r.stderr.strip()[-500:]}")
        with open(log, "a") as f:
            f.write(f"image view {view}: {r.stdout.strip()}\n")
        site = [str(view)]
    if base["in_venv"] or image_only:  # a venv's packages are not "system" ones: name them in a .pth file
        purelib = subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        Path(purelib, "_gpu_check_base.pth").write_text("\n".join(site) + "\n")
    has_pip = subprocess.run([vpy, "-m", "pip", "--version"], capture_output=True).returncode == 0
    pip = [str(vpy), "-m", "pip"] if has_pip else [py, "-m", "pip", "--python", str(vpy)]
    return vpy, pip


def install(pip: list[str], wheelhouse: Path, log: Path, timeout: float | None = None) -> list[str]:
    wheels = sorted(str(p) for p in wheelhouse.glob("*.whl"))
    if not any(Path(w).name.startswith("sluice-") for w in wheels):
        raise fail(f"{wheelhouse} has no sluice wheel; rebuild it with make wheelhouse")
    # every wheel, no index, no dependency resolution: the image's torch stays as it is; installed
    # into the env even where the base already has a copy (so the wheelhouse is what is tested)
    cmd = [*pip, "install", "--no-index", "--no-deps", "--ignore-installed", "--disable-pip-version-check",
           "--find-links", str(wheelhouse), *wheels]
    rc = run(cmd, log, timeout=timeout)
    if rc != 0:
        raise fail(f"installing from {wheelhouse} {'timed out' if rc == 124 else 'failed'} (see {log})")
    return [Path(w).name for w in wheels]
