"""Clocks that decide which finished work is taken next: virtual (deterministic) or wall.

Paper: none; a discrete-event simulation clock. Shared by the federated server (a job is a
silo's local training, its work units are local steps) and the trainers (a job is a rollout,
its units are generated tokens; or a pipeline stage's micro-batch).

On the *virtual clock* every worker has a relative speed, a job's duration follows from its
work units (units x unit time / speed, times seeded jitter, plus latency), and work is taken
in order of virtual finish time. A run is therefore reproducible for a seed, however the real
computation is parallelised. On the *wall clock* work is taken in the order it arrives.

A loop keeps its jobs in flight in an ``InFlight`` mapping, which also keeps them in order of
finish time: the virtual clock then finds the next finish without a scan over every job in
flight (thousands, with thousands of silos). Any other mapping works too, scanned.

:class:`PoissonClocks` gives the revision times of agents that act on Poisson clocks, each on
its own (asynchronous) or all at the events of one common clock (synchronous), as in the
continuous-time pricing market (after Calvano et al., AER 2020).
"""

from __future__ import annotations

import copy
import heapq
import math
import time
from collections.abc import ItemsView, Iterator, Mapping, MutableMapping, Sequence, ValuesView
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from fedasync import seeds


class Timed(Protocol):
    """Anything with a dispatch and a finish time (a job in flight)."""

    dispatched_at: float
    finishes_at: float


T = TypeVar("T", bound=Timed)


def _same_event(t: float, first: float) -> bool:
    """Whether a finish at ``t`` is part of the event at ``first`` (simultaneous finishes)."""
    return math.isclose(t, first, rel_tol=0, abs_tol=1e-9)


class InFlight(MutableMapping[str, T], Generic[T]):
    """Jobs in flight by id, also kept in order of finish time: a heap of (``finishes_at``,
    insertion count, id, job) whose entries for removed jobs are dropped lazily (when they
    reach the top, or when they outnumber the jobs). A job's ``finishes_at`` must not change
    while it is in flight. Iteration is in insertion order, as a dict's.
    """

    def __init__(self) -> None:
        self._jobs: dict[str, T] = {}
        self._heap: list[tuple[float, int, str, T]] = []
        self._count = 0

    def __getitem__(self, key: str) -> T:
        return self._jobs[key]

    def __setitem__(self, key: str, job: T) -> None:
        if self._jobs.get(key) is job:
            return
        self._jobs[key] = job  # a job it replaces leaves a stale heap entry
        heapq.heappush(self._heap, (job.finishes_at, self._count, key, job))
        self._count += 1

    def __delitem__(self, key: str) -> None:
        del self._jobs[key]
        if len(self._heap) > 2 * len(self._jobs) + 64:
            self._heap = [e for e in self._heap if self._live(e)]
            heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[str]:
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, key: object) -> bool:
        return key in self._jobs

    def values(self) -> ValuesView[T]:
        """The jobs, in insertion order (the dict's own view)."""
        return self._jobs.values()

    def items(self) -> ItemsView[str, T]:
        """(id, job) pairs, in insertion order (the dict's own view)."""
        return self._jobs.items()

    def _live(self, entry: tuple[float, int, str, T]) -> bool:
        return self._jobs.get(entry[2]) is entry[3]

    def earliest(self) -> float:
        """The earliest finish time (inf: none in flight)."""
        heap = self._heap
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def first_event(self) -> list[str]:
        """Ids of the jobs that finish at the earliest time (within 1e-9 s), sorted; visits
        only those heap entries and their children."""
        first = self.earliest()
        heap, out = self._heap, []
        stack = [0] if heap else []
        while stack:
            i = stack.pop()
            t, _, key, _job = heap[i]
            if not _same_event(t, first):
                continue  # nor any entry below it (they finish later)
            if self._live(heap[i]):
                out.append(key)
            stack.extend(c for c in (2 * i + 1, 2 * i + 2) if c < len(heap))
        return sorted(out)


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

    def select(self, inflight: Mapping[str, Timed], arrived: AbstractSet[str]) -> list[str] | None:
        """Job ids to take now, or None to wait (``arrived``: ids whose reply is there)."""
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

    def kinds_due(self, times: Sequence[float]) -> list[int]:
        """Which of several kinds of pending event to take now, in order, given the earliest
        time of each (inf: none of that kind is pending); [] when none is."""
        ...

    def finish_at(self, worker: int, job_id: int, dispatched_at: float, units: float) -> float:
        """When a job whose work units are known only from its result finishes."""
        ...

    def ends_at(self, start: float, seconds: float) -> float:
        """When work of ``seconds`` begun at ``start`` ends, outside the workers' schedule."""
        ...

    def queue(self, free_at: list[float], ready_at: float, seconds: float) -> tuple[int, float]:
        """Work of ``seconds`` ready at ``ready_at`` on one of several servers that are free
        at ``free_at`` (updated): (the server, -1 when not modelled; when the work ends)."""
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
        rng = seeds.rng(self.seed, "job.duration", worker, job_id)
        jitter = 1.0 + self.jitter * float(rng.uniform(-1.0, 1.0))
        compute = units * self.unit_time_s / self.speeds[worker]
        return compute * jitter + self.latency_s

    def schedule(self, worker: int, job_id: int, units: float, *, jitter: bool = True) -> JobTiming:
        """Timing of a job dispatched now (``jitter=False``: exactly units x unit time / speed
        plus latency, for work outside the regular schedule)."""
        if jitter:
            return JobTiming(self.now, self.now + self.duration(worker, job_id, units))
        return JobTiming(self.now, self.now + self.span(worker, units))

    def span(self, worker: int, units: float) -> float:
        """Virtual seconds of ``units`` work units on ``worker``, without jitter (with the
        latency): what ``schedule(..., jitter=False)`` adds to now."""
        return units * self.unit_time_s / self.speeds[worker] + self.latency_s

    def next(self, t_reply: float, t_retry: float, t_timer: float) -> tuple[Next, float]:
        """The earliest of the three; on a tie a timer first, then a retry, then a reply."""
        if t_timer <= min(t_reply, t_retry):
            return Next.TIMER, t_timer
        if t_retry <= t_reply:
            return Next.RETRY, t_retry
        return Next.REPLY, t_reply

    def select(self, inflight: Mapping[str, Timed], arrived: AbstractSet[str]) -> list[str] | None:
        """Job ids to take now (all that finish at the earliest time), or None to wait.

        Simultaneous finishes are taken together, as one discrete event, so that equal
        speeds reproduce synchronous rounds exactly. An ``InFlight`` answers from its heap;
        another mapping is scanned.
        """
        if not inflight:
            return None
        if isinstance(inflight, InFlight):
            due = inflight.first_event()
        else:
            first = min(t.finishes_at for t in inflight.values())
            due = sorted(m for m, t in inflight.items() if _same_event(t.finishes_at, first))
        if all(m in arrived for m in due):
            return due
        return None

    def advance_to(self, t: float) -> None:
        """Move virtual time to ``t`` (never back)."""
        self.now = max(self.now, t)

    def next_event_time(self, inflight: Mapping[str, Timed]) -> float:
        """The earliest finish time of the jobs in flight (inf: none)."""
        if isinstance(inflight, InFlight):
            return inflight.earliest()
        return min((t.finishes_at for t in inflight.values()), default=math.inf)

    def kinds_due(self, times: Sequence[float]) -> list[int]:
        """The one kind whose event comes first (a tie goes to the kind listed first): events
        are taken one at a time, in time order; [] when none is pending."""
        best: int | None = None
        for i, t in enumerate(times):
            if t != math.inf and (best is None or t < times[best]):
                best = i
        return [] if best is None else [best]

    def finish_at(self, worker: int, job_id: int, dispatched_at: float, units: float) -> float:
        """``dispatched_at`` plus the job's ``duration`` (seeded jitter): for a job whose work
        units are known only once its result is in (a rollout's generated tokens)."""
        return dispatched_at + self.duration(worker, job_id, units)

    def ends_at(self, start: float, seconds: float) -> float:
        """``start + seconds``: work outside the workers' schedule (a learner's step)."""
        return start + seconds

    def queue(self, free_at: list[float], ready_at: float, seconds: float) -> tuple[int, float]:
        """Put the work on the earliest-free of identical servers (a tie to the lowest index),
        starting when both it and the server are ready; that server's ``free_at`` becomes its
        end. (The server, the end.)"""
        s = min(range(len(free_at)), key=lambda i: (free_at[i], i))
        end = self.ends_at(max(ready_at, free_at[s]), seconds)
        free_at[s] = end
        return s, end

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

    def select(self, inflight: Mapping[str, Timed], arrived: AbstractSet[str]) -> list[str] | None:
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

    def kinds_due(self, times: Sequence[float]) -> list[int]:
        """Every kind with an event pending, in the order listed: work whose result is in is
        due now, so the loop's order decides."""
        return [i for i, t in enumerate(times) if t != math.inf]

    def finish_at(self, worker: int, job_id: int, dispatched_at: float, units: float) -> float:
        """Now: the job's result is in hand."""
        return self.now

    def ends_at(self, start: float, seconds: float) -> float:
        """Now: the work is over once its result is in hand."""
        return self.now

    def queue(self, free_at: list[float], ready_at: float, seconds: float) -> tuple[int, float]:
        """(-1, now): real servers did the work; which one and when is what happened."""
        return -1, self.now

    def state_dict(self) -> dict:
        """The wall seconds elapsed (a resumed run's clock continues from them)."""
        return {"now": self.now}

    def load_state_dict(self, d: dict) -> None:
        """Continue from the elapsed seconds ``d`` holds."""
        self._t0 = time.monotonic() - float(d["now"])


class PoissonClocks:
    """Revision times of ``n`` agents on Poisson clocks of rate ``rate`` (events per unit time).

    Asynchronous: each agent has its own independent clock. The next event is the earliest
    of the ``n`` exponential clocks, drawn exactly as one clock of rate ``n * rate`` whose
    event goes to an agent chosen uniformly (memorylessness). Synchronous: one common clock
    of rate ``rate``; at each of its events all ``n`` agents revise. Either way each agent
    revises at rate ``rate``. The times are deterministic for the state of ``rng``.
    """

    def __init__(
        self,
        n: int,
        rate: float,
        *,
        synchronous: bool,
        rng: np.random.Generator,
        start: float = 0.0,
    ) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be > 0 and finite, got {rate}")
        if not math.isfinite(start):
            raise ValueError(f"start must be finite, got {start}")
        self.n = n
        self.rate = rate
        self.synchronous = synchronous
        self._rng = rng
        self._now = float(start)
        self._everyone = tuple(range(n))

    @property
    def now(self) -> float:
        """Time of the last event (``start`` before the first)."""
        return self._now

    def state_dict(self) -> dict[str, Any]:
        """The time of the last event and the generator's state."""
        return {"now": self._now, "rng": copy.deepcopy(self._rng.bit_generator.state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from what `state_dict` gave: the same times follow."""
        self._now = float(state["now"])
        self._rng.bit_generator.state = copy.deepcopy(state["rng"])

    def next(self) -> tuple[float, tuple[int, ...]]:
        """Advance to the next event: (its time, the agents that revise then, sorted)."""
        if self.synchronous:
            self._now += float(self._rng.exponential(1.0 / self.rate))
            return self._now, self._everyone
        self._now += float(self._rng.exponential(1.0 / (self.n * self.rate)))
        return self._now, (int(self._rng.integers(self.n)),)
