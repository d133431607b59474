"""PNG plots of an RL run (issue 10 §4): reward vs time, staleness histogram, worker timeline;
and for the benchmarks, held-out accuracy of several runs on one axis and speedup vs workers.

Paper: none. Reads ``<run_dir>/metrics.jsonl`` (events written by ``trainers.rl.engine``) and,
when present, ``<run_dir>/summary.json``. Every function tolerates an empty or partial log (a run
stopped early, a torn last line): it plots what there is.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from fedasync.events import read_events  # noqa: E402

# Rollout bar colours: done groups by behaviour-version parity, failures distinct.
DONE_EVEN, DONE_ODD = "tab:blue", "lightskyblue"
DIED, ABORTED = "tab:red", "tab:orange"
LEARNER = "tab:green"


# ----------------------------------------------------------------- reading
def _events(path: Path) -> list[dict[str, Any]]:
    """Events of ``path`` (a run dir or its metrics.jsonl); [] if missing, bad lines skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        return []
    return read_events(path, skip_bad=True)  # a corrupt line: plot what can be read


def _summary(run_dir: Path) -> dict[str, Any]:
    try:
        s = json.loads((Path(run_dir) / "summary.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return s if isinstance(s, dict) else {}


def _of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == kind]


def _num(v: Any) -> float | None:
    """``v`` as a finite float, else None."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def _start(events: list[dict[str, Any]]) -> dict[str, Any]:
    s = _of(events, "start")
    return s[-1] if s else {}


def _clock(events: list[dict[str, Any]], summary: dict[str, Any] | None = None) -> str:
    clock = _start(events).get("clock") or (summary or {}).get("clock") or "virtual"
    return str(clock)


def _rollout_cfg(events: list[dict[str, Any]]) -> dict[str, Any]:
    cfg = _start(events).get("config")
    r = cfg.get("rollout") if isinstance(cfg, dict) else None
    return r if isinstance(r, dict) else {}


def _n_workers(events: list[dict[str, Any]], summary: dict[str, Any] | None = None) -> int:
    cfg_n = _num(_rollout_cfg(events).get("workers", (summary or {}).get("workers")))
    seen = [_num(e.get("worker")) for e in _of(events, "rollout")]
    return max([int(cfg_n or 0), *(int(w) + 1 for w in seen if w is not None)])


def _total_time(events: list[dict[str, Any]]) -> float:
    """The run's length: the ``end`` event's t, else the latest t seen."""
    ends = [t for e in _of(events, "end") if (t := _num(e.get("t"))) is not None]
    if ends:
        return ends[-1]
    ts = [_num(e.get("t")) for e in events]
    return max((t for t in ts if t is not None), default=0.0)


def _mode_title(events: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    r = _rollout_cfg(events)
    mode = summary.get("mode", r.get("mode", "?"))
    s = summary.get("max_staleness", r.get("max_staleness", "?"))
    return f"{mode}, S={s}"


def _save(fig: Any, path: Path, tight_bbox: bool = False) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight" if tight_bbox else None)
    plt.close(fig)
    return path


# ----------------------------------------------------------------- helpers exposed
def worker_idle_fraction(events: list[dict[str, Any]]) -> float:
    """1 − (workers' busy time) / (workers × run time); NaN when there is no run time yet.

    Busy time is every ``rollout`` event's [start, t] (done, died and aborted alike, as the
    engine counts it), clipped to [0, run time]. Workers come from the start event's config
    (else the highest worker id seen); run time is the ``end`` event's t, else the latest t.
    """
    total = _total_time(events)
    workers = _n_workers(events)
    if total <= 0 or workers <= 0:
        return math.nan
    busy = 0.0
    for e in _of(events, "rollout"):
        t, s = _num(e.get("t")), _num(e.get("start"))
        if t is None or s is None:
            continue
        busy += max(0.0, min(t, total) - max(s, 0.0))
    return min(1.0, max(0.0, 1.0 - busy / (workers * total)))


def staleness_counts(events: list[dict[str, Any]]) -> dict[int, int]:
    """Trajectories per staleness τ, summed over every step's ``staleness_hist``."""
    c: Counter[int] = Counter()
    for e in _of(events, "step"):
        h = e.get("staleness_hist")
        if not isinstance(h, dict):
            continue
        for k, v in h.items():
            try:
                tau = int(k)
            except (TypeError, ValueError):
                continue
            if _num(v) is not None:
                c[tau] += int(v)
    return dict(sorted(c.items()))


def learner_spans(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(start, end) of each learner step: end is the step's t; it lasted tokens × learn_token_s
    on the virtual clock (from the start event), ``learn_s`` on the wall clock."""
    virtual = _clock(events) == "virtual"
    lts = _num(_start(events).get("learn_token_s"))
    out = []
    for e in _of(events, "step"):
        t = _num(e.get("t"))
        if t is None:
            continue
        if virtual:
            tokens = _num(e.get("tokens"))
            dur = tokens * lts if tokens is not None and lts is not None else None
        else:
            dur = _num(e.get("learn_s"))
        if dur is None:
            dur = 0.0
        out.append((max(0.0, t - dur), t))
    return out


# ----------------------------------------------------------------- one run
def plot_reward(events: list[dict[str, Any]], path: Path, summary: dict[str, Any]) -> Path:
    """Each step's batch reward and each held-out accuracy against time (s, the run's clock)."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    steps = [(_num(e.get("t")), _num(e.get("reward"))) for e in _of(events, "step")]
    steps = [(t, r) for t, r in steps if t is not None and r is not None]
    if steps:
        ax.plot(*zip(*steps, strict=True), color="tab:grey", alpha=0.45, lw=1, label="batch reward")
    evals = [(_num(e.get("t")), _num(e.get("accuracy"))) for e in _of(events, "eval")]
    evals = [(t, a) for t, a in evals if t is not None and a is not None]
    if evals:
        ax.plot(*zip(*evals, strict=True), marker=".", color="tab:blue", label="held-out accuracy")
    if not steps and not evals:
        ax.text(0.5, 0.5, "no steps or evals yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(f"{_clock(events, summary)} time since start (s)")
    ax.set_ylabel("accuracy / reward")
    ax.set_title(f"Reward and held-out accuracy ({_mode_title(events, summary)})")
    ax.grid(alpha=0.3)
    if steps or evals:
        ax.legend()
    return _save(fig, path)


def plot_staleness_hist(events: list[dict[str, Any]], path: Path, summary: dict[str, Any]) -> Path:
    """Trained trajectories per staleness τ (:func:`staleness_counts`), one bar per version."""
    counts = staleness_counts(events)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if counts:
        ax.bar(list(counts), list(counts.values()), width=0.85)
        ax.set_xticks(list(counts))
    else:
        ax.text(0.5, 0.5, "no learner steps yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("staleness tau (versions)")
    ax.set_ylabel("trajectories")
    ax.set_title(f"Staleness of trained trajectories ({_mode_title(events, summary)})")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def plot_timeline(events: list[dict[str, Any]], path: Path, summary: dict[str, Any]) -> Path:
    """Row per worker (0 at the bottom), learner on top; thin rows, no per-bar text."""
    workers = _n_workers(events, summary)
    rows = workers + 1
    height = min(12.0, max(3.0, 1.2 + 0.09 * rows))
    fig, ax = plt.subplots(figsize=(10, height))
    ys, lefts, widths, colours = [], [], [], []
    for e in _of(events, "rollout"):
        t, s, w = _num(e.get("t")), _num(e.get("start")), _num(e.get("worker"))
        if t is None or s is None or w is None:
            continue
        outcome = e.get("outcome", "done")
        if outcome == "died":
            c = DIED
        elif outcome == "aborted":
            c = ABORTED
        else:
            b = _num(e.get("behaviour"))
            c = DONE_ODD if b is not None and int(b) % 2 else DONE_EVEN
        ys.append(int(w))
        lefts.append(s)
        widths.append(max(t - s, 0.0))
        colours.append(c)
    bar_h = 0.8 if rows <= 40 else 0.9
    if ys:
        ax.barh(ys, widths, left=lefts, height=bar_h, color=colours, linewidth=0)
    spans = learner_spans(events)
    if spans:
        ax.barh(
            [workers] * len(spans),
            [b - a for a, b in spans],
            left=[a for a, _ in spans],
            height=bar_h,
            color=LEARNER,
            edgecolor="black" if len(spans) <= 200 else "none",
            linewidth=0.3,
        )
    # Row labels: every row when few, else a sparse set.
    every = max(1, math.ceil(workers / 16))
    ticks = list(range(0, workers, every)) + [workers]
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"w{i}" for i in ticks[:-1]] + ["learner"], fontsize=7 if rows > 20 else 9)
    ax.set_ylim(-0.6, workers + 0.6)
    total = _total_time(events)
    if total > 0:
        ax.set_xlim(0, total)
    idle = worker_idle_fraction(events)
    idle_s = "n/a" if math.isnan(idle) else f"{idle:.1%}"
    ax.set_xlabel(f"{_clock(events, summary)} time since start (s)")
    ax.set_title(
        f"Worker timeline ({_mode_title(events, summary)}, {workers} workers): idle {idle_s}"
    )
    ax.legend(
        handles=[
            Patch(color=DONE_EVEN, label="done, even version"),
            Patch(color=DONE_ODD, label="done, odd version"),
            Patch(color=DIED, label="died"),
            Patch(color=ABORTED, label="aborted (stale)"),
            Patch(color=LEARNER, label="learner step"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.55 / max(height - 1.2, 1.0)),  # ~0.55 in below the axes
        ncol=5,
        fontsize=8,
        frameon=False,
    )
    ax.grid(alpha=0.3, axis="x")
    return _save(fig, path, tight_bbox=True)


def plot_teacher_kl(events: list[dict[str, Any]], path: Path, summary: dict[str, Any]) -> Path:
    """A distillation run's held-out KL(student ‖ teacher) and KL(teacher ‖ student) vs time."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    drawn = False
    for key, label in (
        ("teacher_rkl", "KL(student ‖ teacher)"),
        ("teacher_fkl", "KL(teacher ‖ student)"),
    ):
        pts = [(_num(e.get("t")), _num(e.get(key))) for e in _of(events, "eval")]
        pts = [(t, k) for t, k in pts if t is not None and k is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", label=label)
            drawn = True
    if drawn:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no evals yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(f"{_clock(events, summary)} time since start (s)")
    ax.set_ylabel("nats per token (held-out student samples)")
    ax.set_title(f"Distance to the teacher ({_mode_title(events, summary)})")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_run(run_dir: Path) -> list[Path]:
    """``reward.png``, ``staleness.png`` and ``timeline.png`` in ``run_dir`` (and
    ``teacher_kl.png`` for a distillation run); their paths."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    events = _events(run_dir)
    summary = _summary(run_dir)
    paths = [
        plot_reward(events, run_dir / "reward.png", summary),
        plot_staleness_hist(events, run_dir / "staleness.png", summary),
        plot_timeline(events, run_dir / "timeline.png", summary),
    ]
    if summary.get("distill") or any("teacher_rkl" in e for e in _of(events, "eval")):
        paths.append(plot_teacher_kl(events, run_dir / "teacher_kl.png", summary))
    return paths


# ----------------------------------------------------------------- benchmarks
def plot_modes(runs: dict[str, Path], out: Path, title: str = "") -> Path:
    """Held-out accuracy vs time, one line per run (label -> run dir), on one axis."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    clocks = set()
    drawn = False
    for label, run_dir in runs.items():
        events = _events(run_dir)
        summary = _summary(run_dir) if Path(run_dir).is_dir() else {}
        evals = [(_num(e.get("t")), _num(e.get("accuracy"))) for e in _of(events, "eval")]
        if not evals:  # no log: the summary's evals
            evals = [(_num(e.get("t")), _num(e.get("accuracy"))) for e in summary.get("evals", [])]
        evals = [(t, a) for t, a in evals if t is not None and a is not None]
        clocks.add(_clock(events, summary))
        if evals:
            ax.plot(*zip(*evals, strict=True), marker=".", label=label)
            drawn = True
        else:
            ax.plot([], [], marker=".", label=f"{label} (no evals)")
    clock = clocks.pop() if len(clocks) == 1 else "virtual/wall"
    ax.set_xlabel(f"{clock} time since start (s)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title or "Held-out accuracy vs time")
    ax.grid(alpha=0.3)
    if runs:
        ax.legend()
    if not drawn:
        ax.text(0.5, 0.5, "no evals yet", ha="center", va="center", transform=ax.transAxes)
    out.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out)


def plot_speedup_vs_workers(
    workers: list[int], speedups: dict[str, list[float]], out: Path
) -> Path:
    """Speedup over sync vs number of workers (log2 x axis), one line per mode; 1 dashed."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, ys in speedups.items():
        pts = [(w, _num(y)) for w, y in zip(workers, ys, strict=False)]
        pts = [(w, y) for w, y in pts if y is not None and w > 0]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=label)
    ax.axhline(1.0, color="grey", ls="--", lw=1, label="sync")
    ws = sorted({w for w in workers if w > 0})
    if ws:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ws)
        ax.set_xticklabels([str(w) for w in ws])
        ax.minorticks_off()
    ax.set_xlabel("rollout workers")
    ax.set_ylabel("speedup over sync")
    ax.set_title("Speedup over sync vs workers")
    ax.grid(alpha=0.3)
    ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out)
