"""An erasure request cancels its silo's training job in flight; the job's reply is discarded.

Paper: none (AFU-IC's claim is that a hospital is forgotten while the others train; a request
that waited for its silo's training job to come back first waited for the slowest part of the
federation, a straggler's job). Without this, a request for a silo that holds a training job
starts when that job's reply is back, and folded.

``JobCanceller`` takes the job out of flight at once (the silo is idle: the erasure can be sent
now, and one silo still holds at most one job), and remembers its message id until the reply
is pulled, so that it is discarded and counted rather than folded or left in the SuperLink.
What cannot be cancelled is the work itself: Flower has no way to withdraw a message already
pushed, so the ClientApp call runs to its end (in simulation on its Ray actor, in a deployment
on the hospital's node) and its reply is dropped here.

Only regular training is cancelled: an erasure's own job and FedEraser's calibration training
run to their end. A discarded reply still goes through the server's privacy accounting (the
caller's ``on_discard``): a silo that spent privacy budget on it has spent it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flwr.app import Message

from fedasync.events import EventLog
from server.dispatch import Dispatcher
from server.intake import Job, JobKind

log = logging.getLogger("fedasync.server")


@dataclass
class Cancelled:
    """A training job an erasure cancelled, whose reply has not been pulled yet."""

    job: Job
    request_id: str
    cancelled_at: float
    """Clock time of the cancel."""
    wall: float
    """``time.monotonic()`` at the cancel (a reply that never comes is forgotten after the
    server's reply timeout)."""


class JobCanceller:
    """The training jobs erasures cancelled and what became of their replies."""

    def __init__(
        self,
        jobs: Dispatcher,
        events: EventLog,
        arrived: dict[str, Message],
        now: Callable[[], float],
        version: Callable[[], int],
        on_discard: Callable[[Job, Message], None] | None = None,
    ) -> None:
        self.jobs, self.events, self.arrived = jobs, events, arrived
        self.now, self.version = now, version
        self.on_discard = on_discard
        self.pending: dict[str, Cancelled] = {}
        """Message id -> the cancelled job whose reply is still to be pulled."""
        self.cancelled = 0
        """Training jobs cancelled for an erasure."""
        self.discarded = 0
        """Their replies, pulled and dropped."""
        self.expired = 0
        """Their replies that never came (or were left when the run stopped or restarted)."""

    def cancel(self, silo: int, request_id: str) -> Job | None:
        """Cancel ``silo``'s training job in flight for erasure ``request_id``: the silo is
        idle when this returns the job. None when it holds no training job (an erasure's or a
        calibration's job runs on; nothing in flight: nothing to do)."""
        job = self.jobs.job_of(silo)
        if job is None or job.kind is not JobKind.TRAIN:
            return None
        mid = job.msg_id
        self.jobs.take(mid)
        self.cancelled += 1
        now = self.now()
        self.events.write(
            "job_cancelled",
            t=now,
            version=self.version(),
            silo=silo,
            job=job.job_id,
            request_id=request_id,
            dispatched_at=job.dispatched_at,
            would_finish_at=job.finishes_at,
        )
        log.info(
            "erasure %s: cancelled silo %d's training job %d (it would have finished at "
            "t=%.1f); its reply will be discarded",
            request_id,
            silo,
            job.job_id,
            job.finishes_at,
        )
        entry = Cancelled(job, request_id, now, time.monotonic())
        reply = self.arrived.pop(mid, None)
        if reply is not None:  # pulled already, not yet taken
            self._discard(entry, reply)
        else:
            self.pending[mid] = entry
        return job

    def waiting_ids(self) -> list[str]:
        """Message ids whose replies are still to be pulled (and dropped)."""
        return list(self.pending)

    def on_reply(self, mid: str, reply: Message) -> bool:
        """True when ``reply`` answers a cancelled job (it is dropped here)."""
        entry = self.pending.pop(mid, None)
        if entry is None:
            return False
        self._discard(entry, reply)
        return True

    def _discard(self, entry: Cancelled, reply: Message) -> None:
        self.discarded += 1
        if self.on_discard is not None:
            self.on_discard(entry.job, reply)
        self.events.write(
            "reply_discarded",
            t=self.now(),
            version=self.version(),
            silo=entry.job.silo,
            job=entry.job.job_id,
            reason=f"its job was cancelled for erasure {entry.request_id}",
            error=reply.has_error(),
        )

    def expire(self, limit_s: float) -> None:
        """Forget cancelled jobs whose reply has not come within ``limit_s`` wall seconds of the
        cancel (the server's reply timeout: the SuperLink dropped the message by then)."""
        now = time.monotonic()
        for mid in [m for m, c in self.pending.items() if now - c.wall > limit_s]:
            entry = self.pending.pop(mid)
            self.expired += 1
            log.info(
                "the reply to silo %d's cancelled job %d never came (forgotten after %gs)",
                entry.job.silo,
                entry.job.job_id,
                limit_s,
            )

    def summary(self) -> dict[str, int]:
        """The counts for summary.json."""
        return {
            "jobs_cancelled": self.cancelled,
            "cancelled_replies_discarded": self.discarded,
            "cancelled_replies_outstanding": len(self.pending) + self.expired,
        }

    def state_dict(self) -> dict[str, Any]:
        """The counts; replies still to come are counted as never come (a restarted server
        does not pull them)."""
        return {
            "cancelled": self.cancelled,
            "discarded": self.discarded,
            "expired": self.expired + len(self.pending),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.cancelled = int(d["cancelled"])
        self.discarded = int(d["discarded"])
        self.expired = int(d["expired"])
        self.pending = {}
