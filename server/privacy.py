"""The server's side of privacy: each silo's reported DP-SGD epsilon, silos out of budget, and
the ledger of central DP (server-side noise, ``server.dp.*``; see the end of this module).

Every DP train reply carries the silo's accumulated epsilon (``dp-epsilon``, at ``dp-delta``);
the server keeps the latest per silo (``per_silo[silo]["dp_epsilon"]`` in summary.json, and on
the ``update`` event), logs it, and counts it whether or not the update itself is accepted: a
rejected update was still trained on the silo's data. A silo that has spent its budget replies
with a typed refusal instead of an update; the server stops sending it work, logs why in one
line and writes a ``silo_stopped`` event. A refusal is not a fault: nothing is counted as
rejected. The value is what the silo says; the server cannot check it (the silo's ledger and
data never leave it).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import Message

from fedasync.privacy import gaussian_epsilon
from protocol import keys as P
from protocol.keys import DP_DELTA, DP_EPSILON, REFUSAL, REFUSAL_DETAIL

if TYPE_CHECKING:
    from server.intake import Job
    from server.loop import AsyncServer

log = logging.getLogger("fedasync.server")


def reported_epsilon(reply: Message) -> tuple[float, float] | None:
    """``(epsilon, delta)`` a train reply reports, or None (no DP, an error, malformed)."""
    if reply.has_error() or P.METRICS not in reply.content:
        return None
    metrics: Any = reply.content[P.METRICS]
    try:
        return float(metrics[DP_EPSILON]), float(metrics.get(DP_DELTA, float("nan")))
    except (KeyError, TypeError, ValueError):
        return None


def refusal(reply: Message) -> tuple[str, str] | None:
    """``(reason, detail)`` when a train reply refuses the work, else None."""
    if reply.has_error() or P.CONFIG not in reply.content:
        return None
    cfg: Any = reply.content[P.CONFIG]
    if REFUSAL not in cfg:
        return None
    return str(cfg[REFUSAL]), str(cfg.get(REFUSAL_DETAIL, ""))[:300]


def take_privacy(
    srv: AsyncServer, job: Job, reply: Message, eps: tuple[float, float] | None
) -> bool:
    """Note the epsilon ``reply`` reports (``eps``: ``reported_epsilon(reply)``) for ``job``'s
    silo; True when the silo refused the work (it is then stopped: never sent training again
    in this run)."""
    if eps is not None:
        srv.per_silo[job.silo]["dp_epsilon"] = eps[0]
        log.info(
            "silo %d privacy: epsilon %.4g (delta %g) after job %d",
            job.silo,
            eps[0],
            eps[1],
            job.job_id,
        )
    why = refusal(reply)
    if why is None:
        return False
    reason, detail = why
    srv.stopped[job.silo] = reason
    log.warning("silo %d stopped training (job %d): %s: %s", job.silo, job.job_id, reason, detail)
    srv.events.write(
        "silo_stopped",
        t=srv.clock.now,
        version=srv.version,
        silo=job.silo,
        job=job.job_id,
        reason=reason,
        detail=detail,
        **({"dp_epsilon": eps[0]} if eps is not None else {}),
    )
    return True


# ---------------------------------------------------------------- central DP
CENTRAL_SCHEMA = """
CREATE TABLE IF NOT EXISTS releases (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    silo INTEGER NOT NULL,
    noise_multiplier REAL NOT NULL CHECK (noise_multiplier > 0),
    version INTEGER NOT NULL,
    run TEXT NOT NULL,
    recorded_at REAL NOT NULL
);
"""

CENTRAL_BUDGET = "central_privacy_budget_exhausted"
"""Why a silo is stopped when one more release would take its central epsilon past budget."""


class CentralLedger:
    """Every release of the global model each silo's data took part in (central DP), in SQLite.

    One row per silo per release (a fold in FedAsync, a flush in FedBuff), written in one
    transaction *before* the new model can be sent anywhere: a crash in between over-counts,
    never under-counts. A resumed run re-does folds after its checkpoint; their first releases
    were real (the models went out), so the ledger is never rolled back. The file outlives
    runs (``server.dp.ledger``): a silo's central epsilon composes over every run that used
    the same ledger. WAL, ``synchronous=FULL``; counts are cached in memory, since only this
    process writes during a run.
    """

    def __init__(self, path: Path, run: str, noise_multiplier: float, delta: float):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run, self.noise_multiplier, self.delta = run, float(noise_multiplier), delta
        self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(CENTRAL_SCHEMA)
        self._counts: dict[int, dict[float, int]] = defaultdict(dict)
        for silo, sigma, n in self._db.execute(
            "SELECT silo, noise_multiplier, COUNT(*) FROM releases GROUP BY silo, noise_multiplier"
        ):
            self._counts[int(silo)][float(sigma)] = int(n)

    def close(self) -> None:
        self._db.close()

    def releases(self, silo: int) -> int:
        """How many releases silo ``silo``'s data has taken part in (all runs of this ledger)."""
        return sum(self._counts.get(silo, {}).values())

    def epsilon(self, silo: int, extra: dict[float, int] | None = None) -> float:
        """Silo ``silo``'s central epsilon at the ledger's delta (plus ``extra`` releases)."""
        counts = dict(self._counts.get(silo, {}))
        for sigma, n in (extra or {}).items():
            counts[sigma] = counts.get(sigma, 0) + n
        return gaussian_epsilon(counts, self.delta)

    def record(self, silos: list[int], version: int) -> None:
        """One release at this run's noise multiplier for each of ``silos``, durably, all or
        none."""
        noise_multiplier = self.noise_multiplier
        now = time.time()
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.executemany(
                "INSERT INTO releases (silo, noise_multiplier, version, run, recorded_at) "
                "VALUES (?, ?, ?, ?, ?)",
                [(s, noise_multiplier, version, self.run, now) for s in silos],
            )
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        for s in silos:
            c = self._counts[s]
            c[noise_multiplier] = c.get(noise_multiplier, 0) + 1


def central_budget_refuses(srv: AsyncServer, silo: int, job_id: int | None = None) -> bool:
    """True when one more release of ``silo``'s data would take it past
    ``server.dp.epsilon_budget``; the silo is then stopped (never folded or sent work again in
    this run), in one log line and a ``silo_stopped`` event. Asked before each fold (the
    update of job ``job_id`` is then discarded) and, for a ledger that outlives runs, before
    the first dispatch. Not a fault: nothing is counted as rejected."""
    dp = srv.cfg.server.dp
    if srv.central is None or dp.epsilon_budget is None:
        return False
    if silo in srv.stopped:
        return True
    would_be = srv.central.epsilon(silo, {srv.central.noise_multiplier: 1})
    if would_be <= dp.epsilon_budget:
        return False
    spent = srv.central.epsilon(silo)
    detail = (
        f"central epsilon {spent:.4g} spent of {dp.epsilon_budget:.4g} (delta {dp.delta:g}); "
        f"one more release would take it to {would_be:.4g}; "
        + ("its update is discarded" if job_id is not None else "it is not sent work")
    )
    srv.stopped[silo] = CENTRAL_BUDGET
    srv.per_silo[silo]["central_epsilon"] = spent
    log.warning(
        "silo %d stopped (%s): %s: %s",
        silo,
        f"job {job_id}" if job_id is not None else "before its first job",
        CENTRAL_BUDGET,
        detail,
    )
    srv.events.write(
        "silo_stopped",
        t=srv.clock.now,
        version=srv.version,
        silo=silo,
        job=job_id,
        reason=CENTRAL_BUDGET,
        detail=detail,
        central_epsilon=spent,
    )
    return True


def record_release(srv: AsyncServer, silos: list[str], noise_std: float) -> None:
    """Account a new global version that releases ``silos``' data (before it goes anywhere)."""
    if srv.central is None or not silos:
        return
    ids = [int(s) for s in silos]
    srv.central.record(ids, srv.version + 1)
    for s in ids:
        srv.per_silo[s]["central_epsilon"] = srv.central.epsilon(s)
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "version %d: central DP noise std %.3g; releases %s",
            srv.version + 1,
            noise_std,
            ", ".join(f"silo {s} (epsilon {srv.per_silo[s]['central_epsilon']:.3g})" for s in ids),
        )
