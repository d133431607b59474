"""A single-process emulator of pipeline schedules: the numbers a P-stage pipeline computes,
without the processes.

Papers: GPipe (Huang et al. 2019): all forwards of the m micro-batches, then all backwards,
one optimiser step per batch (flush). 1F1B-flush (PipeDream-Flush, Narayanan et al. 2021):
stage s runs min(P − s − 1, m) warm-up forwards, then alternates one forward and one
backward, then drains; at most P − s micro-batches hold activations at a time, against m for
GPipe. PipeDream-2BW (Narayanan et al. 2021): two weight versions per stage; a batch is
computed under the weights of one version earlier and applied to the newest,
W(t+1) = W(t) − ν ∇f(W(t−1)).

What the emulator keeps exact: per stage, the backward passes of a batch run in micro-batch
order 0..m−1 in both synchronous schedules, so gradients accumulate in the same order and
GPipe and 1F1B give the same weights bit for bit, as a real pipeline does. 2BW's older
version comes from the core's :class:`fedasync.versions.VersionedSnapshots`; with its delay
set to 0 it takes the same path as 1F1B and gives the same weights bit for bit (a test). At
the first step there is no older version: both versions are the initial weights, as in
PipeDream-2BW.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fedasync.versions import VersionedSnapshots
from trainers.pipeline.model import Stage, run_stages

SCHEDULES = ("gpipe", "1f1b", "2bw")


def stage_order(schedule: str, stages: int, micro: int) -> list[list[tuple[str, int]]]:
    """Per stage, its operations in order: ("F", i) forward or ("B", i) backward of
    micro-batch i. 2BW runs 1F1B's order without the flush (the order within a batch is the
    same)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r:.40}")
    out = []
    for s in range(stages):
        if schedule == "gpipe":
            ops = [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]
        else:
            warm = min(stages - s - 1, micro)
            ops = [("F", i) for i in range(warm)]
            f, b = warm, 0
            while b < micro:
                if f < micro:
                    ops.append(("F", f))
                    f += 1
                ops.append(("B", b))
                b += 1
        out.append(ops)
    return out


def peak_in_flight(ops: list[tuple[str, int]]) -> int:
    """Most micro-batches whose activations a stage holds at once (forward done, backward not)."""
    live = peak = 0
    for kind, _ in ops:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


class Emulator:
    """Trains ``stages`` with ``schedule`` on batches split into ``micro`` micro-batches.

    ``make_optimizer(stage)`` builds one optimiser per stage (anything with ``step``, e.g.
    :class:`trainers.pipeline.optim.StageOptimizer`). ``delay`` (2BW only) is how
    many versions older the weights a batch is computed under are: 1 for PipeDream-2BW, 0 to
    check it against 1F1B.
    """

    def __init__(
        self,
        stages: list[Stage],
        make_optimizer: Callable[[Stage], Any],
        schedule: str,
        micro: int,
        delay: int = 1,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r:.40}")
        if micro < 1:
            raise ValueError(f"micro must be >= 1, got {micro}")
        if schedule != "2bw" and delay != 0:
            delay = 0  # synchronous schedules compute under the newest weights
        if delay not in (0, 1):
            raise ValueError(f"2BW keeps two weight versions: delay 0 or 1, got {delay}")
        self.stages, self.schedule, self.micro, self.delay = stages, schedule, micro, delay
        self.opts = [make_optimizer(s) for s in stages]
        self.version = 0
        self.snapshots = VersionedSnapshots(delay + 1)
        self._shadow: list[Stage] | None = None
        if delay:
            self._shadow = copy.deepcopy(stages)
            self.snapshots.put(0, self._weights())

    def _weights(self) -> dict[str, Tensor]:
        return {f"{i}.{k}": v for i, s in enumerate(self.stages) for k, v in s.state_dict().items()}

    def step(self, x: Tensor, y: Tensor) -> float:
        """One batch: gradients under the schedule's weights, one optimiser step per stage.
        Returns the batch's mean loss under the weights it was computed with."""
        if x.shape[0] % self.micro:
            raise ValueError(
                f"batch of {x.shape[0]} does not split into {self.micro} micro-batches"
            )
        work = self.stages
        if self._shadow is not None:  # 2BW: compute under version t − 1 (t at the first step)
            old = self.snapshots.get(max(self.version - self.delay, 0))
            assert old is not None, "the older weight version is gone"
            for i, s in enumerate(self._shadow):
                s.load_state_dict(
                    {k[len(f"{i}.") :]: v for k, v in old.items() if k.startswith(f"{i}.")}
                )
            work = self._shadow
        for s in work:
            s.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym in zip(x.chunk(self.micro), y.chunk(self.micro)):
            logits = run_stages(work, xm)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ym.reshape(-1))
            (loss / self.micro).backward()
            total += float(loss.detach())
        if work is not self.stages:  # the stale gradients land on the newest weights
            for live, stale in zip(self.stages, work):
                for p, q in zip(live.parameters(), stale.parameters()):
                    p.grad = None if q.grad is None else q.grad.clone()
        for opt in self.opts:
            opt.step()
        self.version += 1
        if self._shadow is not None:
            self.snapshots.put(self.version, self._weights())
        return total / self.micro


@torch.no_grad()
def evaluate(stages: list[Stage], batches: list[tuple[Tensor, Tensor]]) -> float:
    """Mean cross-entropy (nats per character) of ``batches``."""
    losses: list[Any] = []
    for x, y in batches:
        logits = run_stages(stages, x)
        losses.append(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))))
    return sum(losses) / max(len(losses), 1)
