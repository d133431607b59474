"""PNG plots of the pipeline trainer: a stage × time timeline of its operations, and loss
curves of several runs on one axis.

Paper: none. :func:`plot_timeline` takes events ``{"stage", "kind", "micro", "start", "end"}``
as :func:`trainers.pipeline.simulate.simulate` writes them and the real run records them; time
is shifted so the first event starts at 0 (a real run's clock has its own origin).
matplotlib is imported inside the functions and draws on its Agg canvas without pyplot, so
importing this module costs nothing and touches no global backend state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

COLOURS = {"F": "tab:blue", "B": "tab:orange", "S": "tab:green"}
LABELS = {"F": "forward", "B": "backward", "S": "optimiser step"}
OTHER = "tab:gray"


def plot_timeline(
    events: Sequence[Mapping[str, Any]], path: str | Path, title: str = "pipeline timeline"
) -> Path:
    """A Gantt chart of ``events``: one row per stage (stage 0 at the top), forward, backward
    and optimiser step in their colours, idle time blank, the micro-batch index written in
    bars wide enough to hold it. Saves a PNG at ``path`` and returns it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    path = Path(path)
    stages = 1 + max((int(e["stage"]) for e in events), default=0)
    t0 = min((float(e["start"]) for e in events), default=0.0)
    t1 = max((float(e["end"]) for e in events), default=1.0)
    span = t1 - t0 if t1 > t0 else 1.0

    width_in = 12.0
    fig = Figure(figsize=(width_in, 1.2 + 0.45 * stages), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # About 0.85 of the figure is axes; a digit at fontsize 7 is about 0.06 in wide.
    inch_per_second = 0.85 * width_in / span
    for e in events:
        start, end = float(e["start"]) - t0, float(e["end"]) - t0
        if end <= start:
            continue
        s, kind = int(e["stage"]), str(e["kind"])
        ax.barh(
            s,
            end - start,
            left=start,
            height=0.8,
            color=COLOURS.get(kind, OTHER),
            edgecolor="white",
            linewidth=0.5,
        )
        if kind in ("F", "B"):
            label = str(e["micro"])
            if (end - start) * inch_per_second >= 0.06 * len(label) + 0.02:
                ax.text(
                    (start + end) / 2,
                    s,
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if kind == "F" else "black",
                )
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.set_ylim(stages - 0.5, -0.5)  # stage 0 at the top
    ax.set_xlim(0.0, span)
    ax.set_xlabel("seconds")
    ax.set_title(title if events else f"{title} (no events)")
    fig.legend(
        handles=[Patch(color=COLOURS[k], label=LABELS[k]) for k in COLOURS],
        loc="outside lower center",
        ncol=3,
        frameon=False,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def plot_loss(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    path: str | Path,
    xlabel: str = "step",
    title: str = "loss",
) -> Path:
    """One line per label of ``curves`` (label → [(x, loss), ...], x a step or seconds);
    empty curves are left out. Saves a PNG at ``path`` and returns it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    drawn = 0
    for label, points in curves.items():
        if not points:
            continue
        xs = [float(x) for x, _ in points]
        ys = [float(y) for _, y in points]
        ax.plot(xs, ys, label=label, linewidth=1.2, marker="." if len(xs) < 30 else None)
        drawn += 1
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss")
    ax.set_title(title if drawn else f"{title} (no data)")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
