"""PNG plots of pricing-market runs: price paths, the forced-deviation trace, the collusion
index over training and the (rate, latency) phase diagram.

Paper: the figures arXiv 2606.09884 describes (phase diagram with corrupted cells marked,
trace diagnostics); Calvano et al. (AER 2020) for the deviation's impulse response. Reads the
results ``trainers.market.run.run_settings`` returns and each seed's trace.npz and
metrics.jsonl; tolerates missing pieces (a corrupted run has no deviation trace).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from fedasync.events import read_events  # noqa: E402


def _bands(ax: Any, bench: dict[str, float]) -> None:
    """Dashed lines at the Nash and the monopoly price."""
    ax.axhline(bench["p_nash"], color="k", ls="--", lw=0.8, label="Nash")
    ax.axhline(bench["p_monopoly"], color="k", ls=":", lw=0.8, label="monopoly")


def plot_prices(results: dict[str, dict[str, Any]], root: Path, out: Path) -> Path | None:
    """Each setting's price path (its first seed, every firm) on its own panel."""
    labels = [k for k, v in results.items() if v["runs"]]
    if not labels:
        return None
    fig, axes = plt.subplots(len(labels), 1, figsize=(8, 2.2 * len(labels)), squeeze=False)
    for ax, label in zip(axes[:, 0], labels):
        run = results[label]["runs"][0]
        path = root / label / f"seed-{run['seed']}" / "trace.npz"
        if path.is_file():
            with np.load(path) as z:
                t, p = z["times"], z["prices"]
            for i in range(p.shape[1]):
                ax.step(t, p[:, i], where="post", lw=0.6, label=f"firm {i}")
        _bands(ax, run)
        status = "" if run["status"] == "ok" else f" (corrupted: {run['corrupted']['reason']})"
        ax.set_title(f"{label}, seed {run['seed']}{status}"[:100], fontsize=9)
        ax.set_ylabel("price")
    axes[-1, 0].set_xlabel("time")
    axes[0, 0].legend(fontsize=7, ncol=4, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_deviation(results: dict[str, dict[str, Any]], out: Path) -> Path | None:
    """The forced deviation of each setting's first uncorrupted seed: prices around it."""
    cases = []
    for label, v in results.items():
        for r in v["runs"]:
            if r.get("deviation"):
                cases.append((label, r))
                break
    if not cases:
        return None
    fig, axes = plt.subplots(len(cases), 1, figsize=(7, 2.2 * len(cases)), squeeze=False)
    for ax, (label, r) in zip(axes[:, 0], cases):
        d = r["deviation"]
        t, p = np.asarray(d["times"]), np.asarray(d["prices"])
        for i in range(p.shape[1]):
            ax.step(
                t,
                p[:, i],
                where="post",
                lw=0.9,
                label=f"firm {i}" + (" (deviates)" if i == d["deviator"] else ""),
            )
        ax.axvline(0, color="r", lw=0.6)
        _bands(ax, r)
        rec = d["recovery_time"]
        ax.set_title(
            f"{label} seed {r['seed']}: punished {d['punished']}, "
            + (f"back after {rec:.1f}" if rec is not None else "no return"),
            fontsize=9,
        )
        ax.set_ylabel("price")
    axes[-1, 0].set_xlabel("time since the deviation")
    axes[0, 0].legend(fontsize=7, ncol=4, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_index(results: dict[str, dict[str, Any]], root: Path, out: Path) -> Path | None:
    """The collusion index per window over training, every seed of every setting."""
    fig, ax = plt.subplots(figsize=(8, 3.5))
    drawn = False
    for k, (label, v) in enumerate(results.items()):
        colour = f"C{k % 10}"
        for j, r in enumerate(v["runs"]):
            path = root / label / f"seed-{r['seed']}" / "metrics.jsonl"
            if not path.is_file():
                continue
            w = [e for e in read_events(path) if e.get("event") == "window"]
            if w:
                ax.plot(
                    [e["t"] for e in w],
                    [e["delta"] for e in w],
                    color=colour,
                    lw=0.8,
                    alpha=0.8,
                    label=label if j == 0 else None,
                )
                drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.axhline(0, color="k", ls="--", lw=0.8)
    ax.axhline(1, color="k", ls=":", lw=0.8)
    ax.set_xlabel("time")
    ax.set_ylabel("collusion index (window)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_phase(
    rates: list[float], latencies: list[float], results: dict[str, dict[str, Any]], out: Path
) -> Path:
    """The phase diagram: mean Delta per (rate, latency) as a heat map, each cell annotated
    with Delta +- its 95% half-width; a cell with corrupted seeds hatched and marked
    ``k/n corrupted``, all corrupted: grey with an X."""
    grid = np.full((len(rates), len(latencies)), math.nan)
    fig, ax = plt.subplots(figsize=(1.4 * len(latencies) + 2.5, 1.0 * len(rates) + 1.8))
    cells = {(v["rate"], v["latency"]): v for v in results.values()}
    for a, r in enumerate(rates):
        for b, d in enumerate(latencies):
            v = cells.get((r, d))
            if v is not None and v["ok"]:
                grid[a, b] = v["delta"]
    im = ax.imshow(grid, origin="lower", cmap="viridis", vmin=-0.2, vmax=1.0, aspect="auto")
    for a, r in enumerate(rates):
        for b, d in enumerate(latencies):
            v = cells.get((r, d))
            if v is None:
                continue
            n = v["ok"] + v["corrupted"]
            if v["ok"] == 0:
                ax.add_patch(plt.Rectangle((b - 0.5, a - 0.5), 1, 1, color="0.6"))
                ax.text(b, a, f"X\n{n}/{n} corrupted", ha="center", va="center", fontsize=7)
                continue
            half = v["delta_ci95"]
            text = f"{v['delta']:.2f}" + (f"\n±{half:.2f}" if not math.isnan(half) else "")
            if v["corrupted"]:
                ax.add_patch(
                    plt.Rectangle((b - 0.5, a - 0.5), 1, 1, fill=False, hatch="//", ec="r", lw=0)
                )
                text += f"\n{v['corrupted']}/{n} corrupted"
            ax.text(b, a, text, ha="center", va="center", fontsize=7, color="w")
    ax.set_xticks(range(len(latencies)), [f"{d:g}" for d in latencies])
    ax.set_yticks(range(len(rates)), [f"{r:g}" for r in rates])
    ax.set_xlabel("observation latency δ")
    ax.set_ylabel("revision rate λ")
    ax.set_title("collusion index Δ (asynchronous clocks)", fontsize=10)
    fig.colorbar(im, ax=ax, label="Δ")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_all(
    results: dict[str, dict[str, Any]],
    root: Path,
    sweep: tuple[list[float], list[float]] | None = None,
) -> list[Path]:
    """Every plot that applies, written under ``root``; their paths."""
    made = [
        plot_prices(results, root, root / "prices.png"),
        plot_deviation(results, root / "deviation.png"),
        plot_index(results, root, root / "collusion_index.png"),
    ]
    if sweep is not None and sweep[0]:
        made.append(plot_phase(sweep[0], sweep[1], results, root / "phase_diagram.png"))
    return [p for p in made if p is not None]
