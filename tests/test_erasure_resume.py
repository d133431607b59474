"""A server restart mid-erasure is in the audit log, and the request keeps its submit time
(issue 9): the latency a requester sees is not cut short by the restart."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from inprocess import InProcessGrid

from clients.app import app as client_app
from fedasync.events import read_events
from server.app import run_server
from server.erasure.store import ErasureStore, now_ms
from server.unlearning import ErasureCoordinator

ERASE = (
    "lab.erasure.relearn_versions=4",
    "unlearning.steps=5",
    "server.eval_every=5",
    "erasures=[{silo: 1, at_s: 8}]",
)


def _coordinator(kind: str, opened_ms: int, seen: dict[str, float]) -> SimpleNamespace:
    """What ``ErasureCoordinator._submitted`` reads of its coordinator."""
    clock = SimpleNamespace(now=100.0, kind=kind, realtime=kind == "wall")
    return SimpleNamespace(
        run=SimpleNamespace(clock=clock), store=SimpleNamespace(opened_ms=opened_ms), seen=seen
    )


def test_submit_time_of_a_request_from_before_the_restart():
    opened = now_ms()
    before = SimpleNamespace(id="a", created_at_ms=opened - 30_000)  # 30 s before the restart
    after = SimpleNamespace(id="b", created_at_ms=opened + 1)
    submitted = ErasureCoordinator._submitted
    # made in this process: first seen by poll, as before
    assert submitted(_coordinator("virtual", opened, {"b": 42.0}), after) == (42.0, None)
    assert submitted(_coordinator("wall", opened, {"b": 42.0}), after) == (42.0, None)
    # before a restart, on the wall clock: its creation time on the clock (30 s or more ago)
    t, wall = submitted(_coordinator("wall", opened, {"a": 99.0}), before)
    assert wall is None and t <= 100.0 - 30.0
    # before a restart, on the virtual clock: unknown, so the wall-clock creation time is kept
    t, wall = submitted(_coordinator("virtual", opened, {"a": 99.0}), before)
    assert (t, wall) == (99.0, opened - 30_000)


def test_restart_mid_erasure_is_audited_and_latency_counts_from_submission(small_cfg):
    first = small_cfg("run.max_versions=12", *ERASE)
    run_dir = Path(first.run.out_dir) / first.run.name
    summary = run_server(InProcessGrid(client_app, 3), first, run_dir)
    (req,) = summary["erasures"]["requests"]
    assert req["state"] == "erasing", "the run stopped mid-erasure"
    second = small_cfg("run.max_versions=40", "run.resume=true", *ERASE)
    summary = run_server(InProcessGrid(client_app, 3), second, run_dir)
    (row,) = summary["erasures"]["applied"]
    with ErasureStore(run_dir / "erasures.sqlite") as store:
        audit = store.audit(req["id"])
        created = store.get(req["id"]).created_at_ms
    # the restart is in the audit log: by the server, at the version it resumed from
    (resume,) = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "resume"]
    removals = [a for a in audit if a.action == "note" and "removal" in a.detail]
    assert len(removals) == 1 and removals[0].model_version <= resume["version"]  # (once)
    notes = [a for a in audit if a.action == "note" and a not in removals]
    assert [(a.actor, a.to_state.value, a.model_version) for a in notes] == [
        ("server", "erasing", resume["version"])
    ]
    assert notes[0].detail.startswith("resumed after restart")
    # simulated time before the restart is unknown: the latency is on the wall clock, from
    # the request's creation to the erasure being in the model, and it says so
    (applied,) = [
        a for a in audit if a.action == "transition" and a.to_state.value == "calibrating"
    ]
    assert row["latency_clock"] == "wall"
    assert row["erasure_latency_s"] == (applied.time_ms - created) / 1000
    assert applied.time_ms - created > applied.time_ms - notes[0].time_ms  # not from the resume


def test_erasing_request_whose_silo_is_gone_after_a_restart_goes_back_to_queued(tmp_path):
    # Prepare: silo 2 was erasing when the server stopped; the restarted server's roster
    # has silos 0 and 1 only, and the erasure never reached a checkpoint
    with ErasureStore(tmp_path / "erasures.sqlite") as store:
        req, _ = store.submit(2, None, "admin", 3, whole_silo=True)
        store.transition(req.id, "erasing", actor="server", model_version=4)
        co = object.__new__(ErasureCoordinator)
        co.store, co.applied, co.active = store, {}, {}  # what reconcile reads
        co.model, co.run = SimpleNamespace(version=7), SimpleNamespace(roster={0: 10, 1: 11})

        # Execute
        co.reconcile()

        # Assert: queued again (poll starts it when silo 2 is back), the audit row says why
        # and it does not count as a lost attempt
        assert store.get(req.id).state.value == "queued"
        (row,) = store.requeues(req.id)
        assert row.model_version == 7 and "not in the roster" in row.detail
