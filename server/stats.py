"""What a run has seen, for its summary: rejections, the per-silo table, staleness, evaluations.

Paper: none. A part of the server with its own ``state_dict`` (a checkpoint holds it, so a
resumed run's summary counts every update once). It only counts: it never decides anything,
and the server's log lines and events are written by whoever asked.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from fedasync import RejectReason


def _silo_row() -> dict[str, float]:
    return {"accepted": 0, "rejected": 0, "weight": 0.0}


class ServerStats:
    """Counters behind ``summary.json``.

    ``per_silo[silo]``: accepted and rejected replies, the summed mixing weight, and the
    silo's latest epsilons (``dp_epsilon`` reported by it, ``central_epsilon`` of central DP).
    ``updates_accepted`` passed intake and were folded (FedBuff: maybe still buffered);
    ``updates_applied`` reached the global model. ``accept_times`` are the clock times of the
    accepted updates (for the erasure report's "updates from others while erasing").
    """

    def __init__(self) -> None:
        self.rejected: Counter[str] = Counter()
        self.per_silo: dict[int, dict[str, float]] = defaultdict(_silo_row)
        self.staleness_seen: list[int] = []
        self.evals: list[dict[str, float]] = []
        self.accept_times: list[float] = []
        self.updates_accepted = 0
        self.updates_applied = 0
        self.versions_refused = 0
        """Folds whose model was not finite (the loop's publish guard)."""
        self.dc_skipped = 0
        """Stale updates folded without delay compensation because their base weights had been
        dropped (``MAX_SNAPSHOTS``)."""

    def reject(self, silo: int, reason: RejectReason) -> None:
        """Count one rejected reply of ``silo``."""
        self.rejected[reason.value] += 1
        self.per_silo[silo]["rejected"] += 1

    def accept(self, silo: int, staleness: int, weight: float, flushed: int, t: float) -> None:
        """Count one folded update of ``silo`` at clock time ``t`` (``flushed`` updates reached
        the model with it: 1 for FedAsync, the buffer at a FedBuff flush, else 0)."""
        self.updates_accepted += 1
        self.updates_applied += flushed
        self.accept_times.append(t)
        self.staleness_seen.append(staleness)
        row = self.per_silo[silo]
        row["accepted"] += 1
        row["weight"] += weight

    def evaluated(self, rec: dict[str, float]) -> None:
        """Record one evaluation of the global model (``t``, ``version`` and its metrics)."""
        self.evals.append(rec)

    def dc_skip(self) -> None:
        """Count one stale update folded without delay compensation (its base weights dropped)."""
        self.dc_skipped += 1

    def refuse_version(self) -> None:
        """Count one fold whose model was not finite (refused by the loop's publish guard)."""
        self.versions_refused += 1

    def accepted_between(self, t0: float, t1: float) -> int:
        """Updates accepted in the clock interval ``(t0, t1]``."""
        return sum(1 for t in self.accept_times if t0 < t <= t1)

    def state_dict(self) -> dict[str, Any]:
        """Everything counted so far (plain lists and dicts)."""
        return {
            "rejected": dict(self.rejected),
            "per_silo": {k: dict(v) for k, v in self.per_silo.items()},
            "staleness_seen": list(self.staleness_seen),
            "evals": list(self.evals),
            "accept_times": list(self.accept_times),
            "updates_applied": self.updates_applied,
            "updates_accepted": self.updates_accepted,
            "versions_refused": self.versions_refused,
            "dc_skipped": self.dc_skipped,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.rejected = Counter(d["rejected"])
        self.per_silo = defaultdict(_silo_row, {int(k): dict(v) for k, v in d["per_silo"].items()})
        self.staleness_seen = list(d["staleness_seen"])
        self.evals = list(d["evals"])
        self.accept_times = list(d["accept_times"])
        self.updates_applied = int(d["updates_applied"])
        self.updates_accepted = int(d["updates_accepted"])
        self.versions_refused = int(d["versions_refused"])
        self.dc_skipped = int(d.get("dc_skipped", 0))  # (checkpoints from before it was counted)
