"""Durable store of erasure requests and their append-only audit log (embedded SQLite).

Why SQLite: a request must be on disk before the service acknowledges it, and a restart
must find every unfinished request again. Each write (a submit, a state change) is ONE
transaction that holds both the request row and its audit row, committed with
``synchronous=FULL`` in WAL mode before the call returns; a crash either loses the whole
write (never acknowledged) or keeps all of it.

The audit table doubles as the change feed: its ``seq`` is a global, strictly increasing
event number, ``events_since`` reads it, and ``changed`` (a ``threading.Condition``) is
notified after every commit so a ``Watch`` stream can block instead of polling. SQL
triggers make the audit table append-only.

One connection, shared by all threads behind a lock: erasure traffic is a handful of
requests, so simplicity beats concurrency here.

The database and its ``-wal``/``-shm`` files are private (mode 0600, like the tokens and
checkpoints): the file is created 0600 before SQLite opens it, SQLite gives the WAL and SHM
the database's mode, and files left by an older version are chmod-ed on open.

Refused calls go to a capped table in the same file (``refusals.RefusalLog``).

An audit row may carry **facts**: named strings recorded in the same transaction
(``audit_facts``, append-only like the audit): the global model's SHA-256 before and after the
erasure and when verified, and the calibration in force, so that an erasure certificate
(``certificate.py``) can be regenerated from this file later. ``readonly=True`` opens an
existing store without writing to it (a certificate built offline, beside a running server).

One file (over 500 lines) because every method is a transaction or read on the one
connection under the one lock, and the write path's guarantees (request and audit row in one
commit, then ``changed``) are checked here in one place; the row types and the refusal table
are already apart (``records``, ``refusals``).
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import sqlite3
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from server.erasure.limits import quoted
from server.erasure.records import (
    AuditRow,
    Event,
    Refusal,
    RefusalCount,
    Request,
    RequestNotFound,
    now_ms,
)
from server.erasure.refusals import RefusalLog
from server.erasure.states import UNFINISHED, State, check_transition

__all__ = [
    "AuditRow",
    "ErasureStore",
    "Event",
    "Refusal",
    "RefusalCount",
    "Request",
    "RequestNotFound",
    "now_ms",
]

SCHEMA_VERSION = 3

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id TEXT PRIMARY KEY,
    silo INTEGER NOT NULL,
    sample_ids TEXT NOT NULL,             -- JSON list; empty with whole_silo = 1
    whole_silo INTEGER NOT NULL,
    state TEXT NOT NULL,
    failure_reason TEXT NOT NULL DEFAULT '',
    requester TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    idempotency_key TEXT,
    created_at_ms INTEGER NOT NULL,
    updated_at_ms INTEGER NOT NULL,
    model_version_at_submit INTEGER NOT NULL,
    boundary_version INTEGER NOT NULL DEFAULT -1,
    metrics TEXT NOT NULL DEFAULT '{}',   -- JSON object of floats
    body_sha256 TEXT                      -- what was asked (idempotency); NULL before v2
);
CREATE UNIQUE INDEX IF NOT EXISTS requests_idempotency
    ON requests (requester, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS requests_silo ON requests (silo, state);
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    time_ms INTEGER NOT NULL,
    request_id TEXT NOT NULL REFERENCES requests (id),
    requester TEXT NOT NULL,              -- who asked for the erasure
    actor TEXT NOT NULL,                  -- who made this change (requester on submit)
    action TEXT NOT NULL,                 -- 'submit' | 'transition' | 'note'
    from_state TEXT,                      -- NULL on submit
    to_state TEXT NOT NULL,
    model_version INTEGER NOT NULL,
    detail TEXT NOT NULL DEFAULT '',
    metrics TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS audit_request ON audit (request_id, seq);
CREATE TRIGGER IF NOT EXISTS audit_no_update BEFORE UPDATE ON audit
    BEGIN SELECT RAISE(ABORT, 'audit log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS audit_no_delete BEFORE DELETE ON audit
    BEGIN SELECT RAISE(ABORT, 'audit log is append-only'); END;
CREATE TABLE IF NOT EXISTS audit_facts (  -- since version 3
    seq INTEGER NOT NULL REFERENCES audit (seq),
    key TEXT NOT NULL,                    -- e.g. 'model_sha256'
    value TEXT NOT NULL,
    PRIMARY KEY (seq, key)
);
CREATE TRIGGER IF NOT EXISTS audit_facts_no_update BEFORE UPDATE ON audit_facts
    BEGIN SELECT RAISE(ABORT, 'audit log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS audit_facts_no_delete BEFORE DELETE ON audit_facts
    BEGIN SELECT RAISE(ABORT, 'audit log is append-only'); END;
"""


def _private(path: str) -> None:
    """Create ``path`` empty with mode 0600 if absent; make it and its WAL/SHM 0600."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    for name in (path, path + "-wal", path + "-shm"):
        if os.path.exists(name):
            os.chmod(name, 0o600)


def _body_sha256(silo: int, ids: Iterable[str], reason: str) -> str:
    """A fingerprint of what a submit asked for (the ids as given, not as stored)."""
    return hashlib.sha256(json.dumps([silo, sorted(ids), reason]).encode()).hexdigest()


def _normalise_ids(sample_ids: Iterable[str] | None) -> tuple[str, ...]:
    """Deduplicate, keeping the first-seen order; reject empty ids."""
    ids = tuple(dict.fromkeys(sample_ids or ()))
    if any(not isinstance(s, str) or not s for s in ids):
        raise ValueError("sample ids must be non-empty strings")
    return ids


class ErasureStore:
    """Erasure requests and their audit log in one SQLite file (``":memory:"`` for tests)."""

    def __init__(self, path: str | Path, *, readonly: bool = False) -> None:
        """Open (or create) the store at ``path``; ``readonly``: open an existing file for
        reading only (FileNotFoundError when there is none), changing nothing in it."""
        self.path = str(path)
        self.opened_ms = now_ms()
        """When this store was opened: a request created before was made before a restart."""
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)
        """Notified after every committed write; see ``wait_for_change``."""
        if readonly:
            self._open_readonly()
            return
        if self.path != ":memory:" and not self.path.startswith("file:"):
            _private(self.path)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        self.refusal_log = RefusalLog(self._db, self._lock)
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(requests)")}
        if "body_sha256" not in columns:  # a version-1 store
            self._db.execute("ALTER TABLE requests ADD COLUMN body_sha256 TEXT")
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        if self.path != ":memory:" and not self.path.startswith("file:"):
            _private(self.path)  # the WAL and SHM now exist
        self._has_facts = True
        self._last_seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM audit").fetchone()[0]

    def _open_readonly(self) -> None:
        """``__init__`` with ``readonly``: SQLite's read-only mode, no schema or pragma written
        (a store older than version 3 has no facts: its rows read with none)."""
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"no erasure store at {self.path}")
        uri = "file:" + urllib.parse.quote(os.path.abspath(self.path)) + "?mode=ro"
        self._db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master")}
        if "audit" not in tables:
            self._db.close()
            raise ValueError(f"{self.path} is not an erasure store (no audit table)")
        self.refusal_log = RefusalLog(self._db, self._lock, readonly=True)
        self._has_facts = "audit_facts" in tables
        self._last_seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM audit").fetchone()[0]

    # -- writes ------------------------------------------------------------------------

    def submit(
        self,
        silo: int,
        sample_ids: list[str] | None,
        requester: str,
        model_version: int,
        idempotency_key: str | None = None,
        reason: str = "",
        *,
        detail: str | None = None,
        whole_silo: bool = False,
    ) -> tuple[Request, bool]:
        """Persist a new request (state ``queued``) and its audit row in one transaction.

        Returns ``(request, created)``. The commit happens before this returns, so the caller
        may acknowledge afterwards. A known ``idempotency_key`` of the same requester returns
        the stored request with ``created=False``; the same key with a different body raises
        ``ValueError``. ``detail`` goes into the audit row (default: ``reason``).

        No ``sample_ids`` means the whole silo. ``whole_silo=True`` with sample ids stores a
        whole-silo request for ids that cover the silo (the ids as asked still decide what
        an idempotent retry must repeat).
        """
        ids = _normalise_ids(sample_ids)
        key = idempotency_key or None
        body = _body_sha256(silo, ids, reason)
        whole = whole_silo or not ids
        with self._transaction() as db:
            if key is not None:
                row = db.execute(
                    "SELECT * FROM requests WHERE requester = ? AND idempotency_key = ?",
                    (requester, key),
                ).fetchone()
                if row is not None:
                    existing = _request(row)
                    if row["body_sha256"] is not None:
                        same = row["body_sha256"] == body
                    else:  # written before version 2
                        same = (
                            existing.silo == silo
                            and sorted(existing.sample_ids) == sorted(ids)
                            and existing.reason == reason
                        )
                    if not same:
                        raise ValueError(
                            f"idempotency key {quoted(key)} was used for a different "
                            f"request ({existing.id})"
                        )
                    return existing, False
            rid, t = uuid.uuid4().hex, now_ms()
            db.execute(
                "INSERT INTO requests (id, silo, sample_ids, whole_silo, state, requester,"
                " reason, idempotency_key, created_at_ms, updated_at_ms,"
                " model_version_at_submit, body_sha256)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    rid,
                    silo,
                    json.dumps(() if whole else ids),
                    int(whole),
                    State.QUEUED.value,
                    requester,
                    reason,
                    key,
                    t,
                    t,
                    model_version,
                    body,
                ),
            )
            self._append_audit(
                db,
                t,
                rid,
                requester,
                requester,
                "submit",
                None,
                State.QUEUED,
                model_version,
                reason if detail is None else detail,
                {},
            )
            request = self._get(rid)
        assert request is not None
        return request, True

    def transition(
        self,
        id: str,
        to_state: State | str,
        *,
        actor: str,
        model_version: int,
        detail: str = "",
        boundary_version: int | None = None,
        metrics: dict[str, float] | None = None,
        facts: dict[str, str] | None = None,
    ) -> Request:
        """Move request ``id`` to ``to_state`` and append the audit row, in one transaction.

        Raises ``InvalidTransition`` for a move the lifecycle forbids and ``RequestNotFound``
        for an unknown id. ``metrics`` are merged into the request's; for ``failed`` the
        ``detail`` becomes the ``failure_reason``. ``facts`` (named strings: the model's
        SHA-256, the calibration in force) are kept with the audit row (``AuditRow.facts``).
        """
        to_state = State(to_state)
        new_metrics = {k: float(v) for k, v in (metrics or {}).items()}
        with self._transaction() as db:
            current = self._get(id)
            if current is None:
                raise RequestNotFound(id)
            check_transition(current.state, to_state)
            t = now_ms()
            db.execute(
                "UPDATE requests SET state = ?, updated_at_ms = ?, failure_reason = ?,"
                " boundary_version = ?, metrics = ? WHERE id = ?",
                (
                    to_state.value,
                    t,
                    detail if to_state is State.FAILED else current.failure_reason,
                    current.boundary_version if boundary_version is None else boundary_version,
                    json.dumps({**current.metrics, **new_metrics}),
                    id,
                ),
            )
            self._append_audit(
                db,
                t,
                id,
                current.requester,
                actor,
                "transition",
                current.state,
                to_state,
                model_version,
                detail,
                new_metrics,
                facts,
            )
            request = self._get(id)
        assert request is not None
        return request

    def note(self, id: str, *, actor: str, model_version: int, detail: str) -> Request:
        """Append an audit row (action ``note``) that changes no state, e.g. a request
        resumed after a restart. It is also a change-feed event (in the current state)."""
        with self._transaction() as db:
            current = self._get(id)
            if current is None:
                raise RequestNotFound(id)
            self._append_audit(
                db,
                now_ms(),
                id,
                current.requester,
                actor,
                "note",
                current.state,
                current.state,
                model_version,
                detail,
                {},
            )
        return current

    def record_refusal(self, who: str, peer: str, method: str, code: str, reason: str) -> None:
        """``RefusalLog.record``: keep one refused call (bounded, not synced on its own)."""
        self.refusal_log.record(who, peer, method, code, reason)

    # -- reads -------------------------------------------------------------------------

    def refusals(self, limit: int = 100) -> builtins.list[Refusal]:
        """``RefusalLog.rows``: the newest refused calls, newest first."""
        return self.refusal_log.rows(limit)

    def refusals_naming(self, text: str, limit: int = 100) -> builtins.list[Refusal]:
        """``RefusalLog.naming``: the newest kept refused calls whose reason holds ``text``
        (a request id), newest first."""
        return self.refusal_log.naming(text, limit)

    def refusal_counts(self) -> builtins.list[RefusalCount]:
        """``RefusalLog.counts``: refused calls per (who, method, code), most first."""
        return self.refusal_log.counts()

    def get(self, id: str) -> Request | None:
        """The request with ``id``, or None."""
        with self._lock:
            return self._get(id)

    def list(
        self, silo: int | None = None, states: Iterable[State | str] | None = None
    ) -> builtins.list[Request]:
        """Requests oldest first, optionally only of ``silo`` and/or in ``states``."""
        sql, args = "SELECT * FROM requests WHERE 1 = 1", builtins.list[object]()
        if silo is not None:
            sql += " AND silo = ?"
            args.append(silo)
        if states is not None:
            values = sorted({State(s).value for s in states})
            sql += f" AND state IN ({', '.join('?' * len(values))})"
            args.extend(values)
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY created_at_ms, rowid", args).fetchall()
        return [_request(r) for r in rows]

    def unfinished(self) -> builtins.list[Request]:
        """Queued, erasing and calibrating requests, oldest first: what a restart resumes."""
        return self.list(states=UNFINISHED)

    def erased(self, silo: int) -> tuple[bool, set[str]]:
        """``(whole, ids)``: is the whole silo covered by a non-failed request, and which
        sample ids are covered by non-failed sample-level requests."""
        whole, ids = False, set[str]()
        for r in self.list(silo=silo):
            if r.state is State.FAILED:
                continue
            whole |= r.whole_silo
            ids.update(r.sample_ids)
        return whole, ids

    def audit(self, request_id: str | None = None) -> builtins.list[AuditRow]:
        """The audit log in order, for one request or all."""
        sql, args = "SELECT * FROM audit", tuple[str, ...]()
        if request_id is not None:
            sql, args = sql + " WHERE request_id = ?", (request_id,)
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY seq", args).fetchall()
            facts = self._facts(request_id)
        return [
            AuditRow(**_decode(r), facts=facts.get(r["seq"], {}))  # type: ignore[arg-type]
            for r in rows
        ]

    def _facts(self, request_id: str | None) -> dict[int, dict[str, str]]:
        """The facts of the audit rows (of ``request_id``, or all), by audit seq."""
        if not self._has_facts:
            return {}
        sql = "SELECT f.seq, f.key, f.value FROM audit_facts f"
        args: tuple[str, ...] = ()
        if request_id is not None:
            sql += " JOIN audit a ON a.seq = f.seq WHERE a.request_id = ?"
            args = (request_id,)
        out: dict[int, dict[str, str]] = {}
        for seq, key, value in self._db.execute(sql + " ORDER BY f.seq, f.key", args):
            out.setdefault(seq, {})[key] = value
        return out

    def requeues(self, request_id: str) -> builtins.list[AuditRow]:
        """The audit rows that sent request ``request_id`` back from ``erasing`` to ``queued``
        (its silo went down mid-erasure), in order."""
        return [
            a
            for a in self.audit(request_id)
            if a.from_state is State.ERASING and a.to_state is State.QUEUED
        ]

    def events_since(
        self, seq: int, request_id: str | None = None, limit: int | None = None
    ) -> builtins.list[Event]:
        """Change-feed entries with ``seq`` strictly greater than ``seq``, in order."""
        sql = (
            "SELECT a.seq, a.request_id, r.silo, a.to_state AS state, a.model_version,"
            " a.time_ms, a.detail, a.actor, a.metrics"
            " FROM audit a JOIN requests r ON r.id = a.request_id"
            " WHERE a.seq > ?"
        )
        args: builtins.list[object] = [seq]
        if request_id is not None:
            sql += " AND a.request_id = ?"
            args.append(request_id)
        sql += " ORDER BY a.seq"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [Event(**_decode(r)) for r in rows]  # type: ignore[arg-type]

    @property
    def last_seq(self) -> int:
        """The newest event's seq (0 when empty)."""
        with self._lock:
            return self._last_seq

    def wait_for_change(
        self, after_seq: int, timeout: float, stop: Callable[[], bool] | None = None
    ) -> bool:
        """Block until an event newer than ``after_seq`` exists, ``stop()`` is true (checked
        on every ``wake``) or ``timeout`` seconds pass."""
        with self.changed:
            return self.changed.wait_for(
                lambda: self._last_seq > after_seq or (stop is not None and stop()), timeout
            )

    def wake(self) -> None:
        """Wake every ``wait_for_change`` to check its ``stop`` (a Watch whose client left)."""
        with self.changed:
            self.changed.notify_all()

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._db.close()

    def __enter__(self) -> ErasureStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT under the lock; roll back on any exception; notify
        ``changed`` after a commit that appended audit rows."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            last = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM audit").fetchone()[0]
            if last != self._last_seq:
                self._last_seq = last
                self.changed.notify_all()

    def _append_audit(
        self,
        db: sqlite3.Connection,
        time_ms: int,
        request_id: str,
        requester: str,
        actor: str,
        action: str,
        from_state: State | None,
        to_state: State,
        model_version: int,
        detail: str,
        metrics: dict[str, float],
        facts: dict[str, str] | None = None,
    ) -> None:
        cur = db.execute(
            "INSERT INTO audit (time_ms, request_id, requester, actor, action, from_state,"
            " to_state, model_version, detail, metrics) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                time_ms,
                request_id,
                requester,
                actor,
                action,
                None if from_state is None else from_state.value,
                to_state.value,
                model_version,
                detail,
                json.dumps(metrics),
            ),
        )
        for key, value in sorted((facts or {}).items()):
            db.execute(
                "INSERT INTO audit_facts (seq, key, value) VALUES (?, ?, ?)",
                (cur.lastrowid, str(key), str(value)),
            )

    def _get(self, id: str) -> Request | None:
        row = self._db.execute("SELECT * FROM requests WHERE id = ?", (id,)).fetchone()
        return None if row is None else _request(row)

    def _find_by_key(self, requester: str, key: str) -> Request | None:
        row = self._db.execute(
            "SELECT * FROM requests WHERE requester = ? AND idempotency_key = ?", (requester, key)
        ).fetchone()
        return None if row is None else _request(row)

    def find_by_key(self, requester: str, key: str) -> Request | None:
        """The request ``requester`` submitted with idempotency key ``key``, if any."""
        with self._lock:
            return self._find_by_key(requester, key)


def _decode(row: sqlite3.Row) -> dict[str, object]:
    """A row as dataclass keyword arguments: JSON columns parsed, states as ``State``."""
    d = dict(row)
    d.pop("body_sha256", None)
    for key in ("state", "to_state", "from_state"):
        if d.get(key) is not None:
            d[key] = State(d[key])
    if "sample_ids" in d:
        d["sample_ids"] = tuple(json.loads(d["sample_ids"]))
        d["whole_silo"] = bool(d["whole_silo"])
    d["metrics"] = json.loads(d["metrics"])
    return d


def _request(row: sqlite3.Row) -> Request:
    return Request(**_decode(row))  # type: ignore[arg-type]
