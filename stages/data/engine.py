"""Where a data stage's parts run (``engine``): ``local``, the stage's own forked pool (the
default; Ray not needed), or ``ray``, a Ray cluster (Ray Core tasks). A stage cuts its work
deterministically (the shard map: one task per shard, planned from the source before anything
runs) and merges the parts itself, so the artifact is the same bytes wherever the parts ran; the
engine only decides where each part runs. Today the image shard map runs on Ray; the other data
stages (text, dedup, verify, IL scoring) still run locally (issue #49).

A cluster address is ``host:port`` of a running Ray head (``ray start --head``). Without one,
Sluice starts a Ray instance of its own on this machine: on 127.0.0.1, with token authentication
(``RAY_AUTH_MODE=token``; Ray generates the token) and no dashboard."""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.errors import require

ShardMapFn = Callable[[dict[str, Any], list[dict]], list[dict]]
OWN_OBJECT_STORE = 256 * 2**20  # a Sluice-started instance's object store: shard results are small


class EngineConfig(BaseModel):
    """``engine``: ``local`` or ``ray``; for Ray the cluster's address and each part's CPUs."""
    model_config = ConfigDict(extra="forbid")
    name: Literal["local", "ray"] = Field("local", description="local: the stage's own process pool; ray: a Ray "
                                          "cluster (the image shard map; other stages stay local for now)")
    address: str | None = Field(None, description="ray: the head's host:port (ray start --head); none: start a "
                                "Ray instance on this machine, on 127.0.0.1 with token authentication")
    cpus_per_part: float = Field(1.0, gt=0, description="ray: CPUs each part (one shard) asks for")
    max_retries: int = Field(3, ge=0, description="ray: how often a part lost with its node runs again elsewhere")

    @model_validator(mode="before")
    @classmethod
    def _a_name_alone(cls, v: Any) -> Any:
        """``engine: ray`` (or ``--set engine=ray``) is ``engine: {name: ray}``."""
        return {"name": v} if isinstance(v, str) else v


def shard_map(cfg: EngineConfig, log: Callable[[str], None] = print) -> ShardMapFn | None:
    """The shard map ``cfg`` names: None for ``local`` (the stage runs its own pool), else a
    function running every shard write as a Ray task and returning the results in task order."""
    if cfg.name == "local":
        return None
    ray = connect(cfg, log)
    from sluice.stages.data.shard import write_shard_from_spec
    write = ray.remote(num_cpus=cfg.cpus_per_part, max_retries=cfg.max_retries)(write_shard_from_spec)

    def run(spec: dict[str, Any], tasks: list[dict]) -> list[dict]:
        refs = [write.remote(spec, t) for t in tasks]
        log(f"engine ray: {len(refs)} shard parts on {sum(n['Alive'] for n in ray.nodes())} node(s), "
            f"{ray.cluster_resources().get('CPU', 0):g} CPUs")
        return ray.get(refs)
    return run


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

