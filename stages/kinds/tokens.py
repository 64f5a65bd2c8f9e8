"""``tokens``: text (folders of .txt/.md, a .jsonl, a Parquet file) becomes token artifacts
(``stages/data/text``: one per source under ``datasets/<name>/``, one BPE tokenizer learnt from
every source's train documents), is read as packed rows by the ``TokenLoader`` (a weighted
mixture of the sources: packing is this kind's way of reading) and trains a language model,
promoted by bits per byte on the eval split.

Bits per byte (the negative log-likelihood of the split's text in bits, over its UTF-8 bytes)
compares models whatever their tokenizers: a champion learnt with another tokenizer is graded on
tonight's documents re-tokenised with its own (kept beside its checkpoint in the registry), so a
changed tokenizer no longer stops promotion. A document is a sample: selection keys on documents
(a packed row re-packs every epoch), and a warm start trains on the new documents plus a replay.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np
from pydantic import Field

from sluice.errors import ArtifactError, ConfigError, RegistryError, SluiceError, SourceError
from sluice.stages.data.text import TextShardConfig
from sluice.stages.kinds.base import (DATA_KINDS, DataConfig, DataKind, DatasetVersion, Grade, Log, Servable, SourceVersion,
                                      WarmSource)
from sluice.stages.load.specs import TokensData
from sluice.stages.load.token_cursor import SeqLenSchedule
from sluice.stages.load.tokens import TokenLoaderConfig
from sluice.stages.select.base import token_rows_refusal
from sluice.stages.select.config import SelectionConfig
from sluice.stages.train.config import TrainConfig
from sluice.storage.fingerprint import combine
from sluice.storage.tokens import (TokenManifest, is_token_artifact, open_token_split, read_token_manifest,
                                   version_dir)

TOKENIZERS = "tokenizers"  # beside datasets/ under the data root: one folder per shared tokenizer


class TokenData(DataConfig):
    """Text sources trained as one mixture: how every source becomes a token artifact
    (``shard``), the rows a language model trains on, and how they are evaluated."""
    kind: Literal["tokens"] = "tokens"
    shard: TextShardConfig = Field(default_factory=lambda: TextShardConfig(progress=False),
                                   description="how every source becomes a token artifact (one BPE tokenizer "
                                   "learnt from every source's train documents, unless tokenizer_file names one)")
    seq_len: int = Field(256, ge=2, description="training row length (without seq_len_schedule)")
    seq_len_schedule: SeqLenSchedule | None = Field(None, description="sequence-length warm-up")
    weight_unit: Literal["tokens", "documents"] = Field(
        "tokens", description="what a source's weight is a share of: the epoch's tokens (a language model's "
        "mixtures are stated in tokens; a source of long documents would otherwise dominate) or its "
        "documents (Mosaic's proportion)")
    eval_batch_size: int = Field(16, ge=1, description="rows per batch when evaluating and grading")
    prefetch: int = Field(2, ge=0, description="training batches packed ahead in a helper thread")

    def eval_seq_len(self) -> int:
        """The row length evaluation and grading pack into: the longest the model trains on."""
        return self.seq_len_schedule.end if self.seq_len_schedule else self.seq_len

    def split_fraction(self, split: str) -> float | None:
        return {"val": self.shard.val_fraction, "holdout": self.shard.holdout_fraction,
                "test": self.shard.test_fraction}.get(split)


class TokenVersion(DatasetVersion):
    """The night's token artifacts: one tokenizer for all, and the tokens and text bytes per split."""
    kind: Literal["tokens"] = "tokens"
    vocab_size: int
    eot: int
    tokenizer_sha256: str
    tokenizer_file: str = Field(description="the tokenizer.json every source was written with")
    tokens: dict[str, int]
    dropped: dict[str, int] = Field(default_factory=dict)


@DATA_KINDS.register("tokens")
class TokenKind(DataKind):
    name = "tokens"
    Config = TokenData
    Version = TokenVersion
    ShardConfig = TextShardConfig
    task = "language_model"
    metric = "bpb"
    higher_is_better = False
    samples = "documents"
    curve = ("loss", "loss per token", (0.0, math.inf))
    trains = "language models (gpt is one)"
    input_settings = "data.seq_len (or data.seq_len_schedule)"
    split_rule = ("data.shard.seed, val_fraction, holdout_fraction or test_fraction, or a source renamed onto "
                  "another's documents")

    # ------------------------------------------------------------------ preparation
    def claims(self, source: str) -> bool:
        from sluice.stages.data.text import detect_text_source
        return detect_text_source(source) is not None

    def owns(self, artifact: str | os.PathLike) -> bool:
        return is_token_artifact(artifact)

    def shard(self, source: str, out: str | os.PathLike, config: TextShardConfig, progress: bool,
              map_shards: Callable | None = None) -> str:
        from sluice.stages.data.text import shard_text
        return shard_text(config.model_copy(update={"progress": progress and config.progress}), source, out,
                          _parts(map_shards)).format()

    def verify_artifact(self, artifact: str | os.PathLike, full: bool, *,
                        parts: Any = None) -> tuple[bool, dict[str, Any], str]:
        """Every split of a token artifact: its files (sha256 with ``full``) and every document's
        CRC-32, a split a part (``parts``: a Ray cluster's, or None: here)."""
        from sluice.stages.data.engine import LocalParts
        root = version_dir(artifact)
        report: dict[str, Any] = {"artifact": str(root), "splits": {}, "ok": True}
        splits = read_token_manifest(root).splits
        found = (parts or LocalParts()).ordered(token_split_part, ((str(root), name, full) for name in splits))
        for (name, rec), error in zip(splits.items(), found):
            report["splits"][name] = {"documents": rec.docs, "tokens": rec.tokens, "ok": error is None,
                                      **({"error": error} if error else {})}
            report["ok"] = report["ok"] and error is None
        lines = [f"token artifact {root}: " + ("every document matches its checksum" if report["ok"] else "DAMAGED")]
        for name, r in report["splits"].items():
            lines.append(f"  {name}: {r['documents']} documents, {r['tokens']} tokens: "
                         + ("ok" if r["ok"] else r["error"]))
        return report["ok"], report, "\n".join(lines)

    def prepare(self, data: TokenData, datasets_dir: Path, *, log: Log,
                map_shards: Callable | None = None) -> TokenVersion:
        """Each source's token artifact under ``datasets_dir/<name>`` (idempotent on its content),
        all written with one tokenizer learnt from every source's train documents (kept while
        the sources grow; ``data_root/tokenizers``)."""
        from sluice.stages.data.text import shard_text, shared_tokenizer
        parts = _parts(map_shards)
        datasets_dir = Path(datasets_dir)
        for s in data.sources:
            if not Path(s.source).exists():
                raise SourceError(f"text source {s.name!r}: {s.source} does not exist (the Debian corpus: "
                                  "python -m sluice.stages.data.text.debian <folder> --limit N)")
        tokenizer = shared_tokenizer([(s.name, s.source) for s in data.sources], data.shard,
                                     datasets_dir.parent / TOKENIZERS, log=log, parts=parts)
        shard = data.shard.model_copy(update={"tokenizer_file": str(tokenizer)})
        written = []
        for s in data.sources:
            summary = shard_text(shard, s.source, datasets_dir / s.name, parts)
            log(f"{s.name}: " + summary.format())
            written.append(self._source(s.name, summary.root, weight=s.weight, location=s.source,
                                        reused=summary.reused, seconds=summary.seconds))
        return self._version(written, str(tokenizer))

    def version_of(self, roots: Sequence[str | os.PathLike], names: Sequence[str] | None = None,
                   weights: Sequence[float] | None = None) -> TokenVersion:
        """The version of token artifacts written already (each a version, or a root with LATEST)."""
        dirs = [version_dir(r) for r in roots]
        names = list(names) if names is not None else [d.parent.name for d in dirs]
        weights = list(weights) if weights is not None else [1.0] * len(names)
        written = [self._source(n, d, weight=w, reused=True) for n, d, w in zip(names, dirs, weights)]
        m = written[0][1]
        return self._version(written, str(dirs[0] / m.tokenizer.file.path))

    @staticmethod
    def _source(name: str, root: str | os.PathLike, *, weight: float, location: str = "", reused: bool,
                seconds: float = 0.0) -> tuple[SourceVersion, TokenManifest]:
        m = read_token_manifest(root)
        return SourceVersion(
            name=name, location=location or m.source.uri, root=str(version_dir(root)), fingerprint=m.fingerprint,
            weight=weight, counts=m.counts(), reused=reused, quarantined=sum(m.quarantined.values()), seconds=seconds,
            delta={"added": m.delta.added, "removed": len(m.delta.removed), "changed": len(m.delta.changed),
                   "reused_docs": m.delta.reused_docs} if m.delta else None), m

    @staticmethod
    def _version(written: list[tuple[SourceVersion, TokenManifest]], tokenizer: str) -> TokenVersion:
        out, manifests = [s for s, _ in written], [m for _, m in written]
        shas = {m.tokenizer.file.sha256 for m in manifests}
        if len(shas) != 1:  # the loader checks eot and vocabulary size only: two BPEs can agree on both
            raise ArtifactError("the text sources hold different tokenizers (" + ", ".join(
                f"{s.name}: {m.tokenizer.file.sha256[:12]}" for s, m in written) + "): their ids mean different things")
        first = manifests[0]
        splits = sorted({k for s in out for k in s.counts})
        return TokenVersion(
            fingerprint=combine("text-sources", *(f"{s.name}:{s.fingerprint}" for s in out)), sources=out,
            counts={k: sum(s.counts.get(k, 0) for s in out) for k in splits},
            reused=all(s.reused for s in out), quarantined=sum(s.quarantined for s in out),
            vocab_size=first.tokenizer.vocab_size, eot=first.tokenizer.eot, tokenizer_sha256=shas.pop(),
            tokenizer_file=tokenizer,
            tokens={k: sum(m.splits[k].tokens for m in manifests if k in m.splits) for k in splits},
            dropped={"exact": sum(m.dropped.exact_duplicates for m in manifests),
                     "near": sum(m.dropped.near_duplicates for m in manifests)})

    def verify(self, version: DatasetVersion, data: TokenData, log: Log, *, parts: Any = None) -> dict[str, Any]:
        """Every document of every split of every source against its checksum, before any rank
        reads one (the token loader cannot skip a damaged document: damage fails here, naming it);
        a split a part (``parts``: a Ray cluster's, or None: here)."""
        from sluice.stages.data.engine import LocalParts
        todo = [(s, split, n) for s in version.sources for split, n in s.counts.items() if n]
        found = (parts or LocalParts()).ordered(token_split_part, ((s.root, split, False) for s, split, _ in todo))
        docs, damaged = 0, []
        for (s, split, n), error in zip(todo, found):
            if error is not None:
                damaged.append({"file": f"{s.name}/{split}", "index": -1, "key": error})
            docs += n
        if damaged:
            raise ArtifactError("damaged token artifacts: " + "; ".join(f"{d['file']}: {d['key']}" for d in damaged))
        log(f"token artifacts: {docs} documents match their checksums")
        return {"ok": True, "samples": docs, "unchecked": [], "damaged": [], "damaged_count": 0}

    # ------------------------------------------------------------------ the training job
    def check(self, train: TrainConfig, data: TokenData, selection: SelectionConfig) -> None:
        super().check(train, data, selection)
        max_len = train.model_kwargs.get("max_len")
        if max_len is not None and max_len < data.eval_seq_len():
            raise ConfigError(f"train.model_kwargs.max_len={max_len} is shorter than the rows of "
                              f"{data.eval_seq_len()} tokens (data.seq_len / seq_len_schedule.end)")

    def selection_refusal(self, method: str, data: DataConfig) -> str | None:
        return token_rows_refusal(method)

    def replay_refusal(self, policy: str) -> str | None:
        if policy in ("champion_loss", "reducible_loss"):
            return (f"warm.replay={policy} weighs old samples by the champion's loss on each, and a language "
                    "model's per-document losses are not computed: replay uniform")
        return None

    def train_config(self, train: TrainConfig, version: TokenVersion) -> TrainConfig:
        """The vocabulary as the version's tokenizer makes it; ``auto``: the GPT."""
        return train.model_copy(update={"num_classes": version.vocab_size,
                                        **({"model": "gpt"} if train.model == "auto" else {})})

    def explain(self, train: TrainConfig, version: TokenVersion) -> list[str]:
        return ["train.model: auto -> gpt (the one language model)"] if train.model == "auto" else []

    def data_specs(self, train: TrainConfig, data: TokenData, version: DatasetVersion, *, eval_split: str,
                   batch_size: int, selects: bool, subsets: dict[str, str] | None = None,
                   verified: bool = False) -> tuple[TokensData, TokensData]:
        """Packed rows of the weighted mixture of the sources' train splits (``doc_keys`` when a
        method selects: each token's document), evaluated on every document of ``eval_split``
        once at the longest row length trained on."""
        trained, graded = version.with_counts("train"), version.with_counts(eval_split)
        if not trained or not graded:
            raise ConfigError(f"no text source holds a {'train' if not trained else eval_split} document")
        mix = {"sources": [{"path": s.root, "name": s.name, "weight": s.weight, "subset": (subsets or {}).get(s.name)}
                           for s in trained], "epoch_size": data.epoch_size, "seed": train.seed,
               "weight_unit": "tokens" if data.weight_unit == "tokens" else "samples"}
        train_loader = TokenLoaderConfig(split="train", seq_len=data.seq_len, batch_size=batch_size,
                                         seq_len_schedule=data.seq_len_schedule, mixture=mix, seed=train.seed,
                                         prefetch=data.prefetch, doc_keys=selects)
        once = {"sources": [{"path": s.root, "name": s.name, "repeat": 1.0} for s in graded]}
        eval_loader = TokenLoaderConfig(split=eval_split, seq_len=data.eval_seq_len(), batch_size=data.eval_batch_size,
                                        mixture=once, prefetch=0)
        return TokensData(loader=train_loader), TokensData(loader=eval_loader)

    # ------------------------------------------------------------------ lineage, grading, warm start
    def lineage_keys(self, version: DatasetVersion, split: str) -> list[str]:
        """Each document named by its source (``<name>/<key>``: two sources may both have a ``0``)."""
        return [f"{s.name}/{k}" for s in version.with_counts(split) for k in open_token_split(s.root, split).keys]

    def model_files(self, version: TokenVersion) -> dict[str, str]:
        return {"tokenizer": version.tokenizer_file}

    def servable(self, checkpoint: str | os.PathLike, version: TokenVersion) -> Servable:
        from sluice.stages.models.served import ServedLanguageModel
        from sluice.stages.train.evaluate import model_from_checkpoint
        model, cfg = model_from_checkpoint(checkpoint)
        longest = int(getattr(model, "max_len", 1024))
        reads = (f"token ids (N, L) int64 of the tokenizer registered beside it (tokenizer.json), L <= {longest}; "
                 f"returns next-token logits (N, L, {cfg.get('num_classes', version.vocab_size)})")
        return Servable(module=ServedLanguageModel(model), example=np.zeros((2, min(64, longest)), np.int64),
                        shape=(-1, -1), reads=reads)

    def facts(self, version: TokenVersion) -> dict[str, Any]:
        return {"tokenizer_sha256": version.tokenizer_sha256}

    def grading_key(self, data: TokenData, split: str) -> str:
        # the rows graded depend on their length and the lanes (rows per batch) too
        return f"{split}/seq{data.eval_seq_len()}x{data.eval_batch_size}"

    def grade(self, checkpoint: str | os.PathLike, version: TokenVersion, split: str, *,
              data: TokenData, files: dict[str, str], facts: dict[str, Any]) -> Grade:
        """Bits per byte of ``checkpoint`` on every document of ``split`` once, overall and per
        source: its loss per token, summed over the split's tokens, in bits, over the UTF-8 bytes
        of the split's text. A model of another tokenizer (``facts``; its file in ``files``)
        reads the documents re-tokenised with its own."""
        from sluice.stages.data.text import retokenized, split_text_bytes
        from sluice.stages.train.evaluate import token_checkpoint_pass
        graded = version.with_counts(split)
        if facts.get("tokenizer_sha256") == version.tokenizer_sha256:
            sources = [(s.name, open_token_split(s.root, split)) for s in graded]
        elif files.get("tokenizer"):
            sources = [(s.name, retokenized(s.root, split, files["tokenizer"])) for s in graded]
        else:
            raise RegistryError(f"{checkpoint} was trained on another tokenizer's ids "
                                f"({str(facts.get('tokenizer_sha256'))[:12]}, tonight's {version.tokenizer_sha256[:12]}) "
                                "and was registered without it: its bits per byte on tonight's text cannot be measured")
        p = token_checkpoint_pass(checkpoint, sources, seq_len=data.eval_seq_len(), batch_size=data.eval_batch_size)
        text_bytes = {s.name: split_text_bytes(s.root, split) for s in graded}
        nats = {k: p["loss_by_source"][k] * p["tokens_by_source"][k] for k in p["loss_by_source"]}
        bpb = sum(nats.values()) / math.log(2) / max(sum(text_bytes.values()), 1)
        return Grade(value=bpb, loss=p["loss"], acc=p["acc"], n=p["n"], seq_len=p["seq_len"],
                     by_source={k: {"bpb": nats[k] / math.log(2) / max(text_bytes[k], 1), "loss": p["loss_by_source"][k],
                                    "tokens": p["tokens_by_source"][k], "bytes": text_bytes[k]} for k in nats})

    def warm_refusal(self, champion_data: dict[str, Any], version: TokenVersion) -> str | None:
        theirs = champion_data.get("tokenizer_sha256")
        if theirs != version.tokenizer_sha256:
            return (f"the champion's token ids are another tokenizer's ({str(theirs)[:12]}, tonight's "
                    f"{version.tokenizer_sha256[:12]}): its embeddings do not read tonight's tokens")
        return None

    def warm_sources(self, version: DatasetVersion, split: str,
                     champion_versions: dict[str, str]) -> list[WarmSource] | str:
        from sluice.storage.ancestry import changes_since
        out = []
        for s in version.with_counts(split):
            keys = open_token_split(s.root, split).keys
            redo: set[str] = set()
            theirs = champion_versions.get(s.name)
            if theirs is not None:
                since = changes_since(s.root, theirs, read=read_token_manifest)
                if isinstance(since, str):
                    return f"the champion's version of source {s.name!r} cannot be traced to tonight's: {since}"
                redo = {f"{s.name}/{k}" for k in since.changed | since.removed}  # new text under an old key
            out.append(WarmSource(name=s.name, root=s.root, keys=[f"{s.name}/{k}" for k in keys],
                                  live=np.ones(len(keys), bool), redo=redo))
        return out

    def describe(self, version: TokenVersion) -> list[str]:
        return [f"- tokenizer `{version.tokenizer_sha256[:12]}` ({version.vocab_size} ids), shared by every source; "
                "tokens: " + ", ".join(f"{k} {v:,}" for k, v in version.tokens.items())]


def _parts(map_shards: Callable | None) -> Any:
    """The engine's parts for the text stage (``engine: ray``), or None (this machine). A Prefect
    task runner's shard map (``prepare_runner``) writes image shards only: refused here."""
    from sluice.stages.data.engine import RayParts
    if map_shards is None or isinstance(map_shards, RayParts):
        return map_shards
    raise ConfigError("prepare_runner runs the image shard map only; a text night's parts run on this machine "
                      "(prepare_runner: local) or on a Ray cluster (engine: ray)")


def token_split_part(part: tuple[str, str, bool]) -> str | None:
    """(a token artifact's root, a split, deep) -> None when every document of the split matches
    its checksum (and with ``deep`` every file its sha256), else what is damaged: one part of
    ``verify``, run in any process that sees the root."""
    root, split, deep = part
    try:
        open_token_split(root, split).verify(deep=deep)
    except SluiceError as e:
        return str(e)
    return None
