"""The Flower processes of a local deployment: the SuperLink's and the SuperNodes' command
lines, starting the SuperLink, registering the SuperNodes' keys through its Control API, and
the flwr CLI's config and console output.

``simulations.deploy`` starts them in order; every process goes through a
``fedasync.processes.Processes`` so that it is stopped when the deployment ends.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedasync.processes import Proc, Processes
from protocol.keys import DATALIST, PRIVACY_DB
from simulations.certs import CertPaths
from simulations.node import NodeError, supernode_args
from simulations.placement import Local, Placement

FEDERATION = "fedasync-local"
"""The SuperLink connection's name in the flwr CLI's config.toml."""


class DeployError(RuntimeError):
    """The deployment could not start or the run did not finish."""


def free_ports(k: int) -> list[int]:
    """``k`` distinct TCP ports free on 127.0.0.1 now (all held open while choosing)."""
    socks = [socket.socket() for _ in range(k)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def tool(name: str) -> str:
    """A Flower executable of this environment (the venv's bin folder)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise DeployError(f"{name} not found next to {sys.executable}")
    return str(path)


def wait_for_port(
    port: int,
    alive: Callable[[], bool],
    timeout_s: float,
    listening: Callable[[int], bool] | None = None,
) -> None:
    """Wait until something listens on ``port`` (``listening``: how to tell; default a connect
    to 127.0.0.1); DeployError if ``alive()`` turns False or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise DeployError("the SuperLink exited while starting")
        if listening is not None:
            if listening(port):
                return
        else:
            with socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
        time.sleep(0.2)
    raise DeployError(f"the SuperLink did not listen on port {port} within {timeout_s:.0f}s")


def write_cli_config(home: Path, port: int, ca_cert: Path, host: str = "127.0.0.1") -> None:
    """The flwr CLI's config.toml: one connection, ``FEDERATION``, to the SuperLink at
    ``host``:``port``."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{FEDERATION}"\n\n'
        f"[superlink.{FEDERATION}]\n"
        f'address = "{host}:{port}"\n'
        f"root-certificates = {json.dumps(str(ca_cert.resolve()))}\n"
    )


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def pump_output(stream: Any, log_path: Path, echo: Callable[[str], None]) -> None:
    """Copy ``flwr run``'s output to its log file and, without Flower's empty lines, to echo."""
    with open(log_path, "a", encoding="utf-8") as log:
        for line in stream:
            log.write(line)
            log.flush()
            text = _ANSI.sub("", line).rstrip()
            if text and text.split(":", 1)[-1].strip():
                echo(f"  server | {text}")


REGISTER_TRIES = 5
"""Attempts at a Control API command while the SuperLink, listening already, is still starting
(its HTTP app answers a moment after its port accepts, or a restarted one reads its database:
the CLI then says "Connection to the SuperLink is unavailable")."""


def flwr_json(
    procs: Processes,
    cli_home: Path,
    commands: dict[str, list[str]],
    wrap: Callable[[list[str]], list[str]] = list,
    timeout_s: float = 60.0,
    *,
    require_success: bool = True,
) -> dict[str, dict[str, Any]]:
    """Run ``flwr ARGS FEDERATION --format json`` for every name -> ARGS of ``commands``, all at
    once (each as ``wrap`` runs it: on the coordinator's host), against the deployment's
    SuperLink; each one's JSON answer by name. A command the SuperLink could not answer yet
    ("SuperLink is unavailable") is run again (`REGISTER_TRIES`, a second apart). DeployError
    when one fails, times out or answers something else (the tail of its output in the
    message): an answer without ``"success": true`` too, unless not ``require_success`` (the
    caller checks the answer itself)."""
    answers: dict[str, dict[str, Any]] = {}
    todo = dict(commands)
    for attempt in range(1, REGISTER_TRIES + 1):
        started = {
            name: procs.start(
                f"flwr-{name}",
                wrap([tool("flwr"), *args, FEDERATION, "--format", "json"]),
                cli_home,
                pipe=True,
            )
            for name, args in todo.items()
        }
        for name, p in started.items():
            what = " ".join(todo[name])[:200]
            try:
                out, _ = p.popen.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired as e:
                p.popen.kill()
                p.popen.communicate()
                raise DeployError(f"flwr {what} timed out after {timeout_s:g}s") from e
            try:
                answer = json.loads(out[out.index("{") :])
            except ValueError:
                answer = None
            if isinstance(answer, dict) and answer.get("success", not require_success):
                answers[name] = answer
                del todo[name]
            elif "SuperLink is unavailable" not in out or attempt == REGISTER_TRIES:
                raise DeployError(f"flwr {what} failed:\n{out[-2000:]}")
        if not todo:
            break
        time.sleep(1.0)
    return answers


def flwr_cli(
    procs: Processes,
    cli_home: Path,
    args: list[str],
    wrap: Callable[[list[str]], list[str]] = list,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """One `flwr_json` command (``flwr ls``, ``flwr stop ID``): its JSON answer."""
    return flwr_json(procs, cli_home, {args[0]: args}, wrap, timeout_s)[args[0]]


def runs_at(
    procs: Processes, cli_home: Path, wrap: Callable[[list[str]], list[str]] = list
) -> list[dict[str, Any]]:
    """The runs the SuperLink knows (``flwr ls``): run id, status (``running``,
    ``finished:stopped``, ...), times, traffic."""
    return list(flwr_cli(procs, cli_home, ["ls"], wrap)["runs"])


def stop_orphan_runs(
    procs: Processes, cli_home: Path, wrap: Callable[[list[str]], list[str]] = list
) -> list[int]:
    """``flwr stop`` every run the SuperLink still counts as pending, starting or running:
    after a coordinator restart none has a ServerApp any more, and a SuperNode that was
    fetching one's message would retry it until Flower's heartbeat timeout gave up on the run
    (~40 s) before it took the new run's work. The run ids stopped."""
    stopped = []
    for run in runs_at(procs, cli_home, wrap):
        if run["status"].split(":")[0] in ("pending", "starting", "running"):
            flwr_cli(procs, cli_home, ["stop", str(run["run-id"])], wrap)
            stopped.append(int(run["run-id"]))
    return stopped


def register_nodes(
    procs: Processes,
    cli_home: Path,
    keys: dict[str, Path],
    wrap: Callable[[list[str]], list[str]] = list,
) -> dict[str, int]:
    """Register SuperNode public keys (name -> key file) with the SuperLink through its Control
    API (``flwr supernode register``, all at once: `flwr_json`); their node ids by name."""
    commands = {
        f"register-{name}": ["supernode", "register", str(key), "--name", name]
        for name, key in keys.items()
    }
    answers = flwr_json(procs, cli_home, commands, wrap, require_success=False)
    try:
        return {name: int(answers[f"register-{name}"]["node-id"]) for name in keys}
    except (KeyError, TypeError, ValueError) as e:
        raise DeployError(
            f"registering the SuperNodes' keys: no node id in {answers}"[:2000]
        ) from e


def node_config_string(value: str) -> str:
    """``value`` as a string of a SuperNode's ``--node-config`` (``key="value"``: Flower parses
    each value as TOML, and a bare path is no TOML value). Flower's parser ends a quoted value
    at the next double quote, so a value holding one cannot be passed."""
    if '"' in value:
        raise DeployError(f"a node config value cannot contain a double quote: {value!r}")
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string


def node_config(
    silo: int,
    num_silos: int,
    privacy_db: Path | None = None,
    datalist: Path | None = None,
    bundle: Path | None = None,
) -> str:
    """A SuperNode's ``--node-config``: its silo, the number of silos and, when given, its
    privacy ledger (``protocol.keys.PRIVACY_DB``), its own data, a Decathlon datalist
    (``protocol.keys.DATALIST``; without one the silo splits the benchmark) and its own MONAI
    bundle (``bundle``: the task it trains on that datalist)."""
    config = f"partition-id={silo} num-partitions={num_silos}"
    if privacy_db is not None:
        config += f" {PRIVACY_DB}={node_config_string(str(privacy_db))}"
    if datalist is not None:
        config += f" {DATALIST}={node_config_string(str(Path(datalist).resolve()))}"
    if bundle is not None:
        config += f" bundle={node_config_string(str(Path(bundle).resolve()))}"
    return config


def supernode_command(
    link_port: int,
    port: int,
    paths: CertPaths,
    silo: int,
    num_silos: int,
    privacy_db: Path | None = None,
    *,
    datalist: Path | None = None,
    bundle: Path | None = None,
    workers: str = "warm",
    link_host: str = "127.0.0.1",
) -> list[str]:
    """The SuperNode of ``silo`` (``simulations.node.supernode_args``: Flower's SuperNode,
    its sleeps capped): TLS to the SuperLink, its auth key, its partition, its privacy
    ledger and its own data (``datalist``); ``--isolation process`` with warm workers."""
    try:
        return supernode_args(
            f"{link_host}:{link_port}",
            paths.ca_cert,
            paths.node_key(silo),
            node_config(silo, num_silos, privacy_db, datalist, bundle),
            port,
            workers=workers,
        )
    except NodeError as e:
        raise DeployError(str(e)) from e


def superlink_command(
    port: int, paths: CertPaths, host: str = "127.0.0.1", database: Path | None = None
) -> list[str]:
    """flower-superlink on ``host``:``port``: TLS, SuperNode authentication, no installs; its
    state (registered nodes, runs, messages) in the SQLite file ``database`` (None: memory)."""
    return [
        tool("flower-superlink"),
        *("--ssl-certfile", str(paths.server_cert), "--ssl-keyfile", str(paths.server_key)),
        *("--ssl-ca-certfile", str(paths.ca_cert), "--enable-supernode-auth"),
        "--disable-runtime-dependency-installation",
        *("--host", host, "--port", str(port)),
        *(("--database", str(database)) if database is not None else ()),
    ]


def start_superlink(
    procs: Processes,
    work: Path,
    paths: CertPaths,
    where: Placement | None = None,
    *,
    port: int | None = None,
    database: Path | None = None,
) -> tuple[Proc, int]:
    """Start the SuperLink (on the coordinator's host of ``where``, default this one's
    loopback; on ``port``, default the placement's) with its state in ``database`` (see
    `superlink_command`), and wait until it listens; (its process, its port)."""
    where = where or Local()
    port = where.link_port() if port is None else port
    cmd = where.argv("coordinator", superlink_command(port, paths, where.link_host, database))
    link = procs.start("superlink", cmd, work / "superlink")
    wait_for_port(port, lambda: link.popen.poll() is None, 60.0, where.listening)
    return link, port
