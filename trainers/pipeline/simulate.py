"""A discrete-event simulator of the pipeline schedules: when each stage runs what, for given
per-stage costs, and so the bubble and the time per batch of each schedule.

Papers: GPipe (Huang et al. 2019) gives the flushed bubble (P − 1)/(m + P − 1) for P equal
stages and m micro-batches (:func:`ideal_bubble`); 1F1B-flush (PipeDream-Flush, Narayanan et
al. 2021) has the same bubble and a lower activation peak. PipeDream-2BW (Narayanan et al.
2021) and PACI (Elam et al. 2026, arXiv 2606.07881) drop the flush, so after the first
batch's fill a batch costs m·(f + b) of the slowest stage instead of (m + P − 1)·(f + b).

The model: each stage runs its operations of :func:`trainers.pipeline.schedule.run_order`
strictly in that order, one at a time, and its optimiser step (``"S"``) right after the
batch's last backward. ``("F", j)`` at stage s > 0 waits for ``("F", j)`` at s − 1 plus the
latency ``comm``; ``("B", j)`` at s < P − 1 waits for ``("B", j)`` at s + 1 plus ``comm``.
Every operation starts as early as its stage and its message allow (list scheduling); the
times are then the longest paths of that dependency graph, whatever order the events are
computed in.

Departures from a real pipeline, all deliberate: a stage's F, B and S cost the same every
time (no per-micro-batch noise, no warm-up); a message costs a fixed latency and no stage
time (sends are asynchronous, links full duplex, buffers unbounded, no bandwidth term or
contention); memory is not modelled. 2BW's weight stash and PACI's drift bound change which
weights a stage uses, not when it runs, so both simulate identically.

Latency is not free for 1F1B: its P − s − 1 warm-up forwards are sized for none. With equal
stages and latency c, the unflushed stream takes m·(f + b + 2(P − 1)·c/P) per batch (the P
micro-batches in flight at stage 0 make a round trip of P·(f + b) + 2(P − 1)·c), while
GPipe pays 2(P − 1)·c once per batch: for m > P, past c = (f + b)·P / (2(m − P)) GPipe is
the faster (a test); for m ≤ P never.
:attr:`Timeline.steady_step_time` leaves out the first batch (fill) and the last (drain),
which otherwise bias the mean of a short run when the stages are unequal.

Events are dicts ``{"stage", "kind", "micro", "start", "end"}`` (kind ``"F"``, ``"B"`` or
``"S"``), the format the real run records, so :func:`trainers.pipeline.plots.plot_timeline`
and :func:`from_measurements` take either. An ``"S"`` event's ``micro`` is the batch's last
micro-batch (t·m + m − 1), so ``micro // m`` is the batch for every kind.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainers.pipeline.schedule import run_order

KINDS = ("F", "B", "S")


def _check_costs(name: str, values: list[float]) -> None:
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"{name}[{i}] must be a number, got {type(v).__name__}")
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}[{i}] must be finite and >= 0, got {v!r}")


@dataclass(frozen=True)
class StageCosts:
    """Seconds per operation of each stage: ``forward[s]`` and ``backward[s]`` per
    micro-batch, ``step[s]`` per optimiser step (once a batch, may be 0); ``comm`` per
    activation or gradient message between neighbouring stages."""

    forward: list[float]
    backward: list[float]
    step: list[float]
    comm: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.forward)
        if n < 1 or len(self.backward) != n or len(self.step) != n:
            raise ValueError(
                "forward, backward and step need one cost per stage (at least one stage); got "
                f"lengths {len(self.forward)}, {len(self.backward)}, {len(self.step)}"
            )
        _check_costs("forward", self.forward)
        _check_costs("backward", self.backward)
        _check_costs("step", self.step)
        _check_costs("comm", [self.comm])

    @property
    def stages(self) -> int:
        """Number of stages P."""
        return len(self.forward)

    @classmethod
    def uniform(
        cls, stages: int, forward: float, backward: float, step: float = 0.0, comm: float = 0.0
    ) -> StageCosts:
        """The same costs on every stage."""
        if stages < 1:
            raise ValueError(f"need stages >= 1, got {stages}")
        return cls([forward] * stages, [backward] * stages, [step] * stages, comm)


@dataclass
class Timeline:
    """A simulated (or measured) run: its events, the time of its last event, and the
    seconds each stage spent computing."""

    schedule: str
    stages: int
    micro: int
    batches: int
    events: list[dict[str, Any]]
    makespan: float
    busy: list[float] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """The fraction of the P × makespan stage-seconds that no stage computes."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.stages * self.makespan)

    @property
    def idle_fractions(self) -> list[float]:
        """Per stage, the fraction of the makespan it is not computing (fill and drain
        included)."""
        if self.makespan <= 0:
            return [0.0] * self.stages
        return [1.0 - b / self.makespan for b in self.busy]

    @property
    def step_time(self) -> float:
        """Seconds per batch over the whole run, pipeline fill included."""
        return self.makespan / self.batches if self.batches > 0 else self.makespan

    @property
    def steady_step_time(self) -> float:
        """Seconds per batch once the pipeline is full: the mean gap between the ends of
        stage 0's optimiser steps, from the first batch's (the fill excluded) to the
        second-to-last batch's (the drain excluded; with two batches, the last's). The
        makespan when there is one batch."""
        ends = sorted(e["end"] for e in self.events if e["stage"] == 0 and e["kind"] == "S")
        if len(ends) < 2:
            return self.makespan
        if len(ends) >= 3:
            ends = ends[:-1]
        return float((ends[-1] - ends[0]) / (len(ends) - 1))

    @classmethod
    def from_events(
        cls, schedule: str, stages: int, micro: int, batches: int, events: list[dict[str, Any]]
    ) -> Timeline:
        """A timeline of measured events (same format; any clock origin): the makespan runs
        from the first start to the last end, busy sums each stage's event durations."""
        busy = [0.0] * stages
        for e in events:
            busy[int(e["stage"])] += float(e["end"]) - float(e["start"])
        t0 = min((float(e["start"]) for e in events), default=0.0)
        t1 = max((float(e["end"]) for e in events), default=0.0)
        return cls(schedule, stages, micro, batches, events, t1 - t0, busy)


def simulate(schedule: str, stages: int, micro: int, batches: int, costs: StageCosts) -> Timeline:
    """Earliest start times of every operation of ``schedule`` (one of
    :data:`trainers.pipeline.schedule.SCHEDULES`) on ``stages`` stages, ``batches`` batches of
    ``micro`` micro-batches, under ``costs``. O(number of operations), plus a sort."""
    order = run_order(schedule, stages, micro, batches)
    if batches < 1:
        raise ValueError(f"simulate needs batches >= 1, got {batches}")
    if costs.stages != stages:
        raise ValueError(f"costs are for {costs.stages} stages, the pipeline has {stages}")
    n = micro * batches
    f_end: list[list[float | None]] = [[None] * n for _ in range(stages)]
    b_end: list[list[float | None]] = [[None] * n for _ in range(stages)]
    pos = [0] * stages
    free = [0.0] * stages
    busy = [0.0] * stages
    events: list[dict[str, Any]] = []

    def record(s: int, kind: str, j: int, start: float, cost: float) -> float:
        end = start + cost
        events.append({"stage": s, "kind": kind, "micro": j, "start": start, "end": end})
        busy[s] += cost
        free[s] = end
        return end

    # A stage is (re)tried when it starts and whenever a neighbour finishes an operation it
    # may be waiting for; each completion wakes at most one stage, so the work is linear.
    queue = deque(range(stages))
    queued = [True] * stages

    def wake(s: int) -> None:
        if 0 <= s < stages and not queued[s]:
            queued[s] = True
            queue.append(s)

    while queue:
        s = queue.popleft()
        queued[s] = False
        ops = order[s]
        while pos[s] < len(ops):
            kind, j = ops[pos[s]]
            ready = 0.0
            if kind == "F" and s > 0:
                dep = f_end[s - 1][j]
                if dep is None:
                    break
                ready = dep + costs.comm
            elif kind == "B" and s < stages - 1:
                dep = b_end[s + 1][j]
                if dep is None:
                    break
                ready = dep + costs.comm
            start = max(free[s], ready)
            if kind == "F":
                f_end[s][j] = record(s, "F", j, start, costs.forward[s])
                wake(s + 1)
            else:
                b_end[s][j] = record(s, "B", j, start, costs.backward[s])
                wake(s - 1)
                if j % micro == micro - 1:
                    record(s, "S", j, free[s], costs.step[s])
            pos[s] += 1

    stuck = [s for s in range(stages) if pos[s] < len(order[s])]
    if stuck:  # cannot happen for run_order's schedules; guards a broken order
        raise RuntimeError(f"schedule deadlocks: stages {stuck} wait on operations never run")
    events.sort(key=lambda e: (e["start"], e["stage"], e["end"]))
    makespan = max(free)
    return Timeline(schedule, stages, micro, batches, events, makespan, busy)


def ideal_bubble(stages: int, micro: int) -> float:
    """GPipe's bubble fraction of a flushed batch on equal stages: (P − 1)/(m + P − 1)."""
    if stages < 1 or micro < 1:
        raise ValueError(f"need stages >= 1 and micro >= 1, got {stages}, {micro}")
    return (stages - 1) / (micro + stages - 1)


def estimate_comm(events: Iterable[Mapping[str, Any]]) -> float:
    """The smallest gap between a message's sender finishing (``F`` at s − 1, ``B`` at
    s + 1) and its receiver starting the same micro-batch, clipped at 0; 0 with one stage.

    Every gap is at least the latency, and a receiver that sat waiting for the message sees
    exactly it, so the minimum estimates it; skew between the processes' clocks biases it.
    """
    end: dict[tuple[str, int, int], float] = {}
    evs = list(events)
    for e in evs:
        end[(str(e["kind"]), int(e["stage"]), int(e["micro"]))] = float(e["end"])
    gaps = []
    for e in evs:
        kind, s, j = str(e["kind"]), int(e["stage"]), int(e["micro"])
        src = s - 1 if kind == "F" else s + 1 if kind == "B" else None
        if src is not None and (kind, src, j) in end:
            gaps.append(float(e["start"]) - end[(kind, src, j)])
    return max(0.0, min(gaps)) if gaps else 0.0


def from_measurements(
    events: Iterable[Mapping[str, Any]], comm: float | None = 0.0, stages: int | None = None
) -> StageCosts:
    """:class:`StageCosts` from measured events: per stage, the median duration of its ``F``,
    ``B`` and ``S`` events (``S`` 0 when a stage recorded none).

    ``comm`` is the message latency to use; ``None`` estimates it with
    :func:`estimate_comm`. ``stages`` defaults to one more than the highest stage seen. A
    stage with no forward or no backward events raises ValueError.
    """
    evs = list(events)
    if stages is None:
        stages = 1 + max((int(e["stage"]) for e in evs), default=-1)
    if stages < 1:
        raise ValueError("no events to measure costs from")
    durations: dict[tuple[str, int], list[float]] = {}
    for e in evs:
        kind, s = str(e["kind"]), int(e["stage"])
        if kind not in KINDS:
            raise ValueError(f"event kind must be one of {KINDS}, got {kind!r:.20}")
        if not 0 <= s < stages:
            raise ValueError(f"event stage {s} outside 0..{stages - 1}")
        durations.setdefault((kind, s), []).append(float(e["end"]) - float(e["start"]))
    med: dict[str, list[float]] = {}
    for kind in KINDS:
        med[kind] = []
        for s in range(stages):
            d = durations.get((kind, s))
            if not d:
                if kind == "S":
                    med[kind].append(0.0)
                    continue
                raise ValueError(f"stage {s} has no {kind!r} events")
            med[kind].append(max(0.0, statistics.median(d)))
    latency = estimate_comm(evs) if comm is None else comm
    return StageCosts(med["F"], med["B"], med["S"], latency)
