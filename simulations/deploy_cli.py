"""``fedasync deploy local``: the command line of ``simulations.deploy.deploy_local``.

Its options and overrides make the run's config (``--bundle`` is ``task.bundle``), the run is
followed by the metrics sinks, and a stop says where the run stopped and how to resume it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedasync.events import read_events
from fedasync.interrupt import resume_command, signal_of, stop_line
from runkit.configload import to_container
from runkit.sinks import following
from server.config import FedAsyncConfig
from server.summary import no_version_reason
from simulations.deploy import DeployError, deploy_local
from simulations.deploy_progress import print_result
from simulations.node import WORKERS, NodeError


def _where_deploy(cfg: FedAsyncConfig) -> str:
    from simulations.launcher import where_stopped

    return where_stopped(Path(cfg.run.out_dir).resolve() / cfg.run.name)


def _resume_deploy(cfg: FedAsyncConfig, args: argparse.Namespace) -> str:
    """The checkpoint a resumed deployment starts from (the ServerApp writes one every
    ``server.checkpoint_every`` versions) and the command; every process was stopped."""
    run_dir = Path(cfg.run.out_dir).resolve() / cfg.run.name
    ckpt = run_dir / "checkpoint.pt"
    if not ckpt.exists():
        return (
            "no checkpoint yet: run it again to start afresh; every process it started was stopped"
        )
    try:
        saved = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "checkpoint"]
    except (OSError, ValueError):
        saved = []
    at = f" (version {saved[-1]['version']})" if saved else ""
    flags = [f"--workers={args.workers}"] if args.workers != "warm" else []
    flags += [f"--certs={args.certs}"] if args.certs is not None else []
    flags += [f"--privacy-dir={args.privacy_dir}"] if args.privacy_dir is not None else []
    command = resume_command("deploy local", str(run_dir / "config.yaml"), flags)
    return f"checkpoint {ckpt}{at}; resume with: {command}; every process it started was stopped"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``fedasync deploy local`` on the CLI's sub-command parser."""
    dep = sub.add_parser("deploy", help="run on Flower's deployment engine")
    dsub = dep.add_subparsers(dest="deploy_cmd", required=True)
    loc = dsub.add_parser(
        "local", help="SuperLink + one SuperNode per silo on this machine, over TLS"
    )
    loc.add_argument("--silos", type=int, help="number of silos (default: silos.count)")
    loc.add_argument("--config", help="YAML config file (default: the packaged default.yaml)")
    loc.add_argument("--certs", type=Path, help="folder from `fedasync certs` (default: made)")
    loc.add_argument(
        "--privacy-dir",
        type=Path,
        help="folder of the silos' DP privacy ledgers, silo-<i>.sqlite, kept across runs "
        "(default: <run folder>/privacy)",
    )
    loc.add_argument(
        "--workers",
        choices=WORKERS,
        default="warm",
        help="warm: one long-lived ClientApp worker per SuperNode (default); flower: Flower's "
        "own process per message",
    )
    loc.add_argument(
        "--coordinator-restarts",
        type=int,
        default=0,
        metavar="N",
        help="bring the coordinator back up to N times when its SuperLink exits (SuperLink "
        "from its database, run from its checkpoint), as a service manager would (default 0: "
        "the run fails)",
    )
    loc.add_argument(
        "--bundle",
        type=Path,
        help="a MONAI training bundle as the silos' task (task.bundle): each silo's SuperNode "
        "gets the bundle and its own share of the bundle's datalist",
    )
    loc.add_argument("overrides", nargs="*", help="key=value overrides, e.g. run.budget_s=120")


def run(args: argparse.Namespace) -> int:
    """``fedasync deploy local``: exit 0 when the run finished, 1 when it failed or made no
    version, 130/143 when interrupted (after stopping everything)."""
    from simulations.config import load_config

    overrides = list(args.overrides)
    if args.silos is not None:
        overrides.append(f"silos.count={args.silos}")
    if args.bundle is not None:
        overrides.append(f"task.bundle={args.bundle.resolve()}")
    try:
        cfg = load_config(args.config, overrides)
    except (ValueError, FileNotFoundError) as e:
        print(f"fedasync: {e}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.run.out_dir).resolve() / cfg.run.name  # as deploy_local's prepare has it
    try:
        if not 0 <= args.coordinator_restarts <= 100:
            raise DeployError("--coordinator-restarts must be within [0, 100]")
        # the metrics sinks follow the run's metrics.jsonl from here: the coordinator's code
        # (the ServerApp, another process) knows nothing of them
        with following(cfg.run, "deploy", run_dir, config=to_container(cfg)):
            summary = deploy_local(
                cfg,
                certs=args.certs,
                privacy_dir=args.privacy_dir,
                workers=args.workers,
                coordinator_restarts=args.coordinator_restarts,
            )
    except (DeployError, NodeError) as e:
        print(f"fedasync deploy: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, SIGHUP: every process was stopped
        print(
            stop_line("deploy", e, _where_deploy(cfg), _resume_deploy(cfg, args)), file=sys.stderr
        )
        return signal_of(e)[1]
    print_result(summary, run_dir)
    why = no_version_reason(summary, run_dir)
    if why is not None:
        print(f"fedasync deploy: {why}", file=sys.stderr)
        return 1
    return 0
