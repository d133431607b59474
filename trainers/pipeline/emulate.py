"""A single-process emulator of pipeline schedules: the numbers a P-stage pipeline computes,
without the processes.

Papers and schedules: :mod:`trainers.pipeline.schedule`; what each stage computes:
:mod:`trainers.pipeline.worker`. The emulator runs every stage's :class:`StageWorker` in one
loop, each stage in its own operation order, an operation as soon as its input is there
(the output of the previous stage's forward, the gradient of the next stage's backward).
Only the order within a stage decides the numbers, so this gives what the real pipeline
gives (a test). Per stage, the backward passes of a batch run in micro-batch order in every
schedule, so GPipe and 1F1B give the same weights bit for bit, and 2BW with its delay set to
0 equals 1F1B bit for bit (a test).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fedasync.corrections import DelayErrorFeedback
from trainers.pipeline.model import Stage, run_stages
from trainers.pipeline.schedule import SCHEDULES, batch_order, peak_in_flight, run_order
from trainers.pipeline.worker import MicroBatches, StageWorker

__all__ = ["SCHEDULES", "Emulator", "emulate", "evaluate", "peak_in_flight", "stage_order"]


def stage_order(schedule: str, stages: int, micro: int) -> list[list[tuple[str, int]]]:
    """Per stage, one batch's operations (:func:`trainers.pipeline.schedule.batch_order`)."""
    return batch_order(schedule, stages, micro)


def emulate(
    workers: list[StageWorker],
    get_batch: Callable[[int], tuple[Tensor, Tensor]],
    batches: int,
    start: int = 0,
) -> None:
    """Run batches ``start .. start + batches − 1`` through ``workers`` (one per stage, in
    order) in their schedule's order; ``get_batch(t)`` gives batch t's ids and targets."""
    w0 = workers[0]
    P, m = len(workers), w0.micro
    orders = run_order(w0.schedule, P, m, batches, start=start, delay=w0.delay)
    pos = [0] * P
    acts: dict[tuple[int, int], Tensor] = {}
    grads: dict[tuple[int, int], Tensor] = {}
    micro_batch = MicroBatches(get_batch, m, keep=P // m + 2)

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(P):
            while pos[s] < len(orders[s]):
                kind, j = orders[s][pos[s]]
                if kind == "F":
                    if s == 0:
                        inp = micro_batch(j)[0]
                    elif (s, j) in acts:
                        inp = acts.pop((s, j))
                    else:
                        break
                    out = workers[s].forward(j, inp)
                    if s < P - 1:
                        acts[(s + 1, j)] = out
                else:
                    if s == P - 1:
                        incoming = micro_batch(j)[1]
                    elif (s, j) in grads:
                        incoming = grads.pop((s, j))
                    else:
                        break
                    g = workers[s].backward(j, incoming)
                    if s > 0:
                        assert g is not None
                        grads[(s - 1, j)] = g
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule deadlocked at positions {pos}")  # a schedule bug


class Emulator:
    """Trains ``stages`` with ``schedule`` on batches split into ``micro`` micro-batches, one
    batch per :meth:`step` (flushed schedules and 2BW; PACI's order spans batches: use
    :func:`emulate`).

    ``make_optimizer(stage)`` builds one optimiser per stage (anything with ``step``,
    ``zero_grad``, ``state_dict``). ``delay`` (2BW only): 1 for PipeDream-2BW, 0 to check it
    against 1F1B. ``correction`` (2BW): the delay error-feedback coefficient β, or None.
    """

    def __init__(
        self,
        stages: list[Stage],
        make_optimizer: Callable[[Stage], Any],
        schedule: str,
        micro: int,
        delay: int = 1,
        correction: float | None = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r:.40}")
        if schedule == "paci":
            raise ValueError("PACI's operations span batches: run it with emulate()")
        if micro < 1:
            raise ValueError(f"micro must be >= 1, got {micro}")
        if schedule != "2bw":
            delay = 0  # synchronous schedules compute under the newest weights
        if delay not in (0, 1):
            raise ValueError(f"2BW keeps two weight versions: delay 0 or 1, got {delay}")
        self.stages, self.schedule, self.micro, self.delay = stages, schedule, micro, delay
        self.opts = [make_optimizer(s) for s in stages]
        fix = DelayErrorFeedback(correction) if correction is not None else None
        self.workers = [
            StageWorker(s, o, schedule, micro, delay=delay, correction=fix, record=False)
            for s, o in zip(stages, self.opts)
        ]
        self.version = 0

    def step(self, x: Tensor, y: Tensor) -> float:
        """One batch: gradients under the schedule's weights, one optimiser step per stage.
        Returns the batch's mean loss under the weights it was computed with."""
        if x.shape[0] % self.micro:
            raise ValueError(
                f"batch of {x.shape[0]} does not split into {self.micro} micro-batches"
            )
        t = self.version
        emulate(self.workers, lambda _: (x, y), 1, start=t)
        self.version += 1
        last = self.workers[-1].losses
        losses = [last.pop(t * self.micro + i) for i in range(self.micro)]
        return sum(losses) / self.micro


@torch.no_grad()
def evaluate(stages: list[Stage], batches: list[tuple[Tensor, Tensor]]) -> float:
    """Mean cross-entropy (nats per character) of ``batches``."""
    losses: list[Any] = []
    for x, y in batches:
        logits = run_stages(stages, x)
        losses.append(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))))
    return sum(losses) / max(len(losses), 1)
