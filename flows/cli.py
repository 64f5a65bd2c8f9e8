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
    from flows.config import load_config
    from stages.shard import PrepareConfig, shard_dataset
    cfg = load_config(PrepareConfig, args.config, args.overrides + [f"ingest.source={args.source}"])
    if args.quiet:
        cfg.shard.progress = False
    summary = shard_dataset(cfg.ingest, args.out, cfg.shard)
    print(summary.format())
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from stages.shard import PrepareConfig, shard_dataset
    out = Path(args.out)
    cfg = PrepareConfig()
    print(f"Sluice demo: sharding Fashion-MNIST into {out.resolve()}", flush=True)
    summary = shard_dataset(cfg.ingest, out / "fashion-mnist", cfg.shard)
    print(summary.format())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice", description="Data-centric, efficient training pipelines.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="run the main job on the bundled Fashion-MNIST data")
    d.add_argument("--out", default=DEFAULT_DATA, help=f"data directory (default: {DEFAULT_DATA})")
    d.set_defaults(fn=cmd_demo)

    s = sub.add_parser("shard", help="write a source as a versioned dataset artifact",
                       description="Shard SOURCE (fashion-mnist, an IDX dir, an image folder, an .npz, or "
                                   "WebDataset .tar shards) into WebDataset + DALI index + FFCV formats.")
    s.add_argument("source")
    s.add_argument("--out", required=True, help="dataset root; the artifact goes to OUT/<fingerprint>")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_config_args(s)
    s.set_defaults(fn=cmd_shard)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from flows.config import ConfigError
    from stages.errors import SluiceError
    from storage.atomic import StorageError
    try:
        return args.fn(args)
    except (SluiceError, ConfigError, StorageError) as e:
        print(f"sluice {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
