"""What a local deployment shows while it runs and what it measured (``fedasync deploy``).

Progress comes from the run's own event log (metrics.jsonl, written by the ServerApp), so the
console shows what the server did, on its wall clock: silos connected, updates, rejections,
evaluations. The measurements are derived from the same events (``deploy.json``). The log is
followed by runkit.tail's `EventTail` (re-exported here), as the metrics sinks follow it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from runkit.tail import EventTail

__all__ = ["EventTail", "describe", "measurements", "print_result", "round_trips", "show", "takes"]


def round_trips(events: list[dict[str, Any]]) -> dict[int, list[float]]:
    """Per silo, wall seconds from sending each train job to taking its reply.

    A silo is sent its next job as soon as its reply is taken (or rejected), so a job's round
    trip is the time between two consecutive takes of that silo's replies; the first job was
    sent right after the version-0 evaluation (or the resume, or the roster: ``training_start``). Meaningful in the async modes (in ``sync``
    mode a silo also waits for the round's barrier).
    """
    out: dict[int, list[float]] = {}
    for _, silo, rt in takes(events):
        out.setdefault(silo, []).append(rt)
    return out


def takes(events: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], int, float]]:
    """Every taken reply (``update`` or ``reject`` event) with its silo and round trip, in
    order (see ``round_trips``); nothing before training started."""
    start = training_start(events)
    if start is None:
        return
    last: dict[int, float] = {}
    for e in events:
        if e["event"] in ("update", "reject") and "silo" in e:
            silo = int(e["silo"])
            yield e, silo, e["t"] - last.get(silo, start)
            last[silo] = e["t"]


def training_start(events: list[dict[str, Any]]) -> float | None:
    """Wall time the first jobs went out: the version-0 evaluation, or the resume; with a
    federated evaluation (the silos evaluate, so there is none before training) the roster."""
    for e in events:
        if e["event"] == "resume" or (e["event"] == "eval" and e.get("version", 0) == 0):
            return float(e["t"])
    return next((float(e["t"]) for e in events if e["event"] == "roster"), None)


def measurements(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What deployment costs, from a run's events: roster time, round trips, throughput."""
    trips = round_trips(events)
    flat = sorted(x for v in trips.values() for x in v)
    roster = next((e["t"] for e in events if e["event"] == "roster"), None)
    updates = [e for e in events if e["event"] == "update"]
    end = max((e["t"] for e in events), default=0.0)
    start = training_start(events) or 0.0
    return {
        "roster_s": roster,
        "round_trip_s": {
            "mean": sum(flat) / len(flat) if flat else None,
            "median": flat[len(flat) // 2] if flat else None,
            "min": flat[0] if flat else None,
            "max": flat[-1] if flat else None,
            "count": len(flat),
        },
        "round_trips_by_silo": {str(s): v for s, v in sorted(trips.items())},
        "updates_per_wall_s": len(updates) / (end - start) if end > start else None,
    }


def describe(e: dict[str, Any]) -> str | None:
    """One progress line for an event (None: not shown)."""
    t = f"[{e.get('t', 0.0):7.1f}s]"
    kind = e["event"]
    if kind == "roster":
        nodes = ", ".join(f"silo {s} = node {v['node']}" for s, v in sorted(e["silos"].items()))
        return f"{t} silos connected: {nodes}"
    if kind == "eval":
        return f"{t} version {e['version']}: score {e['score']:.4f}, loss {e['loss']:.4f}"
    if kind == "update":
        return f"{t} update from silo {e['silo']} taken at version {e['version']} (staleness {e['staleness']})"
    if kind == "reject":
        return f"{t} rejected silo {e['silo']}: {e['reason']}: {e.get('detail', '')}"
    if kind == "end":
        return f"{t} run ended at version {e['version']}"
    return None


def show(events: list[dict[str, Any]], echo: Callable[[str], None], progress: bool) -> None:
    """Echo a line for each event worth showing (nothing unless ``progress``)."""
    if not progress:
        return
    for e in events:
        line = describe(e)
        if line:
            echo(line)


def print_result(summary: dict[str, Any], run_dir: Path) -> None:
    """The closing lines of ``fedasync deploy local``."""
    d = summary["deployment"]
    rt = d["round_trip_s"]
    per_silo = ", ".join(
        f"silo {s}: {v['accepted']} accepted"
        for s, v in sorted(summary["per_silo"].items(), key=lambda kv: int(kv[0]))
    )
    print()
    print(
        f"{summary['mode']}: {summary['versions']} versions in {summary['wall_time_s']:.0f}s "
        f"(ServerApp wall), final {summary['metric']} {summary['final_score']:.4f}"
    )
    print(f"updates: {per_silo}; rejected {summary['updates_rejected_total']}")
    if rt["count"]:
        print(
            f"round trip per train message: mean {rt['mean']:.1f}s, median {rt['median']:.1f}s "
            f"(min {rt['min']:.1f}, max {rt['max']:.1f}, n={rt['count']}); "
            f"roster query {d['roster_s']:.1f}s after the ServerApp started"
        )
    print(f"{len(d['pids'])} processes started and stopped (stopping took {d['stop_s']:.1f}s)")
    print(
        f"outputs: {run_dir}/ (summary.json, metrics.jsonl, deploy.json, deploy/) in {d['wall_s']:.0f}s"
    )
