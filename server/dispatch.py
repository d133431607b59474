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
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from fedasync import Params
from fedasync.clock import Clock
from fedasync.events import EventLog
from server.intake import Job, JobKind

log = logging.getLogger("fedasync.server")


class Dispatcher:
    """The jobs in flight on ``grid``, keyed by message id, and the silos due a retry."""

    def __init__(self, grid: Grid, clock: Clock, events: EventLog):
        self.grid = grid
        self.clock = clock
        self.events = events
        self.inflight: dict[str, Job] = {}
        self.retries: list[tuple[float, int]] = []
        """(clock time, silo): a heap of silos to send work again."""
        self.sent: dict[int, Params] = {}
        """The weights in-flight jobs were sent, by version; pruned when no job refers to them."""
        self.next_job_id = 0
        self.refused = 0
        """Second jobs for a busy or down silo (0 unless a bug asked)."""

    def new_job_id(self) -> int:
        """A job id never used in this run (resumed runs continue the count)."""
        job_id = self.next_job_id
        self.next_job_id += 1
        return job_id

    def holding(self, silo: int) -> str | None:
        """Why ``silo`` may not be sent work now (None: it is idle): a job in flight, or a
        failure it waits out (its retry entry is taken off before it is re-sent)."""
        for j in self.inflight.values():
            if j.silo == silo:
                return f"its {j.kind} job {j.job_id} is in flight"
        for t, s in self.retries:
            if s == silo:
                return f"it is down until t={t:.1f}"
        return None

    def is_down(self, silo: int) -> bool:
        """A silo whose work failed and that waits to be sent work again (offline)."""
        return any(s == silo for _, s in self.retries)

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
        return True

    def retry_after(self, silo: int, down_s: float) -> None:
        """Send ``silo`` work again ``down_s`` clock seconds from now."""
        heapq.heappush(self.retries, (self.clock.now + down_s, silo))

    def next_retry(self) -> tuple[float, int]:
        """Take the earliest retry off the heap: (its time, its silo)."""
        return heapq.heappop(self.retries)

    def prune_sent(self) -> None:
        """Forget the weights no job in flight was sent."""
        live = {j.base_version for j in self.inflight.values()}
        for v in [v for v in self.sent if v not in live]:
            del self.sent[v]

    def train_jobs(self) -> list[Job]:
        """The regular train jobs in flight, in job order (what a checkpoint re-sends; erasure
        work is restarted from the erasure store instead)."""
        return sorted(
            (j for j in self.inflight.values() if j.kind is JobKind.TRAIN), key=lambda j: j.job_id
        )

    def state_dict(self, params: Params, version: int) -> dict[str, Any]:
        """Job ids, retries, the refusal count, and the weights the train jobs in flight were
        sent (``params`` is the model at the current ``version``)."""
        bases: dict[int, Params] = {}
        for j in self.train_jobs():
            if j.base_version not in bases:
                v = j.base_version
                bases[v] = params if v == version else self.sent[v]
        return {
            "next_job_id": self.next_job_id,
            "retries": list(self.retries),
            "base_params": bases,
            "refused": self.refused,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (no job is in flight after a restart)."""
        self.next_job_id = int(d["next_job_id"])
        self.retries = [(float(t), int(s)) for t, s in d["retries"]]
        heapq.heapify(self.retries)
        self.sent = {int(v): p for v, p in d["base_params"].items()}
        self.refused = int(d["refused"])


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
