"""Pipeline schedules as per-stage operation lists over a whole run.

Papers: GPipe (Huang et al. 2019): per batch, all m forwards then all m backwards, then one
optimiser step (flush). 1F1B-flush (PipeDream-Flush, Narayanan et al. 2021): per batch,
stage s runs min(P − s − 1, m) warm-up forwards, then one forward and one backward in turn,
then drains, then steps. PipeDream-2BW (Narayanan et al. 2021) and PACI (Elam et al. 2026,
arXiv 2606.07881) run 1F1B *without* the flush: the micro-batches of a run form one stream,
so a stage starts the next batch's forwards while the previous batch's backwards are still
coming back, and no stage waits for the pipeline to fill or drain after the first batch.

An operation is ``("F", j)`` or ``("B", j)`` for the run's micro-batch ``j`` (batch
``j // m``, position ``j % m``). A stage steps its optimiser after every m-th backward in
every schedule: the step of batch t follows ``("B", t·m + m − 1)``. The order within a stage
fixes its numbers; which interleaving of stages a machine happens to run does not (data
moves only from a forward at stage s to one at s + 1 and from a backward at s + 1 to one at
s), so an emulator in one process and the real pipeline compute the same weights.

Version drift: in the flushed schedules a micro-batch's forward and backward run under the
same weights. Without the flush, a stage's forward of micro-batch j comes after its
backward of j − w − 1 (w = P − s − 1 warm-up forwards), so between its forward and its
backward the stage steps at most ceil(w / m) times: :func:`max_drift`. PACI bounds the drift
this way (gradient accumulation over m micro-batches slows the version clock); 2BW instead
computes the whole batch under a stashed version one step old.
"""

from __future__ import annotations

import math

SCHEDULES = ("gpipe", "1f1b", "2bw", "paci")
SYNCHRONOUS = ("gpipe", "1f1b")
"""Schedules that flush the pipeline every batch (their forward and backward see the same
weights)."""

Op = tuple[str, int]


def _check(schedule: str, stages: int, micro: int, batches: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r:.40}")
    if stages < 1 or micro < 1 or batches < 0:
        raise ValueError(
            f"need stages >= 1, micro >= 1, batches >= 0; got {stages}, {micro}, {batches}"
        )


def _one_f_one_b(stage: int, stages: int, n: int, offset: int = 0) -> list[Op]:
    warm = min(stages - stage - 1, n)
    ops: list[Op] = [("F", offset + i) for i in range(warm)]
    f = warm
    for b in range(n):
        if f < n:
            ops.append(("F", offset + f))
            f += 1
        ops.append(("B", offset + b))
    return ops


def run_order(
    schedule: str, stages: int, micro: int, batches: int, start: int = 0, delay: int = 1
) -> list[list[Op]]:
    """Per stage, its operations over ``batches`` batches of ``micro`` micro-batches, from
    batch ``start`` (a resumed run refills the pipeline there). 2BW with ``delay`` 0 computes
    under the newest weights, which exist only after the previous batch's step: it flushes,
    in 1F1B's order."""
    _check(schedule, stages, micro, batches)
    if schedule == "2bw" and delay == 0:
        schedule = "1f1b"
    if start:
        o = start * micro
        return [[(k, j + o) for k, j in ops] for ops in run_order(schedule, stages, micro, batches)]
    out: list[list[Op]] = []
    for s in range(stages):
        if schedule == "gpipe":
            ops = []
            for t in range(batches):
                o = t * micro
                ops += [("F", o + i) for i in range(micro)] + [("B", o + i) for i in range(micro)]
        elif schedule == "1f1b":
            ops = []
            for t in range(batches):
                ops += _one_f_one_b(s, stages, micro, t * micro)
        else:
            ops = _one_f_one_b(s, stages, micro * batches)
        out.append(ops)
    return out


def batch_order(schedule: str, stages: int, micro: int) -> list[list[Op]]:
    """One batch's operations per stage (of a flushed schedule; 2BW and PACI: the first
    batch's operations of the stream, which is the 1F1B order)."""
    if schedule in SYNCHRONOUS:
        return run_order(schedule, stages, micro, 1)
    _check(schedule, stages, micro, 1)
    return [_one_f_one_b(s, stages, micro) for s in range(stages)]


def peak_in_flight(ops: list[Op]) -> int:
    """Most micro-batches whose activations a stage holds at once (forward done, backward not)."""
    live = peak = 0
    for kind, _ in ops:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def max_drift(schedule: str, stages: int, micro: int) -> int:
    """Most optimiser steps any stage takes between a micro-batch's forward and its backward
    (0 for the flushed schedules; for 2BW the drift of the live weights, which its stash
    hides)."""
    _check(schedule, stages, micro, 1)
    if schedule in SYNCHRONOUS:
        return 0
    return math.ceil((stages - 1) / micro)


def micro_for_drift(stages: int, drift: int) -> int:
    """The fewest micro-batches per step (PACI's local accumulation) that keep the drift at or
    below ``drift`` (≥ 1) on ``stages`` stages."""
    if drift < 1:
        raise ValueError(f"drift bound must be >= 1 for an asynchronous schedule, got {drift}")
    return max(1, math.ceil((stages - 1) / drift))
