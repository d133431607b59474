"""The record of refused calls to the erasure service: a capped table in the store's file.

Who (the principal, or ``unauthenticated``), the peer, the method, the status code and a
reason (the status details), each cut to ``REFUSAL_TEXT`` characters; never the caller's raw
input. ``refusals`` keeps the newest ``REFUSALS_KEPT`` rows; ``refusal_counts`` counts every
refusal per (who, method, code), a key of bounded cardinality (principals and methods are
known; peers are not part of it), so a flood of refused calls costs a bounded amount of
disk. Refusals are not erasure events: they are not in the audit log or the change feed.
"""

from __future__ import annotations

import sqlite3
import threading

from server.erasure.records import Refusal, RefusalCount, now_ms

REFUSALS_KEPT = 1000
"""Newest refusal rows kept; older ones live on only in ``refusal_counts``."""
REFUSAL_TEXT = 256
"""Longest who/peer/method/code/reason text stored for a refusal (longer is cut)."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS refusals (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time_ms INTEGER NOT NULL,
    who TEXT NOT NULL,                    -- principal name or 'unauthenticated'
    peer TEXT NOT NULL,
    method TEXT NOT NULL,
    code TEXT NOT NULL,                   -- gRPC status code name
    reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS refusal_counts (
    who TEXT NOT NULL,
    method TEXT NOT NULL,
    code TEXT NOT NULL,
    count INTEGER NOT NULL,
    last_ms INTEGER NOT NULL,
    PRIMARY KEY (who, method, code)
);
"""


def _cut(text: str, limit: int = REFUSAL_TEXT) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class RefusalLog:
    """The refusal tables on the store's connection, behind the store's lock."""

    def __init__(
        self, db: sqlite3.Connection, lock: threading.RLock, *, readonly: bool = False
    ) -> None:
        """The tables on ``db`` (made if absent); ``readonly``: read them as they are (a
        store without them reads as one with no refusals)."""
        self._db, self._lock = db, lock
        with self._lock:
            if readonly:
                found = db.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'refusals'"
                ).fetchone()
                self._present = found is not None
            else:
                self._db.executescript(SCHEMA)
                self._present = True

    def record(self, who: str, peer: str, method: str, code: str, reason: str) -> None:
        """Keep one refused call; drop rows beyond the newest ``REFUSALS_KEPT``; count it.

        Not synced to disk on its own (WAL with ``synchronous=NORMAL`` for this write): a
        flood of refusals must not slow the durable writes, and a crash may lose the last
        refusals, never a request. The next durable write syncs them along."""
        texts = [_cut(x) for x in (who, peer, method, code, reason)]
        with self._lock:
            self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                self._write(now_ms(), *texts)
            finally:
                self._db.execute("PRAGMA synchronous=FULL")

    def _write(self, t: int, who: str, peer: str, method: str, code: str, reason: str) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            cur = self._db.execute(
                "INSERT INTO refusals (time_ms, who, peer, method, code, reason)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (t, who, peer, method, code, reason),
            )
            self._db.execute(
                "INSERT INTO refusal_counts (who, method, code, count, last_ms)"
                " VALUES (?, ?, ?, 1, ?) ON CONFLICT (who, method, code)"
                " DO UPDATE SET count = count + 1, last_ms = excluded.last_ms",
                (who, method, code, t),
            )
            self._db.execute(
                "DELETE FROM refusals WHERE id <= ?", ((cur.lastrowid or 0) - REFUSALS_KEPT,)
            )
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def rows(self, limit: int = 100) -> list[Refusal]:
        """The newest refused calls, newest first."""
        if not self._present:
            return []
        with self._lock:
            rows = self._db.execute(
                "SELECT time_ms, who, peer, method, code, reason FROM refusals"
                " ORDER BY id DESC LIMIT ?",
                (limit,),
            ).fetchall()
        return [Refusal(*r) for r in rows]

    def naming(self, text: str, limit: int = 100) -> list[Refusal]:
        """The newest kept refused calls whose reason holds ``text``, newest first: the calls
        refused about one request (its id is in the status details the service wrote;
        a call refused before its request id was read, e.g. unauthenticated, does not name
        it)."""
        if not self._present or not text:
            return []
        with self._lock:
            rows = self._db.execute(
                "SELECT time_ms, who, peer, method, code, reason FROM refusals"
                " WHERE instr(reason, ?) > 0 ORDER BY id DESC LIMIT ?",
                (text, limit),
            ).fetchall()
        return [Refusal(*r) for r in rows]

    def counts(self) -> list[RefusalCount]:
        """How many calls were refused per (who, method, code), most frequent first."""
        if not self._present:
            return []
        with self._lock:
            rows = self._db.execute(
                "SELECT who, method, code, count, last_ms FROM refusal_counts"
                " ORDER BY count DESC, who, method, code"
            ).fetchall()
        return [RefusalCount(*r) for r in rows]
