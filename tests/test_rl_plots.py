"""The RL run's PNGs from a synthetic metrics.jsonl (no training): each plot is written, a log
with only a start event (or nothing, or a torn last line) is tolerated, and the worker idle
fraction is right on a hand-made case."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedasync.events import EventLog, read_events
from trainers.rl.plots import (
    learner_spans,
    plot_modes,
    plot_run,
    plot_speedup_vs_workers,
    staleness_counts,
    worker_idle_fraction,
)

PNG = b"\x89PNG\r\n\x1a\n"


def _is_png(p: Path) -> bool:
    return p.is_file() and p.stat().st_size > len(PNG) and p.read_bytes()[:8] == PNG


def _start(log: EventLog, workers: int, clock: str = "virtual") -> None:
    log.write(
        "start",
        t=0.0,
        version=0,
        config={"rollout": {"mode": "streaming", "workers": workers, "max_staleness": 2}},
        gen_token_s=0.01,
        learn_token_s=0.002,
        backend="local",
        clock=clock,
    )


def _synthetic_run(run_dir: Path, workers: int = 3, steps: int = 4, end: bool = True) -> None:
    log = EventLog(run_dir / "metrics.jsonl")
    _start(log, workers)
    log.write("eval", t=0.0, version=0, accuracy=0.1)
    t, g = 0.0, 0
    for v in range(steps):
        for w in range(workers):
            outcome = ["done", "done", "died", "aborted"][(v + w) % 4]
            log.write(
                "rollout",
                t=t + 1.0 + 0.3 * w,
                version=v,
                group=g,
                worker=w,
                behaviour=max(0, v - w % 2),
                start=t,
                tokens=100 if outcome == "done" else 0,
                outcome=outcome,
            )
            g += 1
        log.write("drop", t=t + 1.0, version=v, group=g - 1, reason="stale in flight: aborted")
        t += 2.0
        log.write(
            "step",
            t=t,
            reward=0.2 + 0.1 * v,
            accuracy=0.1 * v,
            response_length=5.0,
            entropy=1.0,
            kl_behav=0.01,
            ess=0.9,
            trunc_frac=0.0,
            clip_frac=0.1,
            staleness_hist={"0": 4, "1": 2 + v},
            tokens=250,
            tokens_per_s=125.0,
            learn_s=0.05,
            dropped={},
            groups=[g - 2, g - 1],
        )
        if v % 2 == 1:
            log.write("eval", t=t, version=v + 1, accuracy=0.1 + 0.2 * v)
    if end:
        log.write("end", t=t, version=steps, final_accuracy=0.7)
        (run_dir / "summary.json").write_text(
            json.dumps({"mode": "streaming", "max_staleness": 2, "workers": workers, "time_s": t})
        )
    log.close()


def test_plot_run_writes_three_pngs(tmp_path: Path) -> None:
    _synthetic_run(tmp_path)
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "staleness.png", "timeline.png"]
    assert all(_is_png(p) for p in paths)


def test_a_distillation_run_also_gets_its_distance_to_the_teacher(tmp_path: Path) -> None:
    _synthetic_run(tmp_path)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        for v, kl in ((2, 1.5), (4, 1.1)):
            f.write(
                json.dumps(
                    {
                        "event": "eval",
                        "t": float(v),
                        "version": v,
                        "accuracy": 0.3,
                        "teacher_rkl": kl,
                        "teacher_fkl": kl / 2,
                    }
                )
                + "\n"
            )
    paths = plot_run(tmp_path)
    assert [p.name for p in paths][-1] == "teacher_kl.png"
    assert _is_png(paths[-1])


def test_plot_run_many_workers(tmp_path: Path) -> None:
    _synthetic_run(tmp_path, workers=128, steps=3, end=False)
    assert all(_is_png(p) for p in plot_run(tmp_path))


@pytest.mark.parametrize("content", ["start_only", "empty", "missing", "torn"])
def test_plot_run_tolerates_partial_logs(tmp_path: Path, content: str) -> None:
    metrics = tmp_path / "metrics.jsonl"
    if content in ("start_only", "torn"):
        log = EventLog(metrics)
        _start(log, 4)
        log.close()
        if content == "torn":
            with open(metrics, "a", encoding="utf-8") as f:
                f.write('{"event": "rollout", "t": 1.0, "sta')
    elif content == "empty":
        metrics.write_text("")
    paths = plot_run(tmp_path)
    assert len(paths) == 3 and all(_is_png(p) for p in paths)
    out = plot_modes({"a": tmp_path}, tmp_path / "modes.png")
    assert _is_png(out)


def test_plot_modes(tmp_path: Path) -> None:
    runs = {}
    for i, mode in enumerate(["sync", "one_step_off", "async", "streaming"]):
        d = tmp_path / mode
        _synthetic_run(d, steps=2 + i)
        runs[mode] = d
    out = plot_modes(runs, tmp_path / "bench" / "modes.png", title="4 modes")
    assert out == tmp_path / "bench" / "modes.png" and _is_png(out)


def test_plot_speedup_vs_workers(tmp_path: Path) -> None:
    out = plot_speedup_vs_workers(
        [1, 2, 4, 8, 128],
        {"async": [1.0, 1.4, 2.1, 2.9, 3.5], "streaming": [1.0, 1.5, float("nan"), 3.2, 4.0]},
        tmp_path / "speedup.png",
    )
    assert _is_png(out)
    assert _is_png(plot_speedup_vs_workers([], {}, tmp_path / "empty.png"))


def test_worker_idle_fraction_hand_made(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "metrics.jsonl")
    _start(log, 2)
    log.write(
        "rollout", t=10.0, worker=0, group=0, behaviour=0, start=0.0, tokens=9, outcome="done"
    )
    log.write("rollout", t=5.0, worker=1, group=1, behaviour=0, start=0.0, tokens=4, outcome="died")
    log.write("end", t=10.0, version=0, final_accuracy=None)
    log.close()
    events = read_events(tmp_path / "metrics.jsonl")
    assert worker_idle_fraction(events) == pytest.approx(0.25)
    # Without the end event the run's length is the latest t seen: the same here.
    assert worker_idle_fraction(events[:-1]) == pytest.approx(0.25)
    assert math.isnan(worker_idle_fraction(events[:1]))
    assert math.isnan(worker_idle_fraction([]))


def test_staleness_counts_and_learner_spans(tmp_path: Path) -> None:
    _synthetic_run(tmp_path, steps=3)
    events = read_events(tmp_path / "metrics.jsonl")
    assert staleness_counts(events) == {0: 12, 1: 2 + 3 + 4}
    spans = learner_spans(events)  # virtual clock: tokens x learn_token_s = 0.5 s
    assert spans == [
        pytest.approx((1.5, 2.0)),
        pytest.approx((3.5, 4.0)),
        pytest.approx((5.5, 6.0)),
    ]


def test_learner_spans_wall_clock_use_learn_s(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "metrics.jsonl")
    _start(log, 1, clock="wall")
    log.write("step", t=3.0, tokens=250, learn_s=0.5, staleness_hist={"0": 2})
    log.write("step", t=4.0, tokens=250)  # no learn_s: a zero-length bar, no crash
    log.close()
    events = read_events(tmp_path / "metrics.jsonl")
    assert learner_spans(events) == [(2.5, 3.0), (4.0, 4.0)]
    assert all(_is_png(p) for p in plot_run(tmp_path))
