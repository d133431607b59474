"""The server loop with thousands of instantly answering silos: the work per update must not
grow with the number of silos (benchmarks/server_scale.py measures the rates and memory).

Not timed (machines are noisy): counted. Every scan over the jobs in flight reads an attribute
of each job, or iterates the ``InFlight`` mapping; with 2,000 silos either would cost thousands
per update, where the loop needs a few dozen.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

import server.loop
from fedasync.clock import InFlight
from fedasync.events import read_events
from server.dispatch import MAX_SNAPSHOTS
from server.intake import Job

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "server_scale.py"
_spec = importlib.util.spec_from_file_location("server_scale", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["server_scale"] = bench
_spec.loader.exec_module(bench)


class _CountingJob(Job):
    """A job that counts every attribute read of every job."""

    reads = 0

    def __getattribute__(self, name):
        _CountingJob.reads += 1
        return super().__getattribute__(name)


def test_work_per_update_does_not_grow_with_2000_silos(tmp_path, monkeypatch):
    # Prepare: count attribute reads of jobs and full iterations of the jobs in flight
    silos, versions = 2000, 1000
    monkeypatch.setattr(server.loop, "Job", _CountingJob)
    _CountingJob.reads = 0
    scans = {"n": 0}
    for name in ("__iter__", "values", "items"):
        original = getattr(InFlight, name)

        def counted(self, _original=original):
            scans["n"] += 1
            return _original(self)

        monkeypatch.setattr(InFlight, name, counted)
    srv = bench.make_server(silos, versions, tmp_path, [])
    most_sent = {"n": 0}
    accept = srv.stats.accept

    def watched_accept(*a, **k):
        most_sent["n"] = max(most_sent["n"], len(srv.jobs.sent))
        accept(*a, **k)

    srv.stats.accept = watched_accept
    # Execute
    srv.run()
    srv.events.close()
    # Assert
    # every silo once, and one job per update after, but the last (no work after the cap)
    jobs_sent = silos + versions - 1
    assert srv.stats.updates_applied == versions
    assert _CountingJob.reads / jobs_sent < 60, "a scan over every job in flight came back"
    assert scans["n"] <= 2, "the jobs in flight were iterated in the loop"
    assert most_sent["n"] <= MAX_SNAPSHOTS == 64
    assert len(srv.jobs.inflight) == silos - 1 and len(srv.jobs.unanswered) <= 1


def _scan_first_event(self):
    first = min(j.finishes_at for j in self._jobs.values())
    return sorted(
        m
        for m, j in self._jobs.items()
        if math.isclose(j.finishes_at, first, rel_tol=0, abs_tol=1e-9)
    )


def _scan_earliest(self):
    return min((j.finishes_at for j in self._jobs.values()), default=math.inf)


def _trace(tmp_path: Path, profile: str) -> list[tuple]:
    overrides = [f"lab.speed.profile={profile}", "lab.speed.jitter=0"]
    srv = bench.make_server(200, 600, tmp_path, overrides)
    srv.run()
    srv.events.close()
    events = read_events(tmp_path / "metrics.jsonl")
    return [(e["silo"], e["job"], e["t"]) for e in events if e["event"] == "update"]


@pytest.mark.parametrize("profile", ["uniform", "lognormal"])
def test_the_heap_takes_the_replies_a_scan_would(tmp_path, monkeypatch, profile):
    # Prepare: uniform speeds, no jitter: every round of 200 replies finishes at once (ties)
    (tmp_path / "heap").mkdir()
    (tmp_path / "scan").mkdir()
    # Execute
    heap = _trace(tmp_path / "heap", profile)
    monkeypatch.setattr(InFlight, "first_event", _scan_first_event)
    monkeypatch.setattr(InFlight, "earliest", _scan_earliest)
    scan = _trace(tmp_path / "scan", profile)
    # Assert
    assert len(heap) == 600 and heap == scan
