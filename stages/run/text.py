"""The nightly pipeline on text: several text sources become token artifacts sharing one
tokenizer (``stages/data/text``), and one weighted mixture of them trains a language model.

``TextPipelineConfig`` is ``PipelineConfig.text``; with it set, the same flow prepares, verifies,
trains and promotes on text instead of ``prepare.ingest``'s images. ``prepare_text`` shards each
source into ``<datasets>/<name>/`` (idempotent on its content: the same bytes and config find
their version): the first source learns the tokenizer, the others take it by ``tokenizer_file``
(the first source's dataset root, so the path stays the same while that source grows), and every
source is checked to hold that very tokenizer. What it returns is the "dataset" the rest of the
pipeline reads: one fingerprint for the set of versions, the sources' versions, their counts.

Selection on text (``token_selection_spec``): a packed row is no stable sample, so only a method
keying its table by document selects rows (``infobatch``; ``select/infobatch_tokens.py``); its
table holds every train document of the sources, and the ranks' token loaders then yield each
token's document (``train/rank.py`` turns ``doc_keys`` on).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.errors import ArtifactError, ConfigError, SluiceError, SourceError
from sluice.stages.data.text import TextShardConfig, shard_text
from sluice.stages.load.tokens import SeqLenSchedule
from sluice.stages.select.base import token_rows_refusal
from sluice.stages.select.config import SelectionConfig
from sluice.stages.select.spec import SelectionSpec
from sluice.storage.fingerprint import combine
from sluice.storage.tokens import open_token_split


class TextSource(BaseModel):
    """One source of the mixture: its name (its dataset folder and its name in the mixture and
    the per-source losses), where the text is, and its share of each training epoch."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="the dataset folder's name")
    source: str = Field(description="a folder of .txt/.md files, a .jsonl or a Parquet file")
    weight: float = Field(1.0, gt=0, description="the source's share of a training epoch's tokens "
                          "(of its documents with text.weight_unit: documents)")


class TextPipelineConfig(BaseModel):
    """Text sources trained as one mixture (a language model, e.g. ``model: gpt``)."""
    model_config = ConfigDict(extra="forbid")
    sources: list[TextSource] = Field(min_length=1, description="the first one's train split learns "
                                      "the tokenizer (unless shard.tokenizer_file names one)")
    shard: TextShardConfig = Field(default_factory=lambda: TextShardConfig(progress=False),
                                   description="how every source becomes a token artifact")
    seq_len: int = Field(256, ge=2, description="training row length (without seq_len_schedule)")
    seq_len_schedule: SeqLenSchedule | None = Field(None, description="sequence-length warm-up")
    weight_unit: Literal["tokens", "documents"] = Field(
        "tokens", description="what a source's weight is a share of: the epoch's tokens (a language "
        "model's mixtures are stated in tokens; a source of long documents would otherwise dominate) "
        "or its documents (Mosaic's proportion)")
    epoch_size: int | None = Field(None, ge=1, description="a training epoch of the mixture, in weight_unit "
                                   "(default: all of the sources' train tokens, or documents)")
    eval_batch_size: int = Field(16, ge=1, description="rows per batch when evaluating and grading")
    prefetch: int = Field(2, ge=0, description="training batches packed ahead in a helper thread")

    @model_validator(mode="after")
    def _unique_names(self) -> "TextPipelineConfig":
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"text.sources: names must be unique (each is a dataset folder); repeated: {dup}")
        return self

    def eval_seq_len(self) -> int:
        """The row length evaluation and grading pack into: the longest the model trains on."""
        return self.seq_len_schedule.end if self.seq_len_schedule else self.seq_len

    def split_fraction(self, split: str) -> float | None:
        """The share of documents ``split`` gets (None: train, the rest)."""
        return {"val": self.shard.val_fraction, "holdout": self.shard.holdout_fraction,
                "test": self.shard.test_fraction}.get(split)


def _source_info(name: str, weight: float, summary: Any) -> dict[str, Any]:
    m = summary.manifest
    return {"name": name, "weight": weight, **summary.info(), "tokenizer_sha256": m.tokenizer.file.sha256,
            "source": f"{m.source.kind}:{m.source.uri}", "delta": {"added": m.delta.added, "removed": len(m.delta.removed), "changed": len(m.delta.changed),
                      "reused_docs": m.delta.reused_docs} if m.delta else None}


def prepare_text(text: TextPipelineConfig, datasets_dir: str | os.PathLike,
                 log=lambda line: None) -> dict[str, Any]:
    """Shard (or find) each source's version under ``datasets_dir/<name>`` with one tokenizer,
    and describe the set: what the train, verify and promote steps read."""
    datasets_dir = Path(datasets_dir)
    first: str | None = text.shard.tokenizer_file
    sources = []
    for s in text.sources:
        if not Path(s.source).exists():
            raise SourceError(f"text source {s.name!r}: {s.source} does not exist (the Debian corpus: "
                              "python -m sluice.stages.data.text.debian <folder> --limit N)")
        out = datasets_dir / s.name
        summary = shard_text(text.shard.model_copy(update={"tokenizer_file": first}), s.source, out)
        log(f"{s.name}: " + summary.format())
        sources.append(_source_info(s.name, s.weight, summary))
        first = first or str(out)  # the root follows LATEST: the same path when this source grows
    tokenizers = {s["tokenizer_sha256"] for s in sources}
    if len(tokenizers) != 1:  # the loader checks eot and vocabulary size only: two BPEs can agree on both
        raise ArtifactError("the text sources hold different tokenizers (" + ", ".join(
            f"{s['name']}: {s['tokenizer_sha256'][:12]}" for s in sources) + "): their ids mean different things")
    splits = sorted({k for s in sources for k in s["counts"]})
    return {"modality": "tokens", "root": str(datasets_dir),
            "fingerprint": combine("text-sources", *(f"{s['name']}:{s['fingerprint']}" for s in sources)),
            "sources": sources, "counts": {k: sum(s["counts"].get(k, 0) for s in sources) for k in splits},
            "tokens": {k: sum(s["tokens"].get(k, 0) for s in sources) for k in splits},
            "vocab_size": sources[0]["vocab_size"], "eot": sources[0]["eot"],
            "tokenizer_sha256": sources[0]["tokenizer_sha256"], "reused": all(s["reused"] for s in sources),
            "quarantined": sum(sum(s["quarantined"].values()) for s in sources)}


def sources_with(data: dict[str, Any], split: str) -> list[dict[str, Any]]:
    """The sources whose ``split`` holds documents (an empty split cannot be packed)."""
    return [s for s in data["sources"] if s["counts"].get(split, 0)]


def verify_text(data: dict[str, Any]) -> dict[str, Any]:
    """Every document of every split of every source against its checksum, before any rank reads
    one (the token loader cannot skip a damaged document: damage fails here, naming it)."""
    docs, damaged = 0, []
    for s in data["sources"]:
        for split, n in s["counts"].items():
            if not n:
                continue
            try:
                open_token_split(s["root"], split).verify(deep=False)
            except SluiceError as e:
                damaged.append({"file": f"{s['name']}/{split}", "index": -1, "key": str(e)})
            docs += n
    if damaged:
        raise ArtifactError("damaged token artifacts: " + "; ".join(f"{d['file']}: {d['key']}" for d in damaged))
    return {"ok": True, "samples": docs, "unchecked": [], "damaged": [], "damaged_count": 0}


def check_model_fits(model_kwargs: dict[str, Any], text: TextPipelineConfig) -> None:
    """A model with a ``max_len`` shorter than the rows it would be fed is refused before training."""
    max_len = model_kwargs.get("max_len")
    if max_len is not None and max_len < text.eval_seq_len():
        raise ConfigError(f"train.model_kwargs.max_len={max_len} is shorter than the rows of "
                          f"{text.eval_seq_len()} tokens (text.seq_len / seq_len_schedule.end)")


def check_token_selection(selection: SelectionConfig) -> None:
    """A selection method that cannot select packed token rows, refused before anything runs."""
    why = token_rows_refusal(selection.method)
    if why:
        raise ConfigError(why)


def token_selection_spec(selection: SelectionConfig, batch_size: int, data: dict[str, Any]) -> SelectionSpec | None:
    """The selection spec of a token job (None for ``none``): each rank's ``batch_size`` rows are
    its candidates (InfoBatch prunes among them), and the table holds the documents of the
    sources' train splits (``data``: ``prepare_text``'s), the token loader's ``n_doc_keys``, which
    the rank checks again."""
    if selection.method == "none":
        return None
    check_token_selection(selection)
    return SelectionSpec(config=selection, candidate_size=batch_size, split_size=data["counts"]["train"],
                         fingerprint=data["fingerprint"])
