"""PNG plots of a run: score against virtual time, staleness histogram, per-silo contribution."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_score_vs_time(
    runs: dict[str, dict[str, Any]], path: Path, metric: str, target: float | None = None
) -> None:
    """One line per run (label -> summary with ``evals``); time on the run's clock."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, summary in runs.items():
        ev = summary["evals"]
        ax.plot([e["t"] for e in ev], [e["score"] for e in ev], marker=".", label=label)
    if target is not None:
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.3f}")
    clock = next(iter(runs.values())).get("clock", "virtual")
    ax.set_xlabel(f"{clock} time (s)")
    ax.set_ylabel(f"test {metric}")
    ax.set_title(f"Global model {metric} on the held-out test set")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_staleness(staleness: list[int], path: Path, mode: str) -> None:
    """Histogram of the accepted updates' staleness τ, one bar per version; ``mode`` titles it."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if staleness:
        top = max(staleness)
        ax.hist(staleness, bins=range(0, top + 2), align="left", rwidth=0.85)
    ax.set_xlabel("staleness tau (versions)")
    ax.set_ylabel("updates")
    ax.set_title(f"Staleness of accepted updates ({mode})")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_silo_contribution(summary: dict[str, Any], path: Path) -> None:
    """Updates applied and total weight per silo; stragglers (speed < 1) in orange."""
    per = summary["per_silo"]
    silos = sorted(per, key=int)
    accepted = [per[s]["accepted"] for s in silos]
    weight = [per[s]["weight"] for s in silos]
    colors = ["tab:orange" if per[s]["speed"] < 1.0 else "tab:blue" for s in silos]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    axes[0].bar(silos, accepted, color=colors)
    axes[0].set_title("updates accepted")
    axes[1].bar(silos, weight, color=colors)
    axes[1].set_title("total weight s(tau) x factor")
    for ax in axes:
        ax.set_xlabel("silo (orange: straggler)")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Per-silo contribution ({summary['mode']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
