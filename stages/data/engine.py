"""Where a data stage's parts run (``engine``): ``local``, the stage's own forked pool (the
default; Ray not needed), or ``ray``, a Ray cluster (Ray Core tasks). A stage cuts its work
deterministically (the shard map: one task per shard, planned from the source before anything
runs) and merges the parts itself, so the artifact is the same bytes wherever the parts ran; the
engine only decides where each part runs. On Ray today: the image scan and shard map; the text stage's
two costly passes (MinHash signatures for dedup, and tokenizing), cut into parts of consecutive
documents in source order, and its LSH buckets (a band a part); and ``verify``'s per-sample
checks (a tar shard, a range of ``.beton`` records, a token split a part); and the IL model's scoring
pass (``stages/select/il_parts.py``). The dedup clusters, BPE training, the IL model's training
and the files' sha256 still run on the machine running the stage (issue #49).

A cluster address is ``host:port`` of a running Ray head (``ray start --head``). Without one,
Sluice starts a Ray instance of its own on this machine: on 127.0.0.1, with token authentication
(``RAY_AUTH_MODE=token``; Ray generates the token) and no dashboard."""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from collections import deque
from typing import Any, Callable, Iterable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.errors import require

OWN_OBJECT_STORE = 256 * 2**20  # a Sluice-started instance's object store: shard results are small


class EngineConfig(BaseModel):
    """``engine``: ``local`` or ``ray``; for Ray the cluster's address and each part's CPUs."""
    model_config = ConfigDict(extra="forbid")
    name: Literal["local", "ray"] = Field("local", description="local: the stage's own process pool; ray: a Ray "
                                          "cluster (the image scan and shard map, the text stage's signatures, "
                                          "LSH buckets and tokenizing, verify's checks, IL scoring)")
    address: str | None = Field(None, description="ray: the head's host:port (ray start --head); none: start a "
                                "Ray instance on this machine, on 127.0.0.1 with token authentication")
    cpus_per_part: float = Field(1.0, gt=0, description="ray: CPUs each part (one shard) asks for")
    max_retries: int = Field(3, ge=0, description="ray: how often a part lost with its node runs again elsewhere")

    @model_validator(mode="before")
    @classmethod
    def _a_name_alone(cls, v: Any) -> Any:
        """``engine: ray`` (or ``--set engine=ray``) is ``engine: {name: ray}``."""
        return {"name": v} if isinstance(v, str) else v


_KEPT: dict[str, tuple[Any, Any]] = {}


def kept(slot: str, key: Any, make: Callable[[], Any]) -> Any:
    """What a part needs that is costly to make (an open source, a parsed tokenizer, an open
    artifact), made once per process and ``slot``: a part of another ``key`` replaces it."""
    if slot not in _KEPT or _KEPT[slot][0] != key:
        _KEPT.pop(slot, None)
        _KEPT[slot] = (key, make())
    return _KEPT[slot][1]


def keep(slot: str, key: Any, value: Any) -> None:
    """Parts run in this process use ``value`` itself for ``key`` (the stage's own, already made)."""
    _KEPT[slot] = (key, value)


class LocalParts:
    """Parts run one after another in this process: what a stage does without an engine."""
    name = "local"

    def ordered(self, fn: Callable[[Any], Any], parts: Iterable[Any], window: int | None = None,
                gpus: float = 0) -> Iterator[Any]:
        """``fn(part)`` for each part, in order."""
        return map(fn, parts)

    def has_gpus(self) -> bool:
        """Parts here run on the stage's own device; none asks for a GPU."""
        return False


class RayParts:
    """A stage's parts as Ray tasks on a cluster: ``all`` (every part at once: the image shard
    map) and ``ordered`` (a bounded window: the scan, the text stage, verify). The stages hand
    it their own part functions; it imports none of them."""
    name = "ray"

    def __init__(self, ray: Any, cfg: EngineConfig, log: Callable[[str], None]):
        self.ray, self.cfg, self.log = ray, cfg, log
        self._remote: dict[tuple[Callable, float], Any] = {}

    def _task(self, fn: Callable, gpus: float = 0) -> Any:
        if (fn, gpus) not in self._remote:
            self._remote[fn, gpus] = self.ray.remote(num_cpus=self.cfg.cpus_per_part, num_gpus=gpus,
                                                     max_retries=self.cfg.max_retries)(fn)
        return self._remote[fn, gpus]

    def has_gpus(self) -> bool:
        """Whether the cluster has a GPU (a part that can use one asks for it: IL scoring)."""
        return self.ray.cluster_resources().get("GPU", 0) > 0

    def where(self) -> str:
        ray = self.ray
        return f"{sum(n['Alive'] for n in ray.nodes())} node(s), {ray.cluster_resources().get('CPU', 0):g} CPUs"

    def all(self, fn: Callable[[Any], Any], parts: list[Any], what: str) -> list[Any]:
        """``fn(part)`` for every part as a Ray task, all in flight at once (each part's result is
        small: the image shard map), results in order; says how many ``what`` ran where."""
        task = self._task(fn)
        refs = [task.remote(p) for p in parts]
        self.log(f"engine ray: {len(refs)} {what} on {self.where()}")
        return self.ray.get(refs)

    def ordered(self, fn: Callable[[Any], Any], parts: Iterable[Any], window: int | None = None,
                gpus: float = 0) -> Iterator[Any]:
        """``fn(part)`` for each part as a Ray task (with ``gpus`` GPUs), results in the parts'
        order; at most ``window`` parts in flight (default: twice the cluster's CPUs), so a corpus
        larger than the object store streams through it. A part whose node is lost runs again
        (``max_retries``); a part that raises raises here, with Ray's traceback."""
        task = self._task(fn, gpus)
        cpus = int(self.ray.cluster_resources().get("CPU", 1) or 1)
        window = max(1, window or 2 * cpus)
        flight: deque = deque()
        n = 0
        for part in parts:
            flight.append(task.remote(part))
            n += 1
            if len(flight) >= window:
                yield self.ray.get(flight.popleft())
        said = f"engine ray: {n} {getattr(fn, '__name__', 'map')} parts on {self.where()}"
        if not flight:
            self.log(said)
        while flight:
            result = self.ray.get(flight.popleft())
            if not flight:  # said before the last result: a consumer such as zip stops right after it
                self.log(said)
            yield result


Parts = LocalParts | RayParts


def engine_parts(cfg: EngineConfig, log: Callable[[str], None] = print) -> RayParts | None:
    """The engine ``cfg`` names: None for ``local`` (each stage runs its own pool or loop), else
    the Ray cluster's parts, which a stage takes as its ``map_shards`` or ``parts``."""
    if cfg.name == "local":
        return None
    return RayParts(connect(cfg, log), cfg, log)


def connect(cfg: EngineConfig, log: Callable[[str], None] = print) -> Any:
    """This process joined to the cluster at ``cfg.address``, or to a Ray instance it starts on
    127.0.0.1 (token authentication, no dashboard). Token authentication is asked for in both
    cases: a cluster without it refuses the token-carrying client, and says so."""
    # read by Ray when it is imported: set first
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not cfg.address and not os.environ.get("RAY_AUTH_TOKEN") and not os.environ.get("RAY_AUTH_TOKEN_PATH") \
            and not (Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # this instance's own, for this process only
    ray = require("ray", "ray", "ray", "running data stages on a Ray cluster (engine: ray)")
    if ray.is_initialized():
        return ray
    if cfg.address:
        ray.init(address=cfg.address, log_to_driver=False)
        log(f"engine ray: joined the cluster at {cfg.address}")
    else:
        from sluice.stages.host import usable_cores
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=usable_cores(),
                 object_store_memory=OWN_OBJECT_STORE, log_to_driver=False)
        log("engine ray: started a Ray instance on 127.0.0.1 (token authentication, no dashboard)")
    return ray

