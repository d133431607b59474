"""A deployment across hosts (simulations.hosts: the coordinator and each hospital in a network
namespace of its own, TLS to the coordinator's address) rides out a hospital's partition and
a crash of the coordinator's host.

One run, as a hospital network fails (about 65 s wall, 2 hospitals):
1. hospital 0's link goes down (packets dropped, no reset) for 8 s, after the 4th update;
2. the link comes back; once hospital 0's updates arrive again,
3. every process on the coordinator's host is SIGKILLed (a power loss): SuperLink, SuperExec,
   ServerApp, ``flwr run``; ``deploy_local(coordinator_restarts=1)`` brings the coordinator
   back as a service manager would: the SuperLink from its database on the same address, the
   run from the ServerApp's checkpoint (``server.checkpoint_every=1``);
4. the hospitals, untouched, reconnect by themselves and the run goes on to its budget.

Needs root (network namespaces): without, it skips and names what is missing.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from fedasync.events import read_events
from fedasync.processes import MARKER_ENV, pids_with_env
from simulations.hosts import HostFederation, available

WHY = available()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(WHY is not None, reason=f"no network namespaces: {WHY}"),
]

CUT_S = 8.0


def _updates(path: Path) -> list[dict]:
    try:
        return [e for e in read_events(path) if e["event"] == "update"]
    except OSError:
        return []


def _wait(what: str, cond, stop: threading.Event, timeout_s: float, notes: dict) -> bool:
    deadline = time.monotonic() + timeout_s
    while not stop.is_set() and time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    notes.setdefault("missed", what)
    return False


def test_a_partition_and_a_coordinator_crash_lose_no_update(small_cfg):
    from simulations.deploy import deploy_local
    from simulations.placement import OnHosts

    cfg = small_cfg(
        "silos.count=2",
        "run.budget_s=30",  # loop seconds: a restart's wall time is not counted
        "data.max_samples=300",
        "server.eval_every=10",
        "server.checkpoint_every=1",
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    metrics = run_dir / "metrics.jsonl"
    notes: dict = {}

    def faults(fed: HostFederation, stop: threading.Event) -> None:
        if not _wait("4 updates", lambda: len(_updates(metrics)) >= 4, stop, 120, notes):
            return
        notes["at_cut"] = len(_updates(metrics))
        fed.partition("hospital0")
        stop.wait(CUT_S)
        notes["at_heal"] = len(_updates(metrics))
        fed.heal("hospital0")

        def back() -> bool:
            return any(e["silo"] == 0 for e in _updates(metrics)[notes["at_heal"] :])

        if not _wait("hospital 0 back after its link", back, stop, 60, notes):
            return
        fed.crash("coordinator")
        notes["before_crash"] = _updates(metrics)  # final: its writer is dead

    with HostFederation(["coordinator", "hospital0", "hospital1"]) as fed:
        stop = threading.Event()
        t = threading.Thread(target=faults, args=(fed, stop), daemon=True)
        t.start()
        try:
            summary = deploy_local(
                cfg, where=OnHosts(fed), coordinator_restarts=1, echo=lambda line: None
            )
        finally:
            stop.set()
            t.join(timeout=30)
        left_in_namespaces = fed.leftovers
    assert "missed" not in notes, f"the run ended before: {notes['missed']}"
    assert left_in_namespaces() == [], "a namespace or link was left behind"
    marker = f"{run_dir / 'deploy'}:"
    assert pids_with_env(MARKER_ENV, marker, prefix=True) == [], "a process was left running"

    # the partition: hospital 1 went on alone; hospital 0 came back without a restart
    during = notes["before_crash"][notes["at_cut"] : notes["at_heal"]]
    assert sum(e["silo"] == 1 for e in during) >= 2, "hospital 1 stalled during the cut"
    assert sum(e["silo"] == 0 for e in during) <= 1  # (a reply uploaded before the cut)
    # the coordinator's restart: from its database and the checkpoint, nothing lost or doubled
    (restart,) = summary["deployment"]["coordinator_restarts"]
    assert restart["resumed"] is True
    events = read_events(metrics)
    resumes = [e for e in events if e["event"] == "resume"]
    assert len(resumes) == 1
    final = [(e["silo"], e["job"]) for e in events if e["event"] == "update"]
    assert len(final) == len(set(final)), "an update applied twice"
    accepted = {(e["silo"], e["job"]) for e in notes["before_crash"]}
    assert accepted <= set(final), f"accepted updates lost: {sorted(accepted - set(final))}"
    after = [e for e in events[events.index(resumes[0]) :] if e["event"] == "update"]
    assert {e["silo"] for e in after} == {0, 1}, "a hospital did not reconnect by itself"
    versions = [e["version"] for e in events if e["event"] == "version"]
    assert versions == list(range(1, len(versions) + 1))  # no gap, no repeat
    assert summary["versions"] == versions[-1] > resumes[0]["version"]
    deploy_json = json.loads((run_dir / "deploy.json").read_text())
    assert deploy_json["coordinator_restarts"] == summary["deployment"]["coordinator_restarts"]
