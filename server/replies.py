"""How the server takes a reply: routed by its job's kind, checked, then folded or handed on.

Paper: none. ``ReplyRouter.take`` looks the job's kind up in a table (train, calibration,
unlearn) rather than asking it in turn. A training reply is read (``read_reply``), its privacy
spend noted, checked by the intake (server/intake.py) and folded by the correction pipeline
(``fold``: server/corrections.py), which may make the next version (the loop's ``publish``); a
FedEraser calibration reply is checked and handed to the erasure coordinator, never folded; an
unlearn reply is validated and handed to the coordinator. Failures (a client error, a silo that
went down, a job abandoned for its timeout: ``abandon``) count, are written as ``reject``
events, and put the silo on the dispatcher's retry heap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from flwr.app import Message

from fedasync import Params, Rejection, RejectReason
from fedasync.tensors import is_finite
from protocol.messages import TrainRefusal
from protocol.reading import ErrorReply
from server.intake import Accepted, Job, JobKind, read_reply
from server.privacy import Stop
from server.unlearn_messages import SiloLost, read_unlearn_reply

if TYPE_CHECKING:
    from fedasync.events import EventLog
    from server.corrections import CorrectionPipeline
    from server.intake import Intake
    from server.privacy import ServerPrivacy
    from server.stats import ServerStats
    from server.unlearning import ErasureCoordinator, NoErasure

log = logging.getLogger("fedasync.server")


class ReplyRouter:
    """Takes the loop's replies, each by its job's kind (``takers``), and abandons timed-out
    jobs, each by its kind (``abandoned``). It is given the parts it uses and, as callables,
    what it reads of the loop (``model``: the version and weights now; ``base_weights``: the
    weights a job of that base version was sent, while kept; ``now``: the clock) and what it
    asks of it (``failed``: the strategy's answer to a silo down for a while; ``publish``: a
    fold's model as the next version)."""

    def __init__(
        self,
        *,
        model: Callable[[], tuple[int, Params]],
        roster: Mapping[int, int],
        intake: Intake,
        privacy: ServerPrivacy,
        pipeline: CorrectionPipeline,
        stats: ServerStats,
        events: EventLog,
        now: Callable[[], float],
        erasure: ErasureCoordinator | NoErasure,
        base_weights: Callable[[int], Params | None],
        crash_down_s: Callable[[int], float],
        offline_retry_s: float,
        failed: Callable[[int, float], None],
        publish: Callable[[Params, str], None],
    ):
        self.model, self.roster, self.intake, self.privacy = model, roster, intake, privacy
        self.pipeline, self.stats, self.events, self.now = pipeline, stats, events, now
        self.erasure, self.base_weights, self.crash_down_s = erasure, base_weights, crash_down_s
        self.offline_retry_s, self.failed, self.publish = offline_retry_s, failed, publish
        self.dc_lambda = pipeline.delay_compensation
        self.takers: dict[JobKind, Callable[[Job, Message], bool]] = {
            JobKind.TRAIN: self._train,
            JobKind.CALIBRATE: self._calibration,
            JobKind.UNLEARN: self._unlearn,
        }
        """How a reply is taken, by its job's kind: True when its silo may be sent work at once."""
        self.abandoned: dict[JobKind, Callable[[Job, str], None]] = {
            JobKind.TRAIN: lambda job, detail: None,
            JobKind.CALIBRATE: lambda job, _: erasure.take_calibration(job, None),
            JobKind.UNLEARN: lambda job, detail: erasure.requeue(job.erasure, SiloLost(detail)),
        }
        """What a job abandoned for its timeout leaves to do, by its kind."""

    def take(self, job: Job, reply: Message) -> bool:
        """Take one reply, by its job's kind; True when its silo may be sent work at once."""
        return self.takers[job.kind](job, reply)

    def abandon(self, job: Job, detail: str) -> None:
        """``job`` got no reply in time (taken out of flight): rejected, its silo sent work
        again, and what its kind leaves to do done (an erasure requeued, a rebuild told)."""
        self.reject(job, Rejection(RejectReason.CLIENT_ERROR, detail))
        self.after_failure(job, down_s=0.0)
        self.abandoned[job.kind](job, detail)

    def discarded(self, job: Job, reply: Message) -> None:
        """A cancelled job's reply: its privacy spend still counts, and a refusal (out of
        budget) still stops the silo; nothing else of it is used."""
        got = read_reply(reply)
        note = self.privacy.take(job.silo, job.job_id, got)
        if note.stop is not None:
            self.stopped(note.stop)

    def _checked(self, job: Job, reply: Message) -> tuple[Accepted | Rejection | None, Any]:
        """A train or calibration reply read and checked by the intake (None: the silo refused,
        out of privacy budget, and is stopped), and privacy's note of it."""
        got = read_reply(reply)  # an update, a refusal, or why it cannot be read
        note = self.privacy.take(job.silo, job.job_id, got)
        if isinstance(got, TrainRefusal):  # out of privacy budget: the silo is stopped
            if note.stop is not None:
                self.stopped(note.stop)
            return None, note
        if isinstance(got, Rejection):
            return got, note
        version, ref = self.model()
        return self.intake.check(got, job, version=version, reference=ref, roster=self.roster), note

    def _train(self, job: Job, reply: Message) -> bool:
        """A training reply: validated, then folded (``fold``)."""
        res, note = self._checked(job, reply)
        if res is None:
            return False
        if isinstance(res, Rejection):
            self.reject(job, res)
            if res.reason is RejectReason.CLIENT_ERROR:
                self.after_failure(job, down_s=self._down_s(job, reply))
                return False
            return True
        if note.epsilon is not None:
            res.update.metrics["dp_epsilon"] = note.epsilon
        if self.budget_refuses(job.silo, job.job_id):
            return False
        self.fold(job, res)
        return True

    def _calibration(self, job: Job, reply: Message) -> bool:
        """FedEraser's calibration reply: handed to the coordinator, never folded; its silo is
        sent regular work again only when the rebuild is done."""
        res, _ = self._checked(job, reply)
        if isinstance(res, Rejection):
            self.reject(job, res)
        self.erasure.take_calibration(
            job, None if res is None or isinstance(res, Rejection) else res.update
        )
        return False

    def _unlearn(self, job: Job, reply: Message) -> bool:
        """A silo's erasure result: validate it, then let the coordinator apply it."""
        erasure = job.erasure
        result = read_unlearn_reply(reply, self.model()[1])
        if isinstance(result, SiloLost):  # it went down mid-erasure: queued again, not failed
            self.erasure.requeue(erasure, result)
            self.after_failure(job, down_s=self._down_s(job, reply))
            return False  # sent work, and the erasure, again once it is back
        if isinstance(result, str):
            log.error("erasure %s failed: %s", erasure.request_id, result)
            self.erasure.failed(erasure, result)
            return True  # the silo goes back to training; the request says why it failed
        self.erasure.take_unlearn(erasure, result)
        return bool(erasure.sample_ids)  # a retired silo is not sent work again

    def stopped(self, stop: Stop) -> None:
        """Write the ``silo_stopped`` event of a silo privacy stopped."""
        self.events.write("silo_stopped", t=self.now(), version=self.model()[0], **stop.event())

    def budget_refuses(self, silo: int, job_id: int | None = None) -> bool:
        """True when central DP's budget stops ``silo`` (now, or earlier in this run)."""
        refuses, stop = self.privacy.over_budget(silo, job_id)
        if stop is not None:  # newly stopped
            self.stopped(stop)
        return refuses

    def _down_s(self, job: Job, reply: Message) -> float:
        """How long a failed silo waits before it is sent work again."""
        if reply.has_error() and ErrorReply(reply.error.code, reply.error.reason).offline:
            return self.offline_retry_s  # not at once: the SuperLink would refuse again
        return self.crash_down_s(job.silo) if job.fault == "crash" else 0.0

    def after_failure(self, job: Job, down_s: float) -> None:
        """The silo is down for ``down_s`` (0: free as soon as the loop goes on): the
        strategy's ``failed`` says when it is sent work again."""
        self.failed(job.silo, down_s)

    def reject(self, job: Job, rej: Rejection) -> None:
        """Count, log and write (``reject`` event) a rejected reply of ``job``."""
        self.stats.reject(job.silo, rej.reason)
        log.warning(
            "rejected reply of silo %d (job %d): %s: %s",
            job.silo,
            job.job_id,
            rej.reason.value,
            rej.detail,
        )
        self.events.write(
            "reject",
            t=self.now(),
            version=self.model()[0],
            silo=job.silo,
            job=job.job_id,
            reason=rej.reason.value,
            detail=rej.detail,
        )

    def fold(self, job: Job, acc: Accepted) -> None:
        """Correct and fold an accepted update (server/corrections.py), count it, and publish the
        new model when the fold made one."""
        update, cal = acc.update, self.erasure.calibration
        version, params = self.model()
        w_base = self.base_weights(job.base_version)
        # its base weights dropped (dispatch.MAX_SNAPSHOTS): no delay compensation
        dc_skipped = w_base is None and acc.staleness > 0 and self.dc_lambda > 0
        if not cal.compensates(job):
            w_base, dc_skipped = None, False
        overlaps: list[float] = []  # what the calibration measured, the last one logged

        def calibrate(tensors: Params) -> Params | Rejection:
            calibrated, overlap = cal.calibrate(job, tensors, acc.norm)
            if overlap is not None:
                overlaps.append(overlap)
            return calibrated

        def project(change: Params) -> Params:
            projected, overlap = cal.project_measured(change)
            if overlap is not None:
                overlaps.append(overlap)
            return projected

        res = self.pipeline.fold(
            params,
            update,
            staleness=acc.staleness,
            factor=acc.decision.factor,
            norm=acc.norm,
            w_base=w_base,
            calibrate=calibrate,
            project=project if cal.projects_applied else None,
            sink=self.erasure.fold_sink(job.silo, version),
        )
        if overlaps:
            update.metrics["calibration_overlap"] = overlaps[-1]
        if isinstance(res, Rejection):
            self.reject(job, res)
            return
        if res.released:
            self.privacy.record_release(res.released, version + 1, res.noise_std)
            update.metrics["central_epsilon"] = self.privacy.central_epsilon[job.silo]
        self.stats.accept(job.silo, acc.staleness, res.weight, res.flushed, self.now())
        if dc_skipped:
            self.stats.dc_skip()
        # the silos' exact shares of what this fold applied (kept only by an erasure part);
        # none of a model that is not finite: the loop refuses it (publish)
        shares = res.contributions if res.params is None or is_finite(res.params) else {}
        self.erasure.record(job.silo, shares, version, acc.norm)
        self.events.write(
            "update",
            t=self.now(),
            version=version,
            silo=job.silo,
            job=job.job_id,
            staleness=acc.staleness,
            weight=res.weight,
            action=acc.decision.action,
            norm=acc.norm,
            **update.metrics,
            **({"dc_skipped": True} if dc_skipped else {}),
        )
        if res.params is not None:
            self.publish(res.params, f"update of silo {job.silo} (job {job.job_id})")
