"""The ``sluice`` command line. Heavy imports happen inside each command, so ``--help`` is fast."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_DATA = "sluice-data"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML/JSON config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value, e.g. --set shard.encoding=png (repeatable)")


def cmd_shard(args: argparse.Namespace) -> int:
    """A source as a versioned artifact of its kind (``--kind``, else the one that recognises it)."""
    from sluice.flows.config import load_config
    from sluice.stages.kinds import kind_claiming
    kind = kind_claiming(args.source, args.kind)
    cfg = load_config(kind.ShardConfig, args.config, args.overrides + kind.shard_overrides(args.source))
    print(kind.shard(args.source, args.out, cfg, progress=not args.quiet, map_shards=_engine(args)))
    return 0


def _pipeline_config(args: argparse.Namespace, base: dict | None = None):
    from sluice.flows.config import load_config
    from sluice.flows.pipeline import PipelineConfig
    base = dict(base or {})
    if getattr(args, "data_root", None):
        base["data_root"] = args.data_root
    return load_config(PipelineConfig, args.config, args.overrides, base=base)


def _print_outcome(cfg, result: dict) -> None:
    from sluice.storage.registry import Registry
    reg = Registry(cfg.registry_dir())
    champ = reg.champion()
    p = result["promotion"]
    print("\n" + "=" * 72)
    for s in result["dataset"].sources:
        print(f"dataset artifact : {s.root}" + (f"  ({s.name})" if len(result["dataset"].sources) > 1 else ""))
    if result.get("il"):
        print(f"IL scores        : {result['il']['path']}")
    print(f"run directory    : {result['run_dir']}  (checkpoints, metrics.jsonl; torchrun.log for several ranks)")
    print(f"model registry   : {reg.root}")
    better = "higher" if p["higher_is_better"] else "lower"
    reported = f" ({p['report_split']} {p['report']['value']:.4f})" if p["report_split"] != p["eval_split"] else ""
    print(f"candidate        : {p['model_id']} {p['metric']} {p['candidate_value']:.4f}{reported}, {better} is better "
          f"-> {'promoted' if p['promoted'] else 'not promoted'} ({p['reason']})")
    if champ:
        print(f"champion         : {champ.model_id} {champ.metric} {champ.value:.4f}")
    host = result.get("train", {}).get("summary", {}).get("host")
    if host:
        print(f"trained on       : {host}")
    for t in result.get("tracking") or []:  # stages/track: where the night is mirrored
        state = (f"BEHIND ({t['behind']})" + ("; the next night catches up" if t.get("retry", True) else "")) \
            if t.get("behind") else "up to date"
        print(f"tracking         : {t['tracker']} {t['where']}: {state}")
        if t["tracker"] == "mlflow" and t["where"].startswith("sqlite:") and not t.get("behind"):
            store = t["where"].split(",")[0]
            print(f"                   browse: MLFLOW_DISABLE_TELEMETRY=true mlflow ui --backend-store-uri {store}"
                  "  (docs/tracking.md)")
    print("=" * 72)


def cmd_run(args: argparse.Namespace) -> int:
    """``sluice run nightly|prepare|train``: the flow, in this process, on any kind of data."""
    import sluice.flows.nightly as fl
    cfg = _pipeline_config(args)
    if args.flow == "prepare":
        for v in fl.prepare(cfg).sources:
            print(f"dataset artifact: {v.root} ({'reused' if v.reused else 'written'})")
        return 0
    print(f"resolved for this host: {cfg.resolved_for_host()}  ({HOST_NOTE})", flush=True)
    _print_outcome(cfg, fl.train(cfg) if args.flow == "train" else fl.nightly(cfg))
    return 0


HOST_NOTE = "host class or GPUs: precision, ranks x threads, batch per rank, loader device; an explicit --set wins"


def cmd_demo(args: argparse.Namespace) -> int:
    cfg = _pipeline_config(args, base={"recipe": "demo"})  # flows/recipes/demo.yaml
    il = " -> irreducible loss" if cfg.selection.needs_il else ""
    sel = f" with {cfg.selection.method} selection" if cfg.selection.method != "none" else ""
    comm = f", {cfg.train.comm.mode} compression" if cfg.train.comm.mode != "none" else ""
    model = "a model picked for the data" if cfg.train.model == "auto" else cfg.train.model
    print(f"Sluice demo: the nightly pipeline on {', '.join(cfg.data.names)} (shard{il} -> train {model}{sel} "
          f"for {cfg.train.epochs:g} epochs on {cfg.ranks()} ranks{comm} -> evaluate -> promote by "
          f"{cfg.promotion.metric}), data under {Path(cfg.data_root).resolve()}", flush=True)
    print(f"resolved for this host: {cfg.resolved_for_host()}  ({HOST_NOTE})", flush=True)
    import sluice.flows.nightly as fl
    _print_outcome(cfg, fl.nightly(cfg))
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    import yaml
    cfg = _pipeline_config(args, base={"recipe": args.recipe})
    print(f"# the config a run would use: recipe {cfg.recipe!r} (flows/recipes/{cfg.recipe}.yaml)"
          + (f" + {args.config}" if args.config else "") + "".join(f" + --set {o}" for o in args.overrides))
    print(f"# resolved for this host at run time: {cfg.resolved_for_host()}  ({HOST_NOTE})")
    for line in _resolved_from_data(cfg):
        print(f"# {line}")
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False, width=100), end="")
    return 0


def _resolved_from_data(cfg) -> list[str]:
    """What the config's ``auto`` settings resolve to on the data's newest versions, and why; or
    where they will come from when a source has no version yet."""
    from sluice.errors import SluiceError
    roots = [cfg.datasets_dir() / name for name in cfg.data.names]
    missing = [r.name for r in roots if not (r / "LATEST").is_file()]
    if missing:
        return [f"settings left to the data (auto) resolve from each source's artifact once it is sharded; no "
                f"version yet of: {', '.join(missing)} (sluice run prepare shards them)"]
    try:
        version = cfg.kind().version_of(roots, names=cfg.data.names)
        lines = cfg.kind().explain(cfg.train, version)
    except (SluiceError, ValueError, OSError) as e:
        return [f"settings left to the data (auto) could not be resolved from {cfg.datasets_dir()}: {e}"]
    return [f"resolved from the data (the newest versions under {cfg.datasets_dir()}):"] + [f"  {x}" for x in lines] \
        if lines else []


def cmd_models(args: argparse.Namespace) -> int:
    from sluice.storage.registry import Registry
    print(Registry(Path(args.data_root) / "registry").format_list())
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    import json
    from sluice.stages.kinds import kind_owning
    ok, report, text = kind_owning(args.artifact).verify_artifact(args.artifact, full=args.full,
                                                                  parts=_engine(args))
    print(json.dumps(report, indent=2) if args.json else text)
    return 0 if ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    import json
    from sluice.storage.gc import collect
    report = collect(args.root, keep=args.keep, dry_run=args.dry_run, on_wait=lambda who: print(
        f"sluice gc: {args.root} is locked by {who} (a shard run writing a version, or another gc); "
        "waiting for it", file=sys.stderr, flush=True))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0 if report.ok else 1


def _engine(args: argparse.Namespace):
    """The parts ``--engine``/``--address`` name (None: this machine), checked first."""
    from sluice.errors import ConfigError
    from sluice.stages.data.engine import EngineConfig, engine_parts
    engine = EngineConfig(name=args.engine, address=args.address)
    if engine.address and engine.name != "ray":
        raise ConfigError("--address names a Ray cluster: give it with --engine ray")
    return engine_parts(engine)


def _add_engine_args(p: argparse.ArgumentParser, what: str) -> None:
    """``--engine`` and ``--address``: where a data command's parts run (``stages/data/engine.py``)."""
    p.add_argument("--engine", choices=["local", "ray"], default="local", help=what)
    p.add_argument("--address", default=None, help="with --engine ray: the Ray head's host:port; none: start a Ray "
                   "instance on 127.0.0.1 with token authentication")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice", description="Data-centric, efficient training pipelines.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="run the whole nightly pipeline (default: on the bundled Fashion-MNIST)",
                       description="Runs the nightly-retrain flow through Prefect's embedded local API "
                                   "(no server to start) with the default pipeline config.")
    d.add_argument("--data-root", default=DEFAULT_DATA, help=f"data directory (default: {DEFAULT_DATA})")
    _add_config_args(d)
    d.set_defaults(fn=cmd_demo)

    r = sub.add_parser("run", help="run a flow: nightly, prepare or train",
                       description="Run a Sluice flow in this process (Prefect's embedded API, or the server "
                                   "named by PREFECT_API_URL).")
    r.add_argument("flow", choices=["nightly", "prepare", "train"])
    r.add_argument("--data-root", default=None, help="overrides data_root")
    _add_config_args(r)
    r.set_defaults(fn=cmd_run)

    t = sub.add_parser("train", help="train and promote on the current dataset (the train flow)")
    t.add_argument("--data-root", default=None, help="overrides data_root")
    _add_config_args(t)
    t.set_defaults(fn=cmd_run, flow="train")

    c = sub.add_parser("config", help="the resolved pipeline config")
    csub = c.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    cs = csub.add_parser("show", help="print the fully resolved config a run would use",
                         description="Print the pipeline config a run would use, every field resolved: the "
                                     "recipe, then --config, then --set (docs/configuration.md).")
    cs.add_argument("--recipe", default="default", help="the recipe underneath (default: default; the demo's: demo)")
    cs.add_argument("--data-root", default=None, help="overrides data_root")
    _add_config_args(cs)
    cs.set_defaults(fn=cmd_config_show)

    m = sub.add_parser("models", help="the model registry")
    msub = m.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    ml = msub.add_parser("list", help="every registered model; * marks the champion")
    ml.add_argument("--data-root", default=DEFAULT_DATA)
    ml.set_defaults(fn=cmd_models)

    s = sub.add_parser("shard", help="write a source as a versioned dataset artifact",
                       description="Shard SOURCE as an artifact of its kind of data: images (fashion-mnist, an "
                                   "IDX dir, an image folder, an .npz, or WebDataset .tar shards) into WebDataset + "
                                   "DALI index + FFCV formats, settings as --set shard.encoding=png; text (a folder "
                                   "of .txt/.md, a .jsonl, a .parquet) into a token artifact, settings as --set "
                                   "vocab_size=4096 (docs/artifact.md, docs/tokens.md).")
    s.add_argument("source")
    s.add_argument("--out", required=True, help="dataset root; the artifact goes to OUT/<fingerprint>")
    s.add_argument("--kind", default=None, help="the kind of data (image, tokens, ...; default: the kind that "
                                                 "recognises SOURCE)")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_engine_args(s, "where the shard writes run: this machine's pool (local) or a Ray cluster (ray)")
    _add_config_args(s)
    s.set_defaults(fn=cmd_shard)

    v = sub.add_parser("verify", help="check every sample of a dataset artifact against its checksums",
                       description="Read every sample of ARTIFACT in every format and check it against the "
                                   "checksums written with it; name each damaged file and sample. Exit 1 "
                                   "when something is damaged.")
    v.add_argument("artifact", help="an artifact directory, or a dataset root (follows LATEST)")
    v.add_argument("--full", action="store_true", help="also re-hash every file against the manifest's sha256")
    v.add_argument("--json", action="store_true", help="the report as JSON")
    _add_engine_args(v, "where the checks run: here (local) or a Ray cluster (ray)")
    v.set_defaults(fn=cmd_verify)

    g = sub.add_parser("gc", help="remove old versions of a dataset, keeping the newest and those in use",
                       description="Remove the versions under the dataset root ROOT other than the KEEP newest, "
                                   "the one LATEST names and those a reader has open; files that kept versions "
                                   "still read stay. Directories without a manifest (being written) are never "
                                   "touched. Exit 1 when something could not be removed.")
    g.add_argument("root", help="a dataset root (the directory holding the versions and LATEST)")
    g.add_argument("--keep", type=int, default=3, metavar="N", help="newest versions to keep (default: 3)")
    g.add_argument("--dry-run", action="store_true", help="remove nothing; report what would go")
    g.add_argument("--json", action="store_true", help="the report as JSON")
    g.set_defaults(fn=cmd_gc)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from sluice.errors import SluiceError
    try:
        return args.fn(args)
    except SluiceError as e:
        print(f"sluice {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
