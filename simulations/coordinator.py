"""A deployment's coordinator: the run submitted to its SuperLink (``flwr run``), and the
coordinator brought back after it was lost (its host crashed, its SuperLink was killed), as a
service manager restarting it would: the SuperLink from its database, the run from the
ServerApp's checkpoint, orphaned runs stopped. ``simulations.deploy.deploy_local`` calls these;
a real coordinator's start-up script does the same steps (docs/deployment.md).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedasync.processes import Processes
from server.checkpoint import CHECKPOINT_FILE
from server.config import FedAsyncConfig
from server.run_config import run_config_toml
from simulations.app_bundle import stage_app
from simulations.certs import CertPaths
from simulations.erasure_watch import ErasureWatcher
from simulations.flower_commands import (
    FEDERATION,
    pump_output,
    start_superlink,
    stop_orphan_runs,
    tool,
)
from simulations.placement import Placement, program_names


def write_run_config(cfg: FedAsyncConfig, path: Path) -> None:
    """The run config ``flwr run`` is given: ``cfg`` as JSON, with the ServerApp's progress bar
    off (the console shows progress from the event log) and no sync-comparison warning of its
    own (``deploy_local`` has said it, once). ``cfg`` itself is left as it was."""
    server_cfg = replace(
        cfg, run=replace(cfg.run, progress=False), lab=replace(cfg.lab, compare_sync=False)
    )
    path.write_text(run_config_toml(server_cfg))  # flat keys, as pyproject.toml declares


def submit_run(
    procs: Processes,
    where: Placement,
    work: Path,
    cli_home: Path,
    serverapp: str | None,
    echo: Callable[[str], None],
) -> tuple[Any, threading.Thread]:
    """``flwr run`` of the staged app with ``deploy/run-config.toml``, on the coordinator's
    host, its output pumped to ``echo``; (its process, the pump's thread)."""
    flwr_run = procs.start(
        "flwr-run",
        where.argv(
            "coordinator",
            [
                tool("flwr"),
                *("run", str(stage_app(work / "app", serverapp)), FEDERATION),
                *("--run-config", str(work / "run-config.toml"), "--stream"),
            ],
        ),
        cli_home,
        pipe=True,
    )
    pump = threading.Thread(
        target=pump_output, args=(flwr_run.popen.stdout, flwr_run.log, echo), daemon=True
    )
    pump.start()
    return flwr_run, pump


def serverapp_gone(procs: Processes, timeout_s: float) -> bool:
    """Wait until no ServerApp of this deployment runs (``flwr run`` can end before it: after
    ``flwr stop`` the ServerApp still writes its checkpoint and summary, which a teardown's
    SIGTERM would cut short); False if one still runs after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any("flwr-serverapp" in program_names(pid) for pid in procs.scan()):
            return True
        time.sleep(0.2)
    return False


def fresh_database(work: Path) -> Path:
    """The SuperLink's state file, ``deploy/superlink/state.db``, removed if an earlier
    deployment left one (a new deployment registers its nodes afresh)."""
    db = work / "superlink" / "state.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    for leftover in (db, db.with_name("state.db-wal"), db.with_name("state.db-shm")):
        leftover.unlink(missing_ok=True)
    return db


def coordinator_lost(flwr_run: Any, link: Any, settle_s: float = 5.0) -> bool:
    """Whether the coordinator went down (False: the run ended by itself). ``flwr run``
    exited 0 is a finished run; otherwise the SuperLink gone is a loss. So is ``flwr run``
    killed by a signal: a host that loses power takes its processes one by one, and ``flwr
    run`` may be seen dead while the SuperLink, killed a moment later, is not yet; it is given
    ``settle_s`` to be seen gone."""
    code = flwr_run.poll()
    if code == 0:
        return False  # finished, whatever came after
    if link.poll() is not None:
        return True
    if code is None or code > 0:
        return False
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline and link.poll() is None:
        time.sleep(0.05)
    return True


def restart_coordinator(
    cfg: FedAsyncConfig,
    procs: Processes,
    where: Placement,
    paths: CertPaths,
    run_dir: Path,
    port: int,
    serverapp: str | None,
    echo: Callable[[str], None],
    restarts: list[dict[str, Any]],
) -> tuple[Any, Any, threading.Thread]:
    """Bring a lost coordinator back as a service manager restarting its host would: what is
    left of it killed, the SuperLink from its database on the same address and port (the
    SuperNodes, which retry, reconnect by themselves; their registrations are in the
    database), then ``flwr run`` again with ``run.resume=true`` when the ServerApp left a
    checkpoint (it continues from it: weights, jobs in flight re-sent, metrics.jsonl cut
    back to the checkpoint; the erasure service reopens its store), afresh otherwise. Each
    restart is recorded in ``restarts`` (``deploy.json``); (SuperLink, flwr run, its pump)."""
    t0 = time.monotonic()
    work = run_dir / "deploy"
    killed = where.coordinator_pids(procs.scan())
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs.procs:  # reap the coordinator's processes this one started
        if p.name in ("superlink", "flwr-run") and p.popen.poll() is None:
            p.popen.wait(timeout=10)
    resume = (run_dir / CHECKPOINT_FILE).exists()
    echo(
        "coordinator lost (SuperLink gone): restarting it from its database"
        + (", the run from its checkpoint" if resume else ", the run afresh (no checkpoint yet)")
    )
    run_cfg = replace(cfg, run=replace(cfg.run, resume=resume))
    write_run_config(run_cfg, work / "run-config.toml")
    if not resume:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    link, _ = start_superlink(
        procs, work, paths, where, port=port, database=work / "superlink" / "state.db"
    )
    orphans = stop_orphan_runs(procs, work / "flwr-home", lambda a: where.argv("coordinator", a))
    flwr_run, pump = submit_run(procs, where, work, work / "flwr-home", serverapp, echo)
    restarts.append(
        {
            "resumed": resume,
            "killed": len(killed),
            "orphan_runs_stopped": orphans,
            "restart_s": time.monotonic() - t0,
        }
    )
    return link, flwr_run, pump


def stop_watches(watches: list[ErasureWatcher] | None) -> None:
    """Stop the erasure watches (they are started again against the restarted service)."""
    for watch in watches or []:
        watch.stop(timeout=2.0)
