"""Flower's deployment engine on loopback, over TLS, with SuperNode authentication.

Slow (a real SuperLink, SuperNodes, ServerApp and one ClientApp process per message): about
a minute for the 2-silo run on 2 CPU cores, 10-20 s for each of the others.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fedasync.events import read_events
from fedasync.processes import MARKER_ENV, Processes, alive, pids_with_env
from simulations.certs import write_certs
from simulations.deploy import deploy_local
from simulations.flower_commands import (
    free_ports,
    register_nodes,
    start_superlink,
    supernode_command,
    write_cli_config,
)

pytestmark = pytest.mark.slow


def _marked(prefix: str) -> list[int]:
    """Live processes whose deployment marker starts with ``prefix``."""
    return [p for p in pids_with_env(MARKER_ENV, prefix, prefix=True) if alive(p)]


def _kill_all(prefix: str) -> None:
    for pid in _marked(prefix):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_two_silos_train_over_tls_with_node_authentication(small_cfg, tmp_path):
    # Prepare: stop at 6 versions, whatever the machine's speed (a warm worker answers in
    # about a second, so one silo may deliver a few before the other's first)
    cfg = small_cfg(
        "silos.count=2",
        "run.budget_s=150",
        "run.max_versions=6",
        "run.progress=true",  # progress lines on echo (the ServerApp itself draws no bar)
        "data.max_samples=300",
    )
    lines: list[str] = []
    try:
        # Execute
        summary = deploy_local(cfg, echo=lines.append)
    finally:
        _kill_all(str(tmp_path))  # only acts if the deployment failed to stop something
    # Assert: the run finished on the wall clock with accepted updates from both silos
    run_dir = tmp_path / "t"
    assert summary["clock"] == "wall" and summary["versions"] == 6
    assert summary["per_silo"]["0"]["accepted"] >= 1
    assert summary["per_silo"]["1"]["accepted"] >= 1
    assert summary["updates_rejected_total"] == 0
    # ...trained by the SuperNodes whose keys were registered
    d = summary["deployment"]
    roster = next(e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "roster")
    assert {s: v["node"] for s, v in roster["silos"].items()} == d["nodes"]
    # ...over TLS, with SuperNode authentication on
    link_log = (run_dir / "deploy" / "superlink" / "superlink.log").read_text()
    assert f"running on https://{d['superlink']}" in link_log
    assert "SuperNode authentication is disabled" not in link_log
    assert d["round_trip_s"]["count"] >= 2
    # ...and every process it started (and their children) is gone
    assert d["left_running"] == []
    assert len(d["pids"]) >= 7  # SuperLink, 2 SuperNodes, 2 registrations, flwr run, ServerApp
    assert [p for p in d["pids"] if alive(p)] == []
    assert _marked(str(tmp_path)) == []
    assert any("silos connected" in line for line in lines)


def test_unregistered_key_and_unknown_ca_are_refused(tmp_path):
    # Prepare: a SuperLink with only silo 0's key registered
    paths = write_certs(tmp_path / "certs", 3)
    foreign = write_certs(tmp_path / "foreign", 3)  # another CA
    procs = Processes(marker=f"{tmp_path}:refused")
    try:
        _, port = start_superlink(procs, tmp_path, paths)
        write_cli_config(tmp_path / "cli", port, paths.ca_cert)
        (node,) = register_nodes(procs, tmp_path / "cli", {"0": paths.node_public_key(0)}).values()
        p0, p1, p2 = free_ports(3)
        # Execute
        good = procs.start("silo-0", supernode_command(port, p0, paths, 0, 3), tmp_path / "s0")
        unregistered = procs.start(
            "silo-1", supernode_command(port, p1, paths, 1, 3), tmp_path / "s1"
        )
        wrong_ca = procs.start(
            "silo-2", supernode_command(port, p2, foreign, 2, 3), tmp_path / "s2"
        )
        rc_unregistered = unregistered.popen.wait(timeout=60)
        rc_wrong_ca = wrong_ca.popen.wait(timeout=60)
        # Assert: both refused and gone; the registered one connected and keeps running
        assert rc_unregistered != 0
        assert "Failed to activate SuperNode" in unregistered.log.read_text()
        assert rc_wrong_ca != 0
        assert "CERTIFICATE_VERIFY_FAILED" in wrong_ca.log.read_text()
        deadline = time.monotonic() + 30
        while f"SuperNode ID: {node}" not in good.log.read_text():
            assert time.monotonic() < deadline, good.tail()
            time.sleep(0.2)
        assert good.popen.poll() is None
    finally:
        left = procs.stop(grace_s=10.0)
        _kill_all(str(tmp_path))
    assert left == [] and [p for p in procs.seen if alive(p)] == []


def test_sigterm_stops_every_process(tmp_path):
    # Prepare: the CLI, as a user runs it, with a budget it will not reach
    out = tmp_path / "out.txt"
    cmd = [
        sys.executable,
        "-m",
        "simulations.cli",
        "deploy",
        "local",
        "--silos",
        "2",
        f"run.out_dir={tmp_path}",
        "run.name=term",
        "run.budget_s=600",
        "data.max_samples=300",
        "server.evaluate_silos=false",
    ]
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while "Successfully started run" not in out.read_text():
            assert proc.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.3)
        time.sleep(2.0)  # the ServerApp process is starting
        assert _marked(str(tmp_path))
        # Execute
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        # Assert
        assert rc == 143, out.read_text()
        assert "every process it started was stopped" in out.read_text()
        assert _marked(str(tmp_path)) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_all(str(tmp_path))
