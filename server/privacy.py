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

``ServerPrivacy`` is the server's part that keeps all of this (with its own ``state_dict``); it
returns decisions (a ``Stop``) and the loop writes the events.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedasync.privacy import gaussian_epsilon
from protocol.messages import TrainRefusal, TrainReply
from server.config import ServerDPConfig

CENTRAL_DELTA = 1e-5
"""The delta each silo's central epsilon is reported at. A constant, not a setting: the usual
delta well below 1/n for any federation's record count, the same as the silos' DP-SGD
(protocol.config.DP_DELTA), and no run has reported at another."""

log = logging.getLogger("fedasync.server")


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
        """Close the database."""
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


@dataclass(frozen=True)
class Stop:
    """A silo stopped for the rest of the run: why, and what its ``silo_stopped`` event says."""

    silo: int
    job: int | None
    reason: str
    detail: str
    extra: dict[str, float]

    def event(self) -> dict[str, Any]:
        """The fields of the ``silo_stopped`` event (besides ``t`` and ``version``)."""
        return {
            "silo": self.silo,
            "job": self.job,
            "reason": self.reason,
            "detail": self.detail,
            **self.extra,
        }


@dataclass(frozen=True)
class PrivacyNote:
    """What a train reply said about privacy: the epsilon it reports, and a stop if it refused."""

    epsilon: float | None
    stop: Stop | None


class ServerPrivacy:
    """Each silo's privacy as the server sees it: the epsilon it reports, whether it refused
    work, and central DP's per-silo releases and budget.

    ``ledger``: central DP's ledger (None without ``server.dp``); ``budget``: central epsilon a
    silo may reach (None: no budget). ``row(silo)`` is what the summary's per-silo table shows.
    """

    def __init__(self, ledger: CentralLedger | None, budget: float | None, delta: float):
        self.ledger = ledger
        self.budget = budget
        self.delta = delta
        self.stopped: dict[int, str] = {}
        """silo -> why it is sent no more work (a refusal, or central DP's budget)."""
        self.dp_epsilon: dict[int, float] = {}
        self.central_epsilon: dict[int, float] = {}

    @classmethod
    def for_run(cls, dp: ServerDPConfig, run_dir: Path) -> ServerPrivacy:
        """The run's privacy part: with ``server.dp`` noise, its central ledger
        (``server.dp.ledger``, else ``<run folder>/privacy/central.sqlite``)."""
        ledger = None
        if dp.noise_multiplier is not None:
            path = Path(dp.ledger) if dp.ledger else run_dir / "privacy" / "central.sqlite"
            ledger = CentralLedger(path, run_dir.name, dp.noise_multiplier, CENTRAL_DELTA)
        return cls(ledger, dp.epsilon_budget, CENTRAL_DELTA)

    def row(self, silo: int) -> dict[str, Any]:
        """The silo's epsilons and stop reason, as far as there are any."""
        out: dict[str, Any] = {}
        if silo in self.dp_epsilon:
            out["dp_epsilon"] = self.dp_epsilon[silo]
        if silo in self.central_epsilon:
            out["central_epsilon"] = self.central_epsilon[silo]
        if silo in self.stopped:
            out["stopped"] = self.stopped[silo]
        return out

    def take(self, silo: int, job: int, got: TrainReply | TrainRefusal | Any) -> PrivacyNote:
        """Note the epsilon a train reply (``got``: an update, a refusal, or what intake made
        of an unreadable reply) reports (a rejected update was still trained on the silo's
        data), and a ``Stop`` when it refuses the work (the silo is out of budget)."""
        if isinstance(got, TrainReply):
            eps = got.privacy
        elif isinstance(got, TrainRefusal) and got.epsilon is not None:
            delta = got.delta if got.delta is not None else float("nan")
            eps = (got.epsilon, delta)
        else:
            eps = None
        if eps is not None:
            self.dp_epsilon[silo] = eps[0]
            log.info(
                "silo %d privacy: epsilon %.4g (delta %g) after job %d", silo, eps[0], eps[1], job
            )
        epsilon = eps[0] if eps is not None else None
        if not isinstance(got, TrainRefusal):
            return PrivacyNote(epsilon, None)
        reason, detail = got.reason, got.detail
        self.stopped[silo] = reason
        log.warning("silo %d stopped training (job %d): %s: %s", silo, job, reason, detail)
        extra = {"dp_epsilon": eps[0]} if eps is not None else {}
        return PrivacyNote(epsilon, Stop(silo, job, reason, detail, extra))

    def over_budget(self, silo: int, job: int | None = None) -> tuple[bool, Stop | None]:
        """Whether central DP's budget refuses ``silo`` one more release, and the ``Stop`` when
        this call stopped it (None when it was stopped before, or is not refused). A refused
        silo is never folded or sent work again in this run. Asked before each fold (the update
        of ``job`` is then discarded) and, for a ledger that outlives runs, before the first
        dispatch. Not a fault: nothing is counted as rejected."""
        if self.ledger is None or self.budget is None:
            return False, None
        if silo in self.stopped:
            return True, None
        would_be = self.ledger.epsilon(silo, {self.ledger.noise_multiplier: 1})
        if would_be <= self.budget:
            return False, None
        spent = self.ledger.epsilon(silo)
        detail = (
            f"central epsilon {spent:.4g} spent of {self.budget:.4g} (delta {self.delta:g}); "
            f"one more release would take it to {would_be:.4g}; "
            + ("its update is discarded" if job is not None else "it is not sent work")
        )
        self.stopped[silo] = CENTRAL_BUDGET
        self.central_epsilon[silo] = spent
        log.warning(
            "silo %d stopped (%s): %s: %s",
            silo,
            f"job {job}" if job is not None else "before its first job",
            CENTRAL_BUDGET,
            detail,
        )
        return True, Stop(silo, job, CENTRAL_BUDGET, detail, {"central_epsilon": spent})

    def record_release(self, silos: list[str], version: int, noise_std: float) -> None:
        """Account the new global ``version`` that releases ``silos``' data, durably, before
        it goes anywhere."""
        if self.ledger is None or not silos:
            return
        ids = [int(s) for s in silos]
        self.ledger.record(ids, version)
        for s in ids:
            self.central_epsilon[s] = self.ledger.epsilon(s)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "version %d: central DP noise std %.3g; releases %s",
                version,
                noise_std,
                ", ".join(f"silo {s} (epsilon {self.central_epsilon[s]:.3g})" for s in ids),
            )

    def close(self) -> None:
        """Close the central ledger's database (if any)."""
        if self.ledger is not None:
            self.ledger.close()

    def state_dict(self) -> dict[str, Any]:
        """The stopped silos and the latest epsilons (the ledger keeps itself on disk)."""
        return {
            "stopped": dict(self.stopped),
            "dp_epsilon": dict(self.dp_epsilon),
            "central_epsilon": dict(self.central_epsilon),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.stopped = {int(k): str(v) for k, v in d["stopped"].items()}
        self.dp_epsilon = {int(k): float(v) for k, v in d["dp_epsilon"].items()}
        self.central_epsilon = {int(k): float(v) for k, v in d["central_epsilon"].items()}
