"""The run's ``summary.json``: what happened, in the numbers people compare runs by."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runkit.folder import write_json

if TYPE_CHECKING:
    from server.config import FedAsyncConfig
    from server.privacy import CentralLedger
    from server.stats import ServerStats

log = logging.getLogger("fedasync.server")


def time_to_target(evals: list[dict[str, Any]], target: float | None) -> float | None:
    """First clock time at which the evaluated score reached ``target`` (None if never)."""
    if target is None:
        return None
    for e in evals:
        if e["score"] >= target:
            return float(e["t"])
    return None


@dataclass
class RunFacts:
    """What the loop knows of a finished run besides its statistics, as values
    (the loop's ``facts()``)."""

    mode: str
    silos: int
    target: float | None
    version: int
    clock_kind: str
    virtual_time_s: float | None
    """The clock's time at the end; None on a wall clock."""
    speeds: list[float]
    """Each silo's relative speed, by index."""
    num_samples: dict[int, int]
    privacy: dict[int, dict[str, Any]]
    """Each silo's privacy row (``ServerPrivacy.row``)."""
    dispatches_refused: int
    cancels: dict[str, Any]
    faults: list[dict[str, Any]]


def build_summary(
    facts: RunFacts, stats: ServerStats, *, metric: str, wall_time_s: float
) -> dict[str, Any]:
    """A finished run's summary: scores, times, update counts, staleness, per-silo numbers.

    Scores are in ``metric`` (accuracy, or Dice for segmentation: ``final_score``), times in
    seconds; ``virtual_time_s`` is None on a wall clock.
    """
    evals = stats.evals
    final = evals[-1] if evals else {"score": float("nan"), "loss": float("nan")}
    st = stats.staleness_seen
    per_silo = {
        str(s): {
            "speed": facts.speeds[s],
            "num_samples": facts.num_samples.get(s, 0),
            **stats.per_silo.get(s, {"accepted": 0, "rejected": 0, "weight": 0.0}),
            **facts.privacy[s],
        }
        for s in range(facts.silos)
    }
    return {
        "mode": facts.mode,
        "metric": metric,
        "final_score": final["score"],
        "best_score": max((e["score"] for e in evals), default=float("nan")),
        "final_loss": final["loss"],
        "virtual_time_s": facts.virtual_time_s,
        "clock": facts.clock_kind,
        "wall_time_s": wall_time_s,
        "target_accuracy": facts.target,
        "time_to_target_s": time_to_target(evals, facts.target),
        "versions": facts.version,
        "updates_applied": stats.updates_applied,
        "updates_accepted": stats.updates_accepted,
        "updates_buffered_at_end": stats.updates_accepted - stats.updates_applied,
        "updates_rejected": dict(sorted(stats.rejected.items())),
        "updates_rejected_total": sum(stats.rejected.values()),
        # second jobs the loop refused to send a silo that held one (0 unless a bug asked)
        "dispatches_refused": facts.dispatches_refused,
        # training jobs an erasure request cancelled, and what became of their replies
        **facts.cancels,
        # folds whose model was not finite, refused (the model stayed; 0 unless a bug)
        "versions_refused": stats.versions_refused,
        # stale updates folded without delay compensation: their base weights had been dropped
        # (dispatch.MAX_SNAPSHOTS; 0 while fewer versions than that are in flight)
        "dc_skipped": stats.dc_skipped,
        "staleness_mean": float(np.mean(st)) if st else 0.0,
        "staleness_max": int(max(st)) if st else 0,
        "per_silo": per_silo,
        "faults": facts.faults,
        "evals": evals,
    }


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Write ``summary`` to ``path`` as indented strict JSON (non-finite floats as null),
    atomically (the run kit's writer)."""
    write_json(path, summary)


def no_version_reason(summary: dict[str, Any], run_dir: Path) -> str | None:
    """Why a run produced no version, in one line (None when it made at least one): a run
    that made none did not do what was asked, so the commands exit non-zero."""
    if summary.get("versions"):
        return None
    rejected = summary.get("updates_rejected") or {}
    why = (
        "every update was rejected: " + ", ".join(f"{k}={v}" for k, v in rejected.items())
        if rejected
        else "no update arrived within run.budget_s"
    )
    return f"the run produced no version ({why}); see {run_dir / 'run.log'}"


def central_dp_summary(
    cfg: FedAsyncConfig, ledger: CentralLedger | None, roster: Mapping[int, int]
) -> dict[str, Any]:
    """Central DP's settings and every silo of ``roster``'s epsilon (all runs of its
    ``ledger``), also logged."""
    from server.privacy import CENTRAL_DELTA

    dp = cfg.server.dp
    assert ledger is not None
    eps = {str(s): ledger.epsilon(s) for s in sorted(roster)}
    releases = {str(s): ledger.releases(s) for s in sorted(roster)}
    log.info(
        "central DP (noise %.3g x clip %.3g, delta %g): epsilon per silo %s",
        dp.noise_multiplier,
        cfg.server.clip_norm,
        CENTRAL_DELTA,
        ", ".join(f"{s}: {e:.3g} ({releases[s]} releases)" for s, e in eps.items()),
    )
    return {
        "noise_multiplier": dp.noise_multiplier,
        "clip_norm": cfg.server.clip_norm,
        "delta": CENTRAL_DELTA,
        "epsilon_budget": dp.epsilon_budget,
        "ledger": str(ledger.path),
        "epsilon": eps,
        "releases": releases,
    }
