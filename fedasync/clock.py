"""Clocks that decide which finished work is taken next: virtual (deterministic) or wall.

Paper: none; a discrete-event simulation clock. Shared by the federated server (a job is a
silo's local training, its work units are local steps) and the trainers (a job is a rollout,
its units are generated tokens; or a pipeline stage's micro-batch).

On the *virtual clock* every worker has a relative speed, a job's duration follows from its
work units (units x unit time / speed, times seeded jitter, plus latency), and work is taken
in order of virtual finish time. A run is therefore reproducible for a seed, however the real
computation is parallelised. On the *wall clock* work is taken in the order it arrives.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

import numpy as np


class Timed(Protocol):
    """Anything with a dispatch and a finish time (a job in flight)."""

    dispatched_at: float
    finishes_at: float


@dataclass
class JobTiming:
    """When a job was sent and when it finishes, in seconds of the clock in use."""

    dispatched_at: float
    finishes_at: float


class Next(Enum):
    """What a loop driven by a clock does next (``Clock.next``)."""

    TIMER = "timer"
    """A scheduled event is due (an erasure request on its schedule)."""
    RETRY = "retry"
    """A worker that failed is due to be sent work again."""
    REPLY = "reply"
    """Wait for finished work and take it."""


@runtime_checkable
class Clock(Protocol):
    """What a loop asks its clock; ``VirtualClock`` and ``WallClock`` are the two clocks.

    The loop never asks which clock it has: ``next`` says what to do next, ``advance_to``
    moves virtual time (wall time moves by itself), and ``realtime`` says whether waiting for
    replies must give way to timers that fall due meanwhile.
    """

    kind: str
    realtime: bool

    @property
    def now(self) -> float:
        """Clock time in seconds."""
        ...

    def schedule(self, worker: int, job_id: int, units: float, *, jitter: bool = True) -> JobTiming:
        """Timing of a job of ``units`` work units sent to ``worker`` now."""
        ...

    def select(self, inflight: Mapping[str, Timed], arrived: set[str]) -> list[str] | None:
        """Job ids to take now, or None to wait."""
        ...

    def next(self, t_reply: float, t_retry: float, t_timer: float) -> tuple[Next, float]:
        """What to do next, and at which clock time, given the earliest reply, retry and timer."""
        ...

    def advance_to(self, t: float) -> None:
        """Move the clock to ``t`` (never back)."""
        ...

    def next_event_time(self, inflight: Mapping[str, Timed]) -> float:
        """The clock time of the earliest reply the loop can take."""
        ...

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the clock."""
        ...

    def load_state_dict(self, d: dict) -> None:
        """Restore what ``state_dict`` returned."""
        ...


class VirtualClock:
    """Deterministic virtual time; the next job to take is the one that finishes first.

    ``speeds[w]`` is worker ``w``'s relative speed (1.0 = reference); ``unit_time_s`` the
    virtual seconds one work unit takes at speed 1; ``jitter`` in [0, 1) scales a job's compute
    by a seeded factor in [1 − jitter, 1 + jitter]; ``latency_s`` is added to every job.
    """

    kind = "virtual"
    realtime = False

    def __init__(
        self,
        speeds: Sequence[float],
        unit_time_s: float,
        *,
        jitter: float = 0.0,
        latency_s: float = 0.0,
        seed: int = 0,
    ):
        if any(not s > 0 for s in speeds):
            raise ValueError("every worker speed must be > 0")
        if unit_time_s < 0 or latency_s < 0 or not 0.0 <= jitter < 1.0:
            raise ValueError("unit_time_s and latency_s must be >= 0 and jitter in [0, 1)")
        self.speeds = list(speeds)
        self.unit_time_s = unit_time_s
        self.jitter = jitter
        self.latency_s = latency_s
        self.seed = seed
        self.now = 0.0

    def duration(self, worker: int, job_id: int, units: float) -> float:
        """Virtual seconds of job ``job_id`` of ``units`` work units on ``worker``."""
        rng = np.random.default_rng([self.seed, worker, job_id, 104729])
        jitter = 1.0 + self.jitter * float(rng.uniform(-1.0, 1.0))
        compute = units * self.unit_time_s / self.speeds[worker]
        return compute * jitter + self.latency_s

    def schedule(self, worker: int, job_id: int, units: float, *, jitter: bool = True) -> JobTiming:
        """Timing of a job dispatched now (``jitter=False``: exactly units x unit time / speed
        plus latency, for work outside the regular schedule)."""
        if jitter:
            return JobTiming(self.now, self.now + self.duration(worker, job_id, units))
        compute = units * self.unit_time_s / self.speeds[worker]
        return JobTiming(self.now, self.now + compute + self.latency_s)

    def next(self, t_reply: float, t_retry: float, t_timer: float) -> tuple[Next, float]:
        """The earliest of the three; on a tie a timer first, then a retry, then a reply."""
        if t_timer <= min(t_reply, t_retry):
            return Next.TIMER, t_timer
        if t_retry <= t_reply:
            return Next.RETRY, t_retry
        return Next.REPLY, t_reply

    def select(self, inflight: Mapping[str, Timed], arrived: set[str]) -> list[str] | None:
        """Job ids to take now (all that finish at the earliest time), or None to wait.

        Simultaneous finishes are taken together, as one discrete event, so that equal
        speeds reproduce synchronous rounds exactly.
        """
        if not inflight:
            return None
        first = min(t.finishes_at for t in inflight.values())
        due = sorted(
            m
            for m, t in inflight.items()
            if math.isclose(t.finishes_at, first, rel_tol=0, abs_tol=1e-9)
        )
        if all(m in arrived for m in due):
            return due
        return None

    def advance_to(self, t: float) -> None:
        """Move virtual time to ``t`` (never back)."""
        self.now = max(self.now, t)

    def next_event_time(self, inflight: Mapping[str, Timed]) -> float:
        """The earliest finish time of the jobs in flight (inf: none)."""
        return min((t.finishes_at for t in inflight.values()), default=math.inf)

    def state_dict(self) -> dict:
        """The virtual time."""
        return {"now": self.now}

    def load_state_dict(self, d: dict) -> None:
        """Restore the virtual time."""
        self.now = float(d["now"])


class WallClock:
    """Wall time since start; work is taken as it arrives."""

    kind = "wall"
    realtime = True

    def __init__(self, start_offset: float = 0.0):
        self._t0 = time.monotonic() - start_offset

    @property
    def now(self) -> float:
        """Wall seconds since the clock started (plus the offset it resumed from)."""
        return time.monotonic() - self._t0

    def schedule(
        self, worker: int, job_id: int, units: float = 0.0, *, jitter: bool = True
    ) -> JobTiming:
        """Sent now; when it finishes is not known (inf) until its reply arrives."""
        return JobTiming(self.now, math.inf)

    def select(self, inflight: Mapping[str, Timed], arrived: set[str]) -> list[str] | None:
        """Every arrived reply, in the order its job was sent; None when none has arrived."""
        due = sorted((m for m in arrived if m in inflight), key=lambda m: inflight[m].dispatched_at)
        return due or None

    def next(self, t_reply: float, t_retry: float, t_timer: float) -> tuple[Next, float]:
        """A retry that is due, else wait for replies; always now (timers are polled)."""
        now = self.now
        return (Next.RETRY if t_retry <= now else Next.REPLY), now

    def advance_to(self, t: float) -> None:
        """Nothing: wall time advances by itself."""
        return None

    def next_event_time(self, inflight: Mapping[str, Timed]) -> float:
        """Now: a reply may arrive at any moment."""
        return self.now

    def state_dict(self) -> dict:
        """The wall seconds elapsed (a resumed run's clock continues from them)."""
        return {"now": self.now}

    def load_state_dict(self, d: dict) -> None:
        """Continue from the elapsed seconds ``d`` holds."""
        self._t0 = time.monotonic() - float(d["now"])
