"""A silo's privacy ledger: its DP-SGD accountant history, kept on the silo's disk.

opacus's accountant lives as long as one ``PrivacyEngine``, i.e. one train message (in
deployment every message even runs in a fresh ClientApp process). The silo's privacy loss,
though, is that of *every* step ever taken on its data, across messages and runs. So each
message's accountant history ``(noise_multiplier, sample_rate, steps)`` is appended to an
embedded SQLite file next to the data, and the silo's epsilon is always computed from the
whole ledger: an accountant given every stored entry is the accountant that saw every step
(``epsilon_of``; tested against opacus's own accountant fed all steps at once).

Durability: WAL journal, ``synchronous=FULL``, and one ``BEGIN IMMEDIATE`` transaction per
message that re-reads the ledger, checks the budget and appends, so two messages for the same
silo cannot both pass the check, and a crash leaves either the whole message recorded or none
of it. A message is recorded after it has trained and before its reply (the only thing that
releases anything) is sent: a crash in between over-counts, never under-counts.

Where the file is: the SuperNode's node config ``privacy-db`` (a path, for deployment: one file
per silo, kept across runs); without it, ``<dir>/silo-<i>.sqlite`` under the folder the server
names in the train message (``privacy-dir``: ``<run folder>/privacy`` in simulation, where
every silo shares the server's disk).

The wire keys of privacy (``privacy-db``, ``dp-epsilon``, ``refusal`` ...) are in
``protocol.keys``; this module imports neither Flower nor opacus at import time.
"""

from __future__ import annotations

import math
import sqlite3
import time
import warnings
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from protocol.keys import PRIVACY_DB, PRIVACY_DIR


class Refusal:
    """Typed reasons a silo refuses a train message (not errors: the server stops asking)."""

    BUDGET_EXHAUSTED = "privacy_budget_exhausted"


History = list[tuple[float, float, int]]
"""An accountant's history: ``(noise_multiplier, sample_rate, steps)`` entries."""


class BudgetExhausted(Exception):
    """Training (further) would take the silo's epsilon past its budget."""

    def __init__(self, spent: float, would_be: float, budget: float, delta: float):
        """Epsilon ``spent`` so far, what one more message ``would_be``, the ``budget``, and
        the ``delta`` they are at."""
        self.spent, self.would_be, self.budget, self.delta = spent, would_be, budget, delta
        super().__init__(
            f"privacy budget exhausted: epsilon {spent:.4g} spent of {budget:.4g} "
            f"(delta {delta:g}); one more message would take it to {would_be:.4g}"
        )


def merge(history: Iterable[tuple[float, float, int]]) -> History:
    """Entries with equal ``(noise_multiplier, sample_rate)`` summed into one, in first-seen
    order (the composition is the same; fewer terms to evaluate)."""
    steps: dict[tuple[float, float], int] = {}
    for sigma, q, n in history:
        key = (float(sigma), float(q))
        steps[key] = steps.get(key, 0) + int(n)
    return [(s, q, n) for (s, q), n in steps.items() if n > 0]


def epsilon_of(history: Iterable[tuple[float, float, int]], delta: float, mechanism: str) -> float:
    """Epsilon at ``delta`` of every step in ``history``, by opacus's accountant ``mechanism``.

    ``gdp`` (opacus's GaussianAccountant) composes only one ``(noise, rate)`` pair; a ledger
    with several raises ValueError (use ``rdp`` or ``prv``).
    """
    from opacus.accountants import create_accountant

    merged = merge(history)
    if not merged:
        return 0.0
    if mechanism == "gdp" and len(merged) > 1:
        raise ValueError(
            "the gdp accountant cannot compose different noise multipliers or sample rates "
            f"({len(merged)} in this ledger); use rdp or prv"
        )
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # gdp is "experimental"; rdp: "optimal order is the largest alpha"
        if mechanism == "rdp":  # what RDPAccountant.get_epsilon computes, one order vector per pair
            from opacus.accountants.analysis.rdp import get_privacy_spent

            rdp = sum(_rdp_per_step(s, q) * n for s, q, n in merged)
            eps, _ = get_privacy_spent(orders=_orders(), rdp=rdp, delta=delta)
            return float(eps)
        acc = create_accountant(mechanism=mechanism)
        acc.history = list(merged)
        return float(acc.get_epsilon(delta=delta))


def _orders() -> list[float]:
    from opacus.accountants import RDPAccountant

    return list(RDPAccountant.DEFAULT_ALPHAS)


@lru_cache(maxsize=256)
def _rdp_per_step(noise_multiplier: float, rate: float) -> np.ndarray:
    """RDP of one step at every order of opacus's RDPAccountant (about 0.1 s to compute; a
    ledger has few distinct pairs, and RDP composes by addition: n steps cost n times this)."""
    from opacus.accountants.analysis.rdp import compute_rdp

    return np.asarray(
        compute_rdp(q=rate, noise_multiplier=noise_multiplier, steps=1, orders=_orders())
    )


def ledger_path(node_config: Mapping[str, Any], train_config: Mapping[str, Any], silo: int) -> Path:
    """Where silo ``silo`` keeps its ledger (see the module docstring)."""
    if PRIVACY_DB in node_config:
        return Path(str(node_config[PRIVACY_DB])).expanduser()
    if PRIVACY_DIR in train_config and str(train_config[PRIVACY_DIR]):
        return Path(str(train_config[PRIVACY_DIR])) / f"silo-{silo}.sqlite"
    raise ValueError(
        f"DP is on but this silo has no ledger: give its SuperNode the node config "
        f"'{PRIVACY_DB}=/path/to/privacy.sqlite'"
    )


SCHEMA = """
CREATE TABLE IF NOT EXISTS steps (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    noise_multiplier REAL NOT NULL,
    sample_rate REAL NOT NULL CHECK (sample_rate > 0 AND sample_rate <= 1),
    steps INTEGER NOT NULL CHECK (steps >= 0),
    silo INTEGER NOT NULL,
    job_id INTEGER NOT NULL,
    recorded_at REAL NOT NULL
);
"""


class PrivacyLedger:
    """The accountant history of one silo's data, in an SQLite file (see module docstring)."""

    def __init__(self, path: Path):
        """Open (creating it and its folder if needed) the ledger file at ``path``."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        """Close the database connection."""
        self._db.close()

    def __enter__(self) -> PrivacyLedger:
        """The ledger itself (closed on exit)."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the ledger."""
        self.close()

    def history(self) -> History:
        """Every recorded entry, in the order recorded."""
        rows = self._db.execute(
            "SELECT noise_multiplier, sample_rate, steps FROM steps ORDER BY id"
        ).fetchall()
        return [(float(s), float(q), int(n)) for s, q, n in rows]

    def epsilon(self, delta: float, mechanism: str = "rdp") -> float:
        """The silo's accumulated epsilon at ``delta``."""
        return epsilon_of(self.history(), delta, mechanism)

    def check(
        self, planned: History, *, delta: float, mechanism: str, budget: float | None
    ) -> float:
        """Epsilon spent so far; raise BudgetExhausted if ``planned`` would pass ``budget``."""
        past = self.history()
        spent = epsilon_of(past, delta, mechanism)
        if budget is not None:
            would_be = epsilon_of([*past, *planned], delta, mechanism)
            if would_be > budget:
                raise BudgetExhausted(spent, would_be, budget, delta)
        return spent

    def record(
        self,
        entries: History,
        *,
        silo: int,
        job_id: int,
        delta: float,
        mechanism: str,
        budget: float | None,
    ) -> float:
        """Append one message's ``entries`` in one transaction; return the new epsilon.

        The budget is checked again inside the transaction: if the entries would take the
        ledger past ``budget`` nothing is written and BudgetExhausted is raised (the caller
        must then not release the message's result).
        """
        now = time.time()
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            before = self.history()
            after = epsilon_of([*before, *entries], delta, mechanism)
            if budget is not None and after > budget:
                raise BudgetExhausted(epsilon_of(before, delta, mechanism), after, budget, delta)
            if not math.isfinite(after):
                raise ValueError(f"epsilon {after} is not finite (noise multiplier 0?)")
            db.executemany(
                "INSERT INTO steps (noise_multiplier, sample_rate, steps, silo, job_id, "
                "recorded_at) VALUES (?, ?, ?, ?, ?, ?)",
                [(float(s), float(q), int(n), silo, job_id, now) for s, q, n in entries],
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return after
