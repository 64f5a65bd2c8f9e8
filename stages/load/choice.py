"""Which loader backend reads a split: the configured one, or for ``auto`` the first that fits
the memory budget."""
from __future__ import annotations

from sluice.stages.load.backends import LOADER_BACKENDS
from sluice.stages.load.budget import memory_budget
from sluice.stages.load.config import LoaderConfig
from sluice.storage.artifact import DatasetArtifact


def resolve_backend(artifact: DatasetArtifact, config: LoaderConfig) -> tuple[str, str]:
    """The backend to use and why. ``auto`` takes the first of ``memory``, ``ffcv`` (where the split
    has a ``.beton``) and ``webdataset`` whose working memory (``Backend.working_bytes``: the decoded
    split for memory, the buffers in flight for a streaming backend) fits the loader's memory budget
    (``stages/load/budget.py``, or ``memory_budget_bytes``); where none fits, the smallest."""
    if config.backend != "auto":
        return config.backend, f"{config.backend}, as configured"
    rec = artifact.manifest.split(config.split)
    candidates = ["memory", *(["ffcv"] if rec.ffcv else []), "webdataset"]
    if artifact.manifest.fields.image.shape is None:
        stream = candidates[1]
        return stream, f"auto → {stream}: the images have variable sizes (memory needs one shape)"
    if config.memory_budget_bytes is not None:
        budget, why = config.memory_budget_bytes, f"loader.memory_budget_bytes {config.memory_budget_bytes / 1e9:.2f} GB"
    else:
        b = memory_budget()
        budget, why = b.bytes, b.explain()
    needs = {c: LOADER_BACKENDS.get(c).working_bytes(artifact, config.split, config) for c in candidates}

    def holds(c: str) -> str:
        return f"{c} needs {needs[c] / 1e9:.2f} GB ({LOADER_BACKENDS.get(c).holds})"
    fits = [c for c in candidates if needs[c] <= budget]
    if not fits:
        pick = min(candidates, key=needs.__getitem__)
        return pick, (f"auto → {pick}: every backend needs more than the {why} "
                      f"({', '.join(holds(c) for c in candidates)}); {pick} needs least")
    pick = fits[0]
    passed = candidates[:candidates.index(pick)]
    if not passed:
        return pick, f"auto → {pick}: {holds(pick)}, within the {why}"
    return pick, (f"auto → {pick}: {', '.join(holds(c) for c in passed)}: more than the {why}; "
                  f"{holds(pick)}, within it")
