"""How work leaves the server: the jobs in flight (one per silo at most), retries, faults.

Paper: none. Two parts of the server, each with its own ``state_dict``:

- ``Dispatcher``: the jobs in flight, the weights each was sent (by version: DC-ASGD's
  ``w_base``, and what a checkpoint re-sends), the silos waiting out a failure (a heap of
  retry times) and job ids. ``send`` is the single point where work leaves the server, and
  it enforces the invariant *one silo, at most one job in flight*: a second job for a silo
  that holds one, or that waits out a failure, is refused, logged, counted and written as a
  ``dispatch_refused`` event (a bug in whoever asked), never sent.
- ``FaultSchedule``: the faults a robustness run injects (``faults`` in the config), each
  told to its silo in the train message once the model reaches its version.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from fedasync import Params
from fedasync.clock import Clock, InFlight
from fedasync.events import EventLog
from protocol.erasure_messages import reported_work
from server.intake import Job, JobKind

log = logging.getLogger("fedasync.server")


MAX_SNAPSHOTS = 64
"""Versions of the model whose weights are kept for the jobs in flight (DC-ASGD's w_base, and
what a checkpoint re-sends); past it the oldest is dropped. A constant, not a setting: it only
bounds the server's memory with thousands of silos, and no run has needed another value (a
stale update whose base was dropped is folded without delay compensation: ``dc_skipped``)."""


class Dispatcher:
    """The jobs in flight on ``grid``, keyed by message id, and the silos due a retry.

    ``inflight`` is changed only through ``send`` and ``take``, ``retries`` only through
    ``retry_after`` and ``next_retry``: they keep the indexes that answer
    ``holding``, ``is_down`` and ``prune_sent`` without a scan over every job in flight (a
    loop with thousands of silos asks them for every update).

    ``sent`` keeps the weights of at most ``max_snapshots`` base versions (None: every
    version a job in flight was sent): past that, the oldest is dropped. A job whose base
    was dropped gets no delay compensation (the loop counts it), and a checkpoint re-sends it
    from the model current at the checkpoint (``state_dict``).
    """

    def __init__(
        self, grid: Grid, clock: Clock, events: EventLog, max_snapshots: int | None = None
    ):
        self.grid = grid
        self.clock = clock
        self.events = events
        self.inflight: InFlight[Job] = InFlight()
        """The jobs in flight by message id (the clock's ``InFlight``: kept in finish order)."""
        self.unanswered: dict[str, None] = {}
        """Message ids in flight whose reply has not been pulled (``answered``), in send order."""
        self.retries: list[tuple[float, int]] = []
        """(clock time, silo): a heap of silos to send work again."""
        self.sent: dict[int, Params] = {}
        """The weights in-flight jobs were sent, by version; pruned when no job refers to them,
        and to the newest ``max_snapshots`` versions."""
        self.max_snapshots = max_snapshots
        self.snapshots_dropped = 0
        """Versions dropped from ``sent`` by ``max_snapshots`` while a job still referred to them."""
        self.next_job_id = 0
        self.refused = 0
        """Second jobs for a busy or down silo (0 unless a bug asked)."""
        self._by_silo: dict[int, Job] = {}
        self._down: dict[int, list[float]] = {}  # silo -> its retry times
        self._refs: dict[int, int] = {}  # base version -> jobs in flight sent it
        self._unreferenced: set[int] = set()  # versions in sent that may have no job left

    def new_job_id(self) -> int:
        """A job id never used in this run (resumed runs continue the count)."""
        job_id = self.next_job_id
        self.next_job_id += 1
        return job_id

    def holding(self, silo: int) -> str | None:
        """Why ``silo`` may not be sent work now (None: it is idle): a job in flight, or a
        failure it waits out (its retry entry is taken off before it is re-sent)."""
        j = self._by_silo.get(silo)
        if j is not None:
            return f"its {j.kind} job {j.job_id} is in flight"
        if silo in self._down:
            return f"it is down until t={self._down[silo][0]:.1f}"
        return None

    def is_down(self, silo: int) -> bool:
        """A silo whose work failed and that waits to be sent work again (offline)."""
        return silo in self._down

    def reschedule(self, mid: str, finishes_at: float) -> Job:
        """Message ``mid``'s job, now finishing at ``finishes_at`` and no longer elastic (a new
        ``Job``: the clock's heap keeps the old entry, which no longer counts)."""
        job = replace(self.inflight[mid], finishes_at=finishes_at, work=None)
        self.inflight[mid] = job
        self._by_silo[job.silo] = job
        return job

    def settle(self, due: list[str], arrived: Mapping[str, Message]) -> bool:
        """Virtual clock: jobs among ``due`` whose length their silo decided (``Job.work``)
        finish after the work their reply (in ``arrived``) reports (within the job's bounds; a
        reply that reports none, an error, counts the least) rather than now; True when one
        moved (the loop then takes whatever is due first)."""
        moved = False
        for mid in due:
            job = self.inflight[mid]
            if job.work is None:
                continue
            least, most = job.work
            reported = reported_work(arrived[mid])
            units = least if reported is None else min(max(reported, least), most)
            finish = job.dispatched_at + self.clock.span(job.silo, units)  # type: ignore[attr-defined]
            self.reschedule(mid, max(finish, job.finishes_at))
            moved = moved or finish > job.finishes_at + 1e-9
        return moved

    def job_of(self, silo: int) -> Job | None:
        """``silo``'s job in flight, if any."""
        return self._by_silo.get(silo)

    def refuse(self, silo: int, kind: str, why: str, job_id: int | None, version: int) -> None:
        """Count, log and write a refused second job for ``silo``."""
        self.refused += 1
        log.error("refused to send silo %d a second (%s) job: %s", silo, kind, why)
        self.events.write(
            "dispatch_refused",
            t=self.clock.now,
            version=version,
            silo=silo,
            kind=kind,
            job=job_id,
            detail=why,
        )

    def send(self, msg: Message, job: Job, version: int) -> bool:
        """Push ``msg`` (``job``'s message) unless ``job``'s silo holds work (then refused);
        True when sent."""
        why = self.holding(job.silo)
        if why is not None:
            self.refuse(job.silo, job.kind, why, job.job_id, version)
            return False
        (mid,) = list(self.grid.push_messages([msg]))
        job.msg_id = mid
        job.wall_sent = time.monotonic()
        self.inflight[mid] = job
        self.unanswered[mid] = None
        self._by_silo[job.silo] = job
        self._refs[job.base_version] = self._refs.get(job.base_version, 0) + 1
        return True

    def answered(self, mid: str) -> None:
        """The reply to message ``mid`` was pulled (it waits in the loop to be taken)."""
        self.unanswered.pop(mid, None)

    def take(self, mid: str) -> Job:
        """Take message ``mid``'s job out of flight (its reply is taken, or it is abandoned)."""
        job = self.inflight.pop(mid)
        self.unanswered.pop(mid, None)
        if self._by_silo.get(job.silo) is job:
            del self._by_silo[job.silo]
        v = job.base_version
        self._refs[v] -= 1
        if self._refs[v] == 0:
            del self._refs[v]
            self._unreferenced.add(v)
        return job

    def take_timed_out(self, limit_s: float) -> list[Job]:
        """Take out of flight the jobs whose message has waited for a reply more than
        ``limit_s`` wall seconds, oldest first."""
        now, expired = time.monotonic(), []
        for mid in self.unanswered:  # sent in order, so the oldest first
            if now - self.inflight[mid].wall_sent <= limit_s:
                break
            expired.append(mid)
        return [self.take(mid) for mid in expired]

    def retry_after(self, silo: int, down_s: float) -> None:
        """Send ``silo`` work again ``down_s`` clock seconds from now."""
        t = self.clock.now + down_s
        heapq.heappush(self.retries, (t, silo))
        self._down.setdefault(silo, []).append(t)

    def next_retry(self) -> tuple[float, int]:
        """Take the earliest retry off the heap: (its time, its silo)."""
        t, silo = heapq.heappop(self.retries)
        times = self._down[silo]
        times.remove(t)
        if not times:
            del self._down[silo]
        return t, silo

    def keep_sent(self, version: int, params: Params) -> None:
        """Keep ``params`` as the weights jobs of base ``version`` are sent; past
        ``max_snapshots`` versions, those no job refers to go first, then the oldest."""
        self.sent[version] = params
        self._unreferenced.add(version)
        cap = self.max_snapshots
        if cap is None or len(self.sent) <= cap:
            return
        self.prune_sent(keep=version)
        while len(self.sent) > cap:
            del self.sent[min(self.sent)]
            self.snapshots_dropped += 1

    def prune_sent(self, keep: int | None = None) -> None:
        """Forget the weights no job in flight was sent (but those of version ``keep``)."""
        for v in self._unreferenced:
            if v != keep and v not in self._refs:
                self.sent.pop(v, None)
        self._unreferenced = {keep} if keep is not None and keep in self.sent else set()

    def train_jobs(self) -> list[Job]:
        """The regular train jobs in flight, in job order (what a checkpoint re-sends; erasure
        work is restarted from the erasure store instead)."""
        return sorted(
            (j for j in self.inflight.values() if j.kind is JobKind.TRAIN), key=lambda j: j.job_id
        )

    def jobs_to_resend(self) -> list[dict[str, Any]]:
        """``train_jobs`` as a checkpoint keeps them, to be re-sent identically on resume."""
        keys = ("silo", "job_id", "base_version", "dispatched_at", "finishes_at", "fault")
        return [{k: getattr(j, k) for k in keys} for j in self.train_jobs()]

    def state_dict(self, params: Params, version: int) -> dict[str, Any]:
        """Job ids, retries, the refusal count, and the weights the train jobs in flight were
        sent (``params`` is the model at the current ``version``). A job whose weights were
        dropped (``max_snapshots``) has none here: resumed, it is re-sent the model current at
        the checkpoint, at its version (the loop's ``dispatch``), rather than the checkpoint
        keeping a copy per version in flight, which is what the bound is there to avoid."""
        bases: dict[int, Params] = {}
        for j in self.train_jobs():
            v = j.base_version
            if v not in bases and (v == version or v in self.sent):
                bases[v] = params if v == version else self.sent[v]
        return {
            "next_job_id": self.next_job_id,
            "retries": list(self.retries),
            "base_params": bases,
            "refused": self.refused,
            "snapshots_dropped": self.snapshots_dropped,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (no job is in flight after a restart)."""
        self.next_job_id = int(d["next_job_id"])
        self.retries = [(float(t), int(s)) for t, s in d["retries"]]
        heapq.heapify(self.retries)
        self._down = {}
        for t, s in self.retries:
            self._down.setdefault(s, []).append(t)
        self.sent = {int(v): p for v, p in d["base_params"].items()}
        self._unreferenced = set(self.sent)
        self.refused = int(d["refused"])
        self.snapshots_dropped = int(d.get("snapshots_dropped", 0))


class FaultSchedule:
    """Faults to inject (robustness runs): each is told to its silo in the first train message
    sent once the model has reached its ``at_version``; ``fired`` keeps what was injected."""

    def __init__(self, faults: list[dict[str, Any]]):
        self.pending = list(faults)
        self.fired: list[dict[str, Any]] = []

    def take(self, silo: int, version: int, now: float) -> dict[str, Any] | None:
        """The fault due for ``silo`` at ``version`` (taken off the schedule), or None."""
        for i, f in enumerate(self.pending):
            if f["silo"] == silo and version >= f["at_version"]:
                self.pending.pop(i)
                self.fired.append({**f, "t": now, "version": version})
                return f
        return None

    def replay_pending(self, silo: int) -> bool:
        """Whether a replay fault is still to come for ``silo`` (its silo must keep a reply)."""
        return any(f["silo"] == silo and f["kind"] == "replay" for f in self.pending)

    def crash_down_s(self, silo: int) -> float:
        """How long ``silo``'s latest injected crash keeps it down (0 without one)."""
        fired = [f for f in self.fired if f["silo"] == silo and f["kind"] == "crash"]
        return float(fired[-1]["down_s"]) if fired else 0.0

    def state_dict(self) -> dict[str, Any]:
        """The faults still to come and those injected."""
        return {"pending": list(self.pending), "fired": list(self.fired)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.pending = list(d["pending"])
        self.fired = list(d["fired"])
