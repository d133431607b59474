"""``fedasync node``: what a hospital runs, its SuperNode and its warm ClientApp worker.

    fedasync node --superlink HOST:PORT --root-certificates ca.pem --auth-key auth.key \\
        --node-config 'partition-id=2 num-partitions=6' [--port 9094] [--workers warm|flower] \\
        [--erasure-service HOST:PORT --erasure-token silo-2.token]

It starts Flower's SuperNode (through ``simulations.supernode``, its fixed sleeps capped; with
``--isolation process`` when workers are warm) and, with warm workers, one long-lived
ClientApp worker (``simulations.worker``) on the SuperNode's local runtime API, which it
starts again whenever it exits (``WorkerSupervisor``). TLS to the SuperLink and node
authentication are the SuperNode's, as with ``flower-supernode``. It runs until the SuperNode
exits (its exit status is this command's: run it under a supervisor such as systemd with
``Restart=on-failure``, as docs/deployment.md says) or until SIGTERM / Ctrl-C, and stops
every process it started, by process group and pid, before it exits.

The node keeps its own event log, ``<home>/metrics.jsonl``: every job its ClientApp ran, with
its local training loss, score, seconds and DP epsilon (``clients.node_log``), followed live
into the node's own TensorBoard files in ``<home>/tensorboard`` (``--no-tensorboard``: none;
``--mlflow [--mlflow-uri URI]``: MLflow too; runkit.sinks). Nothing of it leaves the node.

With ``--erasure-service`` it also follows its silo's erasure requests there
(``simulations.erasure_watch``): a training job the coordinator cancelled for an erasure stops
at its next local step, so the erasure starts without waiting for it (``clients.preempt``).

``fedasync deploy local`` starts the same commands, one pair per silo, on this machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from clients.node_log import NODE_EVENTS_ENV
from clients.preempt import STOP_FILE, STOP_FILE_ENV
from fedasync.errors import ConfigError
from fedasync.interrupt import Interrupted, interruptible, shielded
from fedasync.processes import Proc, Processes, owner_token
from runkit.folder import EVENTS
from runkit.keys import RunKeys
from runkit.sinks import start_following
from simulations.erasure_watch import ErasureWatcher, WatchError, read_token

WORKERS = ("warm", "flower")
"""How a SuperNode runs its ClientApp: ``warm``, one long-lived worker per SuperNode
(``simulations.worker``, supervised); ``flower``, Flower's own process per message."""

NODE_SLEEPS = ("--idle-s", "0.05", "--idle-max-s", "0.5", "--push-s", "0.02")
"""The SuperNode's fixed sleeps, shortened (``simulations.supernode``): the 3 s idle sleep
0.05 s doubling to 0.5 s while idle, the 0.5 s waits 0.02 s."""

SUPEREXEC_ENV = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.05"}
"""Flower's SuperExec polls for tasks every 1 s by default (``workers=flower``)."""


class NodeError(RuntimeError):
    """A SuperNode or its worker could not run."""


def check_workers(workers: str) -> None:
    """NodeError unless ``workers`` is one of ``WORKERS`` (the message bounded)."""
    if workers not in WORKERS:
        raise NodeError(f"workers must be one of {', '.join(WORKERS)}, not {workers[:40]!r}")


def supernode_args(
    superlink: str,
    root_certificates: Path,
    auth_key: Path,
    node_config: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    workers: str = "warm",
    heartbeat_s: float = 30.0,
) -> list[str]:
    """The SuperNode's command: Flower's ``flower-supernode`` options through the launcher
    that caps its sleeps and announces a heartbeat every ``heartbeat_s``; ``--isolation
    process`` for warm workers (the worker takes the SuperExec's place)."""
    check_workers(workers)
    if not 10.0 <= heartbeat_s <= 1800.0:
        raise NodeError(
            f"the heartbeat must be 10-1800 s (what a SuperLink takes), not {heartbeat_s:g}"
        )
    return [
        sys.executable,
        *("-m", "simulations.supernode", *NODE_SLEEPS, "--heartbeat-s", f"{heartbeat_s:g}"),
        *("--superlink", superlink),
        *("--root-certificates", str(root_certificates)),
        *("--auth-supernode-private-key", str(auth_key)),
        *("--node-config", node_config),
        *("--host", host, "--port", str(port)),
        *(("--isolation", "process") if workers == "warm" else ()),
    ]


def worker_command(port: int) -> list[str]:
    """The warm ClientApp worker of the SuperNode whose runtime API is on ``port``."""
    return [sys.executable, "-m", "simulations.worker", "--runtime-api", f"127.0.0.1:{port}"]


class WorkerSupervisor:
    """Keep one warm worker per SuperNode running: a worker that exits is started again (after
    a new FAB at once, as it asked; otherwise with its log's last lines shown), and more than
    ``max_restarts`` exits of one silo's worker within ``window_s`` raise NodeError (a worker
    that cannot start, not one that died once)."""

    def __init__(
        self,
        procs: Processes,
        homes: dict[int, Path],
        ports: dict[int, int],
        echo: Callable[[str], None],
        *,
        max_restarts: int = 5,
        window_s: float = 60.0,
        env: dict[int, dict[str, str]] | None = None,
        wrap: Callable[[int, list[str]], list[str]] | None = None,
    ):
        self.procs, self.homes, self.ports, self.echo = procs, homes, ports, echo
        self.wrap = wrap
        """How silo s's worker command runs (its hospital's host); None: as it is."""
        self.env = env or {}
        """What each silo's worker adds to its environment (its node's stop file)."""
        self.max_restarts, self.window_s = max_restarts, window_s
        self.workers: dict[int, Proc] = {}
        self.exits: dict[int, list[float]] = {s: [] for s in ports}
        self.restarts = 0

    def start(self) -> None:
        """Start every silo's worker."""
        for silo in self.ports:
            self._start(silo)

    def _start(self, silo: int) -> None:
        cmd = worker_command(self.ports[silo])
        if self.wrap is not None:
            cmd = self.wrap(silo, cmd)
        self.workers[silo] = self.procs.start(
            f"worker-{silo}", cmd, self.homes[silo], env=self.env.get(silo)
        )

    def check(self) -> int:
        """Start again the workers that exited; how many."""
        from simulations.worker import EXIT_NEW_FAB

        restarted = 0
        for silo, proc in list(self.workers.items()):
            code = proc.popen.poll()
            if code is None:
                continue
            now = time.monotonic()
            recent = [t for t in self.exits[silo] if now - t < self.window_s] + [now]
            self.exits[silo] = recent
            if len(recent) > self.max_restarts:
                raise NodeError(
                    f"silo {silo}'s worker exited {len(recent)} times within "
                    f"{self.window_s:.0f}s (last code {code}):\n{proc.tail()}"
                )
            why = "a new FAB" if code == EXIT_NEW_FAB else f"code {code}"
            self.echo(f"silo {silo}'s worker exited ({why}): started again")
            if code != EXIT_NEW_FAB:
                self.echo(proc.tail(5))
            self._start(silo)
            restarted += 1
        self.restarts += restarted
        return restarted


def stop_file_env(home: Path) -> dict[str, str]:
    """The environment that points a node's ClientApp processes at its stop file."""
    return {STOP_FILE_ENV: str(home / STOP_FILE)}


def node_events_env(home: Path) -> dict[str, str]:
    """The environment that points a node's ClientApp processes at its own event log."""
    return {NODE_EVENTS_ENV: str(home / EVENTS)}


def sink_keys(args: argparse.Namespace, home: Path) -> RunKeys:
    """The metrics sinks' settings of ``fedasync node`` (checked as ``run.*`` keys are; an
    error names the flag)."""
    try:
        return RunKeys(
            name=home.name or "node",
            trackers=[  # a tracking URI: MLflow on
                *([] if args.no_tensorboard else ["tensorboard"]),
                *(["mlflow"] if args.mlflow or args.mlflow_uri else []),
            ],
            mlflow_uri=args.mlflow_uri or None,
        )
    except ConfigError as e:
        raise ConfigError(str(e).replace("run.mlflow_uri", "--mlflow-uri")) from e


def start_watch(args: argparse.Namespace, home: Path) -> ErasureWatcher | None:
    """The node's erasure watch (``--erasure-service``), started; None without one. Raises
    NodeError for a bad address or token file."""
    if not args.erasure_service:
        return None
    if not args.erasure_token:
        raise NodeError("--erasure-service needs --erasure-token (this silo's token file)")
    try:
        token = read_token(Path(args.erasure_token))
        return ErasureWatcher(
            args.erasure_service,
            token,
            home / STOP_FILE,
            root_certificates=Path(args.root_certificates).read_bytes(),
        ).start()
    except (WatchError, OSError) as e:
        raise NodeError(str(e)) from e


def own_task_config(args: argparse.Namespace) -> str:
    """``--node-config`` with the hospital's own ``--datalist`` and ``--bundle`` added (each
    checked here first: the datalist a file, the bundle one fedasync can drive); NodeError in
    one line otherwise."""
    from simulations.flower_commands import node_config_string

    config = args.node_config
    datalist, bundle = getattr(args, "datalist", None), getattr(args, "bundle", None)
    if bundle is not None and datalist is None:
        raise NodeError("--bundle needs --datalist (the hospital's data the bundle trains on)")
    if datalist is not None:
        if not Path(datalist).is_file():
            raise NodeError(f"--datalist {str(datalist)[:200]}: no such file")
        config += f" datalist={node_config_string(str(Path(datalist).resolve()))}"
    if bundle is not None:
        from medical_data.monai_bundle import BundleError, read_bundle

        try:
            read_bundle(bundle).check_train_inferer()
        except BundleError as e:
            raise NodeError(str(e)) from e
        config += f" bundle={node_config_string(str(Path(bundle).resolve()))}"
    return config.strip()


def run_node(args: argparse.Namespace, echo: Callable[[str], None] = print) -> int:
    """Run one SuperNode (and its worker) until it exits or a signal; its exit status."""
    check_workers(args.workers)
    home = Path(args.home).resolve()
    keys = sink_keys(args, home)  # a bad --mlflow-uri: one line, exit 2
    try:
        node_config = own_task_config(args)
    except NodeError as e:
        echo(f"fedasync node: {e}")
        return 2
    home.mkdir(parents=True, exist_ok=True)
    node_env = {**stop_file_env(home), **node_events_env(home)}
    env = {**SUPEREXEC_ENV, **node_env}
    procs = Processes(marker=f"{home}:node:{owner_token()}")
    cmd = supernode_args(
        args.superlink,
        Path(args.root_certificates).resolve(),
        Path(args.auth_key).resolve(),
        node_config,
        args.port,
        workers=args.workers,
        heartbeat_s=args.heartbeat_s,
    )

    code = 0
    watch: ErasureWatcher | None = None
    # the node's whole log, at every start (its TensorBoard files are rebuilt from it)
    follower = start_following(keys, "node", home, echo=echo, fresh=False)
    try:
        with interruptible():  # SIGINT, SIGTERM, SIGHUP: Interrupted, exit 128 + the signal
            watch = start_watch(args, home)
            if watch is not None:
                echo(f"following this silo's erasure requests on {args.erasure_service}")
            node = procs.start("supernode", cmd, home, env=env)
            echo(f"SuperNode (pid {node.popen.pid}) -> {args.superlink}; log {node.log}")
            supervisor = None
            if args.workers == "warm":
                supervisor = WorkerSupervisor(
                    procs, {0: home}, {0: args.port}, echo, env={0: node_env}
                )
                supervisor.start()
                echo(
                    f"warm worker (pid {supervisor.workers[0].popen.pid}); log {home}/worker-0.log"
                )
            while node.popen.poll() is None:
                if supervisor is not None:
                    supervisor.check()
                time.sleep(0.5)
            code = int(node.popen.returncode or 0)
            echo(f"the SuperNode exited with code {code}:\n{node.tail(5)}")
    except Interrupted as e:
        code = e.exit_code
    except KeyboardInterrupt:  # a Ctrl-C before the handler was in place
        code = 130
    except NodeError as e:
        echo(f"fedasync node: {e}")
        code = 1
    finally:
        with shielded():  # a second Ctrl-C cannot cut the stop short and leave processes
            if watch is not None:
                watch.stop()
            left = procs.stop(grace_s=10.0)
            follower.close(ok=code != 1)  # after its processes: their last jobs are in the log
        if left:
            echo(f"fedasync node: processes {left} are still running")
    return code


def _heartbeat(text: str) -> float:
    """``--heartbeat-s``: seconds, within what a SuperLink accepts."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text[:20]!r}") from None
    if not 10.0 <= value <= 1800.0:
        raise argparse.ArgumentTypeError(f"{value:g} is not within 10-1800 s")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``fedasync node`` on the CLI's sub-command parser."""
    p = sub.add_parser("node", help="a hospital's SuperNode and its warm ClientApp worker")
    p.add_argument("--superlink", required=True, help="the coordinator's SuperLink, HOST:PORT")
    p.add_argument("--root-certificates", required=True, help="the CA (ca.pem)")
    p.add_argument("--auth-key", required=True, help="this node's private key (auth.key)")
    p.add_argument(
        "--node-config",
        default="",
        help="Flower node config, e.g. 'partition-id=2 num-partitions=6' (docs/deployment.md)",
    )
    p.add_argument(
        "--datalist",
        type=Path,
        help="the hospital's own data, a Decathlon datalist read only on this machine",
    )
    p.add_argument(
        "--bundle",
        type=Path,
        help="the hospital's own MONAI training bundle (the task it trains on --datalist)",
    )
    p.add_argument("--port", type=int, default=9094, help="the local runtime API's port")
    p.add_argument(
        "--erasure-service",
        default="",
        help="the coordinator's erasure service, HOST:PORT (TLS with --root-certificates): "
        "a training job this silo's erasure made obsolete stops at its next local step",
    )
    p.add_argument("--erasure-token", default="", help="this silo's erasure token file")
    p.add_argument("--workers", choices=WORKERS, default="warm")
    p.add_argument(
        "--heartbeat-s",
        type=_heartbeat,
        default=30.0,
        help="seconds between the SuperNode's heartbeats (10-1800, Flower's default 30): the "
        "SuperLink marks a node that stopped offline after two, and only then takes it back "
        "after a restart",
    )
    p.add_argument(
        "--home", default="fedasync-node", help="its FLWR_HOME, temp folder and logs (made)"
    )
    p.add_argument(
        "--no-tensorboard",
        action="store_true",
        help="no TensorBoard files of the node's own metrics (default: <home>/tensorboard)",
    )
    p.add_argument(
        "--mlflow", action="store_true", help="also log the node's own metrics to MLflow"
    )
    p.add_argument(
        "--mlflow-uri",
        default="",
        help="MLflow's tracking URI, MLflow on (with --mlflow alone: sqlite:///<home>/mlflow.db)",
    )
