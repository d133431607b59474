"""The erasure store: durability across crashes, idempotency, the state machine, the audit
log and the change feed."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from server.erasure.states import (
    ALLOWED,
    TERMINAL,
    InvalidTransition,
    State,
    can_transition,
    is_terminal,
)
from server.erasure.store import ErasureStore, RequestNotFound

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path):
    s = ErasureStore(tmp_path / "erasure.sqlite")
    try:
        yield s
    finally:
        s.close()


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_settings_wal_and_full_sync(store):
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_crash_right_after_submit_returns_loses_nothing(tmp_path):
    # Prepare: a child submits, prints the id (the "acknowledgement"), then dies at once
    # without closing the connection or running any cleanup.
    db = tmp_path / "e.sqlite"
    proc = _run(
        f"""
        import os
        from server.erasure.store import ErasureStore
        s = ErasureStore({str(db)!r})
        r, created = s.submit(2, ["a", "b"], "silo-2", 17, idempotency_key="k", reason="gdpr")
        print(r.id, flush=True)
        os._exit(0)
        """
    )
    assert proc.returncode == 0, proc.stderr
    rid = proc.stdout.strip()
    # Execute
    with ErasureStore(db) as s:
        r = s.get(rid)
        audit = s.audit(rid)
        unfinished = s.unfinished()
    # Assert
    assert r is not None and r.state is State.QUEUED
    assert r.sample_ids == ("a", "b") and r.silo == 2 and r.model_version_at_submit == 17
    assert [(a.action, a.to_state, a.requester, a.model_version) for a in audit] == [
        ("submit", State.QUEUED, "silo-2", 17)
    ]
    assert [u.id for u in unfinished] == [rid]


def test_crash_inside_the_transaction_leaves_nothing(tmp_path):
    # The child dies between inserting the request row and committing (while writing the
    # audit row): nothing may remain, since nothing was acknowledged.
    db = tmp_path / "e.sqlite"
    proc = _run(
        f"""
        import os
        from server.erasure.store import ErasureStore
        s = ErasureStore({str(db)!r})
        s._append_audit = lambda *a, **k: os._exit(3)
        s.submit(1, None, "admin", 5)
        """
    )
    assert proc.returncode == 3, proc.stderr
    with ErasureStore(db) as s:
        assert s.list() == [] and s.audit() == [] and s.last_seq == 0


def test_exception_inside_the_transaction_rolls_back(store, monkeypatch):
    r, _ = store.submit(0, ["x"], "admin", 1)

    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(store, "_append_audit", boom)
    with pytest.raises(RuntimeError):
        store.submit(0, ["y"], "admin", 1)
    with pytest.raises(RuntimeError):
        store.transition(r.id, State.ERASING, actor="server", model_version=2)
    monkeypatch.undo()
    assert [x.id for x in store.list()] == [r.id]
    assert store.get(r.id).state is State.QUEUED
    assert len(store.audit()) == 1


def test_idempotency_key(store):
    a, created_a = store.submit(3, ["s1", "s2"], "silo-3", 4, idempotency_key="k1")
    b, created_b = store.submit(3, ["s2", "s1"], "silo-3", 9, idempotency_key="k1")
    assert created_a and not created_b and a == b
    with pytest.raises(ValueError, match="different request"):
        store.submit(3, ["s1"], "silo-3", 4, idempotency_key="k1")
    with pytest.raises(ValueError):
        store.submit(2, ["s1", "s2"], "silo-3", 4, idempotency_key="k1")
    # the key is scoped to the requester
    c, created_c = store.submit(3, ["s1", "s2"], "admin", 4, idempotency_key="k1")
    assert created_c and c.id != a.id
    assert len(store.list()) == 2 and len(store.audit()) == 2


def test_whole_silo_and_dedup(store):
    r, _ = store.submit(1, [], "admin", 0)
    assert r.whole_silo and r.sample_ids == ()
    r2, _ = store.submit(1, ["a", "a", "b"], "admin", 0)
    assert not r2.whole_silo and r2.sample_ids == ("a", "b")
    with pytest.raises(ValueError):
        store.submit(1, ["ok", ""], "admin", 0)


@pytest.mark.parametrize("from_state", list(State))
@pytest.mark.parametrize("to_state", list(State))
def test_transition_table(from_state, to_state):
    allowed = {
        (State.QUEUED, State.ERASING),
        (State.ERASING, State.CALIBRATING),
        (State.ERASING, State.QUEUED),  # its silo went down mid-erasure: tried again later
        (State.CALIBRATING, State.VERIFIED),
        (State.CALIBRATING, State.UNVERIFIED),  # checked: a figure not within its tolerance
        (State.QUEUED, State.FAILED),
        (State.ERASING, State.FAILED),
        (State.CALIBRATING, State.FAILED),
    }
    assert can_transition(from_state, to_state) == ((from_state, to_state) in allowed)
    terminal = {State.VERIFIED, State.UNVERIFIED, State.FAILED}
    assert is_terminal(from_state) == (from_state in terminal)
    assert TERMINAL == {s for s, nxt in ALLOWED.items() if not nxt}


def _walk(store, rid, states, version=10):
    for i, s in enumerate(states):
        store.transition(rid, s, actor="server", model_version=version + i)


def test_store_transitions_happy_path_and_rejections(store):
    r, _ = store.submit(0, ["a"], "silo-0", 10)
    store.transition(r.id, State.ERASING, actor="server", model_version=11, boundary_version=11)
    with pytest.raises(InvalidTransition):
        store.transition(r.id, State.VERIFIED, actor="server", model_version=11)
    store.transition(
        r.id, State.CALIBRATING, actor="server", model_version=12, metrics={"forget_acc": 0.5}
    )
    with pytest.raises(InvalidTransition):  # applied: it can no longer be lost
        store.transition(r.id, State.QUEUED, actor="server", model_version=12)
    done = store.transition(
        r.id, State.VERIFIED, actor="server", model_version=14, metrics={"test_acc": 0.9}
    )
    assert done.state is State.VERIFIED and done.boundary_version == 11
    assert done.metrics == {"forget_acc": 0.5, "test_acc": 0.9}
    for s in State:
        with pytest.raises(InvalidTransition):
            store.transition(r.id, s, actor="server", model_version=15)
    with pytest.raises(RequestNotFound):
        store.transition("nope", State.ERASING, actor="server", model_version=1)
    # rejected transitions wrote nothing
    assert [a.to_state for a in store.audit(r.id)] == [
        State.QUEUED,
        State.ERASING,
        State.CALIBRATING,
        State.VERIFIED,
    ]


def test_requeue_mid_erasure_is_audited_with_its_reason(store):
    r, _ = store.submit(2, None, "silo-2", 5)
    store.transition(r.id, State.ERASING, actor="server", model_version=6)
    why = "silo went down mid-erasure (attempt 1 of 3): crashed; will retry when it returns"
    back = store.transition(r.id, State.QUEUED, actor="server", model_version=7, detail=why)
    assert back.state is State.QUEUED and back.failure_reason == ""
    assert back in store.unfinished() and store.erased(2) == (True, set())
    store.transition(r.id, State.ERASING, actor="server", model_version=8)
    (row,) = store.requeues(r.id)
    assert (row.from_state, row.to_state, row.detail, row.model_version) == (
        State.ERASING,
        State.QUEUED,
        why,
        7,
    )
    assert [e.state for e in store.events_since(0, r.id)] == [
        State.QUEUED,
        State.ERASING,
        State.QUEUED,
        State.ERASING,
    ]


def test_failed_keeps_reason_and_frees_the_samples(store):
    r, _ = store.submit(0, ["a", "b"], "silo-0", 1)
    assert store.erased(0) == (False, {"a", "b"})
    store.transition(r.id, State.ERASING, actor="server", model_version=2)
    failed = store.transition(r.id, State.FAILED, actor="server", model_version=3, detail="oom")
    assert failed.failure_reason == "oom" and failed.state is State.FAILED
    assert store.erased(0) == (False, set())
    store.submit(0, None, "admin", 3)
    assert store.erased(0) == (True, set())


def test_unfinished_after_reopen(tmp_path):
    db = tmp_path / "e.sqlite"
    with ErasureStore(db) as s:
        ids = [s.submit(i, None, "admin", i)[0].id for i in range(5)]
        _walk(s, ids[0], [State.ERASING])
        _walk(s, ids[1], [State.ERASING, State.CALIBRATING, State.VERIFIED])
        _walk(s, ids[2], [State.FAILED])
        _walk(s, ids[3], [State.ERASING, State.CALIBRATING])
    with ErasureStore(db) as s:
        unfinished = s.unfinished()
        assert [r.id for r in unfinished] == [ids[0], ids[3], ids[4]]
        assert [r.state for r in unfinished] == [State.ERASING, State.CALIBRATING, State.QUEUED]
        assert s.last_seq == len(s.audit()) == 5 + 1 + 3 + 1 + 2


def test_audit_log_is_complete_and_append_only(store):
    r, _ = store.submit(4, ["p"], "silo-4", 7, reason="patient withdrew consent")
    _walk(store, r.id, [State.ERASING, State.CALIBRATING, State.VERIFIED], version=8)
    rows = store.audit(r.id)
    assert [a.seq for a in rows] == sorted(a.seq for a in rows)
    assert [(a.from_state, a.to_state, a.model_version, a.actor) for a in rows] == [
        (None, State.QUEUED, 7, "silo-4"),
        (State.QUEUED, State.ERASING, 8, "server"),
        (State.ERASING, State.CALIBRATING, 9, "server"),
        (State.CALIBRATING, State.VERIFIED, 10, "server"),
    ]
    assert all(a.requester == "silo-4" and a.time_ms > 1_600_000_000_000 for a in rows)
    assert rows[0].detail == "patient withdrew consent"
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        store._db.execute("UPDATE audit SET detail = 'x'")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        store._db.execute("DELETE FROM audit")
    assert len(store.audit()) == 4


def test_events_since_and_wait(store):
    a, _ = store.submit(0, None, "admin", 1)
    b, _ = store.submit(1, None, "admin", 1)
    store.transition(a.id, State.ERASING, actor="server", model_version=2)
    events = store.events_since(0)
    assert [(e.seq, e.request_id, e.state) for e in events] == [
        (1, a.id, State.QUEUED),
        (2, b.id, State.QUEUED),
        (3, a.id, State.ERASING),
    ]
    assert [e.seq for e in store.events_since(1, a.id)] == [3]
    assert store.events_since(3) == []
    assert [e.silo for e in events] == [0, 1, 0]
    # wait_for_change wakes on a write from another thread
    assert not store.wait_for_change(3, 0.01)
    t = threading.Timer(0.05, lambda: store.transition(b.id, "erasing", actor="x", model_version=3))
    t.start()
    try:
        assert store.wait_for_change(3, 5.0)
    finally:
        t.join()
    assert store.events_since(3)[0].request_id == b.id


def test_concurrent_submits_are_all_kept(store):
    def work(i):
        for j in range(10):
            store.submit(i, [f"s{j}"], f"silo-{i}", j)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.list()) == 40 and [e.seq for e in store.events_since(0)] == list(range(1, 41))


def test_files_are_private_new_and_old(tmp_path):
    # a new store: the database, its WAL and SHM are 0600 from the start
    new = tmp_path / "new.sqlite"
    with ErasureStore(new) as s:
        s.submit(0, None, "admin", 1)
        modes = {
            x: stat.S_IMODE(new.with_name(new.name + x).stat().st_mode)
            for x in ("", "-wal", "-shm")
        }
    assert modes == {"": 0o600, "-wal": 0o600, "-shm": 0o600}
    # files an older version left world-readable are made private when opened
    old = tmp_path / "old.sqlite"
    for suffix in ("", "-wal", "-shm"):
        old.with_name(old.name + suffix).touch(mode=0o644)
        os.chmod(old.with_name(old.name + suffix), 0o644)
    with ErasureStore(old) as s:
        s.submit(0, None, "admin", 1)
        assert all(
            stat.S_IMODE(old.with_name(old.name + x).stat().st_mode) == 0o600
            for x in ("", "-wal", "-shm")
        )


def test_refusals_keep_the_newest_rows_and_count_all(store, monkeypatch):
    import server.erasure.refusals as refusals_module

    monkeypatch.setattr(refusals_module, "REFUSALS_KEPT", 3)
    for i in range(7):
        store.record_refusal(
            "silo-1", "ipv4:127.0.0.1:1", "/m/Get", "NOT_FOUND", f"r{i}" + "x" * 999
        )
    store.record_refusal("unauthenticated", "p" * 5000, "/m/Submit", "UNAUTHENTICATED", "")
    rows = store.refusals(limit=100)
    assert [r.reason[:2] for r in rows] == ["", "r6", "r5"]
    assert all(len(r.reason) <= refusals_module.REFUSAL_TEXT for r in rows)
    assert len(rows[0].peer) == refusals_module.REFUSAL_TEXT
    assert [(c.who, c.code, c.count) for c in store.refusal_counts()] == [
        ("silo-1", "NOT_FOUND", 7),
        ("unauthenticated", "UNAUTHENTICATED", 1),
    ]
    # refusals are not erasure events: the change feed and the audit log stay empty
    assert store.last_seq == 0 and store.audit() == []
    # and requests are still written with a full sync
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_a_version_1_store_gains_the_new_columns_and_keeps_its_rows(tmp_path):
    db = tmp_path / "v1.sqlite"
    with ErasureStore(db) as s:
        a, _ = s.submit(1, ["a"], "silo-1", 3, idempotency_key="k")
    con = sqlite3.connect(db)  # as version 1 wrote it: no body column
    con.execute("ALTER TABLE requests DROP COLUMN body_sha256")
    con.execute("DROP TABLE refusals")
    con.close()
    with ErasureStore(db) as s:
        again, created = s.submit(1, ["a"], "silo-1", 4, idempotency_key="k")
        assert (again.id, created) == (a.id, False)
        with pytest.raises(ValueError, match="different request"):
            s.submit(1, ["b"], "silo-1", 4, idempotency_key="k")
        s.record_refusal("admin", "p", "/m", "NOT_FOUND", "x")
        assert len(s.refusals()) == 1


def test_whole_silo_for_ids_covering_the_silo_and_its_idempotent_retry(store):
    r, created = store.submit(
        2, ["a", "b"], "silo-2", 5, idempotency_key="k", whole_silo=True, detail="covers all"
    )
    assert created and r.whole_silo and r.sample_ids == ()
    assert store.audit(r.id)[0].detail == "covers all"
    again, created = store.submit(2, ["b", "a"], "silo-2", 6, idempotency_key="k")
    assert again.id == r.id and not created


def test_note_is_audited_without_a_state_change(store):
    r, _ = store.submit(0, ["a"], "silo-0", 1)
    store.transition(r.id, State.ERASING, actor="server", model_version=2)
    store.note(r.id, actor="server", model_version=3, detail="resumed after restart")
    row = store.audit(r.id)[-1]
    assert (row.action, row.from_state, row.to_state, row.actor, row.detail) == (
        "note",
        State.ERASING,
        State.ERASING,
        "server",
        "resumed after restart",
    )
    assert store.get(r.id).state is State.ERASING
    assert store.events_since(0, r.id)[-1].detail == "resumed after restart"
