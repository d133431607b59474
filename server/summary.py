"""The run's ``summary.json``: what happened, in the numbers people compare runs by."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runkit.folder import write_json

if TYPE_CHECKING:
    from server.loop import AsyncServer

log = logging.getLogger("fedasync.server")


def time_to_target(evals: list[dict[str, Any]], target: float | None) -> float | None:
    """First clock time at which the evaluated score reached ``target`` (None if never)."""
    if target is None:
        return None
    for e in evals:
        if e["score"] >= target:
            return float(e["t"])
    return None


def build_summary(
    srv: AsyncServer, *, metric: str, wall_time_s: float, silo_evals: dict[int, dict]
) -> dict[str, Any]:
    """A finished run's summary: scores, times, update counts, staleness, per-silo numbers.

    Scores are in ``metric`` (accuracy, or Dice for segmentation: ``final_score``), times in
    seconds; ``virtual_time_s`` is None on a wall clock. ``silo_evals`` holds each silo's own
    evaluation by silo index (empty when the run did not evaluate the silos).
    """
    stats = srv.stats
    evals = stats.evals
    final = evals[-1] if evals else {"score": float("nan"), "loss": float("nan")}
    st = stats.staleness_seen
    per_silo = {
        str(s): {
            "speed": srv.speeds[s],
            "num_samples": srv.num_samples.get(s, 0),
            **stats.per_silo.get(s, {"accepted": 0, "rejected": 0, "weight": 0.0}),
            **srv.privacy.row(s),
            **({"eval": silo_evals[s]} if s in silo_evals else {}),
        }
        for s in range(srv.cfg.silos.count)
    }
    target = srv.cfg.run.target_accuracy
    return {
        "mode": srv.cfg.server.mode,
        "metric": metric,
        "final_score": final["score"],
        "best_score": max((e["score"] for e in evals), default=float("nan")),
        "final_loss": final["loss"],
        "virtual_time_s": None if srv.clock.realtime else srv.clock.now,
        "clock": srv.clock.kind,
        "wall_time_s": wall_time_s,
        "target_accuracy": target,
        "time_to_target_s": time_to_target(evals, target),
        "versions": srv.version,
        "updates_applied": stats.updates_applied,
        "updates_accepted": stats.updates_accepted,
        "updates_buffered_at_end": stats.updates_accepted - stats.updates_applied,
        "updates_rejected": dict(sorted(stats.rejected.items())),
        "updates_rejected_total": sum(stats.rejected.values()),
        # second jobs the loop refused to send a silo that held one (0 unless a bug asked)
        "dispatches_refused": srv.jobs.refused,
        # training jobs an erasure request cancelled, and what became of their replies
        **srv.cancels.summary(),
        # folds whose model was not finite, refused (the model stayed; 0 unless a bug)
        "versions_refused": stats.versions_refused,
        # stale updates folded without delay compensation: their base weights had been dropped
        # (server.corrections.max_snapshots; 0 while fewer versions than that are in flight)
        "dc_skipped": stats.dc_skipped,
        "staleness_mean": float(np.mean(st)) if st else 0.0,
        "staleness_max": int(max(st)) if st else 0,
        "per_silo": per_silo,
        "faults": srv.faults.fired,
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


def central_dp_summary(srv: AsyncServer) -> dict[str, Any]:
    """Central DP's settings and every silo's epsilon (all runs of its ledger), also logged."""
    dp = srv.cfg.server.dp
    ledger = srv.privacy.ledger
    assert ledger is not None
    eps = {str(s): ledger.epsilon(s) for s in sorted(srv.roster)}
    releases = {str(s): ledger.releases(s) for s in sorted(srv.roster)}
    log.info(
        "central DP (noise %.3g x clip %.3g, delta %g): epsilon per silo %s",
        dp.noise_multiplier,
        srv.cfg.server.clip_norm,
        dp.delta,
        ", ".join(f"{s}: {e:.3g} ({releases[s]} releases)" for s, e in eps.items()),
    )
    return {
        "noise_multiplier": dp.noise_multiplier,
        "clip_norm": srv.cfg.server.clip_norm,
        "delta": dp.delta,
        "epsilon_budget": dp.epsilon_budget,
        "ledger": str(ledger.path),
        "epsilon": eps,
        "releases": releases,
    }
