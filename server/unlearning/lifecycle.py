"""The erasure request lifecycle: queued -> erasing -> calibrating -> verified or unverified
(checked after the relearning window: every check within, or one not), or failed.

Owns (``ErasureCoordinator``, in its ``state_dict``): the requests in progress, applied and
scheduled, the verification reports, the silos retired or with samples excluded, the ledger
(the server's removal at a request's start), the audit rows and ``erasure`` events; and, as
parts with a ``state_dict`` each, the calibration (calibration.py) and FedEraser's rebuild
(rebuild.py). The package's docstring (__init__.py) tells the whole design.

A silo that goes down while erasing (its reply is an error: its ClientApp crashed or raised,
its SuperNode restarted, the SuperLink reports it offline; or no reply within
``server.reply_timeout_s``) sends its request back: erasing -> queued, the audit row saying
why, and it is started again (from the then-current model) when the silo is back. Of an
erasure only the server's removal is in the model before erasing -> calibrating (in force at
its first start, the silo's recorded sum then forgotten, so a second start has nothing to
remove), and the silo's part comes with erasing -> calibrating: each is applied once however
often it was started. An offline silo (the SuperLink's word) is tried again after
``lab.offline_retry_s`` and not counted; any other loss counts, and the
``MAX_ATTEMPTS``-th one (3) fails the request with the reason. A reply
that arrives but is malformed fails it at once, as do requests a method cannot carry out.

A whole-silo erasure retires the silo; a sample-level one lets it train without the erased
samples (bounded: bounds.py). One silo, one job: an erasure starts only on an idle silo (the
loop refuses a second job); while a request waits for its silo, it is sent no training.

One file (over 500 lines) because it is one thing: the coordinator's methods are the
lifecycle's transitions and the moments between them (start, the removal at it, the silo's
reply, the boundary, the check after the window, a silo lost, a restart), and each reads and
writes the same requests in progress, the store and the event log in the order above.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import server.unlearning.resume as resume
from fedasync import Params, Rejection, RejectReason
from fedasync.unlearning import ContributionLedger, ForgetGradient, GradientSignature
from protocol.ids import fraction_ids
from server.erasure.certificate_checks import server_checks
from server.erasure.readings import VERIFIED, summary, verdict
from server.erasure.states import ENDED_UNCHECKED, REMOVAL_NOTE, SILO_PART_NOTE, State
from server.intake import JobKind
from server.removal import Remainder, bounded, removal
from server.unlearn_messages import SiloLost
from server.unlearning.attest import boundary_facts, erasing_facts, model_sha256, verified_facts
from server.unlearning.bounds import bound_delta, size
from server.unlearning.calibration import Calibration, carries_nothing
from server.unlearning.rebuild import FedEraserRebuild
from server.unlearning.requests import (
    WENT_DOWN,
    WENT_OFFLINE,
    Erasure,
    ErasureRun,
    ServedModel,
    SiloJobs,
    add_floats,
)
from server.unlearning.sinks import UpdateSinks

if TYPE_CHECKING:
    from server.erasure.store import ErasureStore
    from server.intake import Job

log = logging.getLogger("fedasync.server")

MAX_ATTEMPTS = 3
"""Times an erasure may be lost by its silo going down mid-erasure (a crash, an error reply, no
reply within ``server.reply_timeout_s``) before it is failed; being reported offline does not
count. A constant, not a setting: a retry budget against a silo that keeps failing, which no
run has tuned."""


class ErasureCoordinator:
    """Drives erasure requests through their states from inside the server loop."""

    enabled = True
    """Live erasure requests may come (the loop looks for them at least every second)."""

    def __init__(
        self,
        model: ServedModel,
        silos: SiloJobs,
        run: ErasureRun,
        store: ErasureStore,
        verify_fn: Any,
    ):
        """``model``: the model the erasures change; ``silos``: the silos' jobs; ``run``: the
        run's values and what the coordinator reads of the server's parts (the norm bound an
        erasure delta gets like any update, the calibration of what the correction pipeline
        carries past a boundary); ``verify_fn``: (params, silo, sample_ids) -> the
        verification metrics."""
        self.model = model
        self.silos = silos
        self.run = run
        self.store = store
        self.cfg = run.cfg.unlearning
        self.lab = run.cfg.lab.erasure  # (the erasure's ablations: lab.erasure.*)
        self.verify_fn = verify_fn
        self.norm_threshold = run.norm_threshold
        self.ledger = ContributionLedger()
        self.calibration = Calibration(
            self.cfg,
            lab=self.lab,
            refuses=self._refuses,
            at_boundary=run.at_boundary or carries_nothing,
            silos=run.cfg.silos.count,
        )
        self.rebuild: FedEraserRebuild | None = None  # the halting baseline's (federaser)
        if run.rebuilds:
            self.rebuild = FedEraserRebuild(  # its rebuilt model is applied as any erasure's
                run.cfg,
                silos,
                run.roster,
                model.params,
                is_retired=lambda s: s in self.retired,
                done=lambda e, model, metrics: self._apply(e, model, None, metrics),
            )
        self.retired: set[int] = set()
        self.excluded: dict[int, list[str]] = {}
        self.active: dict[str, Erasure] = {}
        self.applied: set[str] = set()
        self.schedule = sorted(
            ((e.at_s, e.silo, e.fraction) for e in self.run.cfg.erasures), key=lambda x: x[0]
        )
        self.report: list[dict[str, Any]] = []
        self.seen: dict[str, float] = {}  # request id -> clock time it was first seen queued
        self.halting = False
        self.max_attempts = MAX_ATTEMPTS
        self.not_before: dict[str, float] = {}  # requeued id -> clock time it may start again
        self.waiting: set[int] = set()  # silos with a queued request: sent no new training
        self.remainders: dict[str, Remainder] = {}  # request id -> its removal's withheld rest
        self._removing = False  # a removal or a step of one is making its version (on_version)

    # -------------------------------------------------------------- scheduling
    def next_time(self) -> float:
        """The next clock time at which ``poll`` has something to do by itself: a scheduled
        erasure to submit, or a requeued one whose pause is over."""
        now = self.run.clock.now
        times = [t for t in self.not_before.values() if t > now]
        if self.schedule:
            times.append(self.schedule[0][0])
        return min(times, default=float("inf"))

    def erasing(self, silo: int) -> bool:
        """Whether ``silo`` is carrying out an erasure not yet applied."""
        return any(e.silo == silo and e.boundary is None for e in self.active.values())

    def may_train(self, silo: int) -> bool:
        """Whether ``silo`` may be sent training (not retired, erasing, or halted)."""
        if self.run.halts and (
            self.halting or any(e.boundary is None for e in self.active.values())
        ):
            return False  # the synchronous baseline: everyone waits for the erasure
        return silo not in self.retired and silo not in self.waiting and not self.erasing(silo)

    def halted_silos(self) -> list[int]:
        """Silos with no work in flight, not down, that may train again (after a halt)."""
        return [
            s
            for s in sorted(self.run.roster)
            if self.silos.holding(s) is None and self.may_train(s)
        ]

    def poll(self) -> None:
        """Submit due scheduled erasures; start queued requests whose silo is online."""
        now = self.run.clock.now
        while self.schedule and self.schedule[0][0] <= now:
            _, silo, fraction = self.schedule.pop(0)
            ids = self._fraction_ids(silo, fraction)
            req, _ = self.store.submit(silo, ids or None, "schedule", self.model.version)
            log.info("scheduled erasure %s of silo %d submitted at t=%.1f", req.id, silo, now)
        queued = [r for r in self.store.unfinished() if r.state is State.QUEUED]
        for req in queued:
            self.seen.setdefault(req.id, now)
        before, self.waiting = self.waiting, {r.silo for r in queued}
        self._start_queued(queued, now)
        for silo in sorted(before - self.waiting):  # their request left the queue otherwise
            if self.silos.holding(silo) is None and self.may_train(silo):  # (failed): they train
                self.silos.release(silo)

    def _startable(self, req: Any, now: float) -> bool:
        """Whether ``req`` may start now but for its silo's job in flight."""
        if req.id in self.active or req.silo in self.retired or req.silo not in self.run.roster:
            return False
        if self.silos.is_down(req.silo) or self.erasing(req.silo):
            return False  # offline: it waits, queued, until the silo returns
        return self.not_before.get(req.id, now) <= now

    def _start_queued(self, queued: list[Any], now: float) -> None:
        # a request cancels its silo's training job in flight (server/cancel.py): it starts
        # now instead of after a job that may be a straggler's (lab.erasure.cancel_inflight).
        # On the wall clock only with the erasure service: Flower's SuperNode takes one message
        # at a time, so a deployed node pulls the erasure only after the job it runs; its node
        # stops that job when it sees the request enter erasing there (clients/preempt.py).
        # Without the service a cancel would gain nothing and start the erasure message's
        # reply timeout behind the job
        if self.lab.cancel_inflight and (not self.run.clock.realtime or self.cfg.service):
            for req in queued:
                if self._startable(req, now) and self.silos.holding(req.silo) is not None:
                    self.silos.cancel_for_erasure(req.silo, req.id)
        # the synchronous baseline halts: no new work while a request waits, and the erasure
        # starts only once the (other silos') work in flight has drained
        self.halting = self.run.halts and bool(queued)
        if self.halting and any(j.kind is JobKind.TRAIN for j in self.silos.inflight.values()):
            return
        for req in queued:
            if not self._startable(req, now):
                continue  # (a requeued one waits out its pause after its silo went down)
            if self.silos.holding(req.silo) is not None:
                continue  # one job per silo: it starts when the silo's job in flight is back
            self.not_before.pop(req.id, None)
            if not any(r.silo == req.silo and r.id != req.id for r in queued):
                self.waiting.discard(req.silo)  # (a silo erasing is sent no training anyway)
            self._start(req)

    def _fraction_ids(self, silo: int, fraction: float) -> list[str]:
        if fraction >= 1.0:
            return []
        return fraction_ids(self.run.sample_ids(silo), self.run.cfg.run.seed, silo, fraction)

    def _start(self, req: Any, resumed: bool = False) -> None:
        submitted_t, wall_ms = self._submitted(req)
        e = Erasure(req.id, req.silo, list(req.sample_ids), submitted_t, submitted_wall_ms=wall_ms)
        e.started_t = self.run.clock.now
        self.active[req.id] = e
        note = self._size(e)
        e.removal = removal(
            self.cfg,
            self.lab,
            self.ledger,
            self.calibration.sketch,
            e.silo,
            e.request_id,
            e.start_report,
            sample_level=bool(e.sample_ids),
        )
        if resumed:
            self.store.note(
                req.id,
                actor="server",
                model_version=self.model.version,
                detail=f"resumed after restart: sent train.unlearn to silo {req.silo} again{note}",
            )
        else:
            self.store.transition(
                req.id,
                State.ERASING,
                actor="server",
                model_version=self.model.version,
                detail=f"sent train.unlearn to silo {req.silo}{note}",
                facts=erasing_facts(self.cfg, self.rebuild is not None),
            )
        if self.rebuild is not None:  # FedEraser (the halting baseline): whole silos only
            if e.sample_ids:
                self.failed(e, "FedEraser (the halting baseline) erases whole silos only")
                return
            self.event(e, "erasing", method="federaser")
            self.rebuild.start(e)
            return
        self._remove_now(e)
        if self.silos.dispatch_unlearn(req.silo, self.model.params, e):
            self.event(e, "erasing", **e.start_report)
        else:  # refused: the silo holds a job (erasures start on idle silos: a bug's trace)
            self.requeue(e, SiloLost("its silo was busy", offline=True))

    def _remove_now(self, e: Erasure) -> None:
        """The server's removal in force at once: it needs nothing from the silo, so it does
        not wait for the silo's reply (a straggler would delay its own erasure by its job).
        The model moves by it (a version); later changes may not move back along it and what
        the server carries is calibrated (`Calibration.removed`); the silo's recorded
        contributions are forgotten, so that a restart after the checkpoint below does not
        subtract them again (before it, the restored model and ledger predate the removal,
        and it is applied once more). The silo's own part (its test, its ascent) follows
        with its reply, from this model."""
        if e.removal is None:
            return
        old = self.model.params
        new, measured = bounded(old, e.removal, self.run.score, self.lab.server_removal_max_drop)
        before = measured["removal_score_before"]
        rest = Remainder.of(e.removal, measured["removal_applied"], before)
        if rest is not None:  # withheld by the bound: applied in steps later (_remove_more)
            self.remainders[e.request_id] = rest
        e.removal = None  # in force: the silo's reply adds only its own part
        e.pre_erasure = old
        self.calibration.removed(e, old, new)
        self.ledger.forget(str(e.silo))
        self._removing = True
        try:
            self.model.apply_erasure(new)
        finally:
            self._removing = False
        e.removed_version, e.removed_t = self.model.version, self.run.clock.now
        self.calibration.boundary = self.model.version
        after = measured["removal_score_after"]
        e.start_report.update(measured)
        self.model.checkpoint()
        kept = e.start_report.get("removal_kept")
        share = "" if kept is None else f" ({100 * float(kept):.1f}% of its recorded contributions)"
        self.store.note(
            e.request_id,
            actor="server",
            model_version=self.model.version,
            detail=f"{REMOVAL_NOTE} of silo {e.silo}'s work{share}"
            f"{_applied(measured, self.lab.server_removal_max_drop, self.model.version)}",
        )
        applied = measured["removal_applied"]
        self.event(e, "removed", score_before=before, score_after=after, applied=applied)

    def _submitted(self, req: Any) -> tuple[float, int | None]:
        """``(submitted_t, submitted_wall_ms)`` of ``req`` (`resume.submitted`)."""
        return resume.submitted(req, self.run.clock, self.store.opened_ms, self.seen)

    def _size(self, e: Erasure) -> str:
        """Scope and size of ``e`` before it is sent (`bounds.size`); a note for the audit."""
        held, n = set(self.run.sample_ids(e.silo)), int(self.run.num_samples.get(e.silo, 0))
        return size(e, self.cfg, self.lab, held, n, set(self.excluded.get(e.silo, [])))

    def take_calibration(self, job: Job, update: Any) -> None:
        """One silo's FedEraser calibration update (None: it failed, the round goes on)."""
        if self.rebuild is not None:
            self.rebuild.take(job, update)

    # -------------------------------------------------------------- replies
    def _refuses(self, job: Job) -> Rejection | None:
        """Why a train update is refused before it is calibrated: its silo's data is under
        erasure, or it trained on samples erased since (None: it is not)."""
        if job.silo in self.retired or self.erasing(job.silo):
            return Rejection(RejectReason.ERASED, f"silo {job.silo}'s data is under erasure")
        if job.silo in self.excluded and job.base_version < self.calibration.boundary:
            return Rejection(RejectReason.ERASED, "trained on samples erased since")
        return None

    def record(
        self,
        silo: int | None,
        contributions: dict[str, Params],
        version: int,
        norm: float | None = None,
    ) -> None:
        """What a fold applied: each silo's exact share (the ledger; empty unless
        ``lab.erasure.server_removal`` asks for it), and the raw norm of the update of ``silo``
        that was folded (FedEraser's history; None at a round's flush)."""
        for s, part in contributions.items():
            self.ledger.record(s, part, version)
        if silo is not None and norm is not None and self.rebuild is not None:
            self.rebuild.record(version, silo, norm)

    def fold_sink(self, silo: int, version: int) -> UpdateSinks:
        """What is kept of an accepted update of ``silo`` folded at ``version``: the update
        into the span sketch, the change into the silo's ledger sum (when the fold attributes
        it), in the fold's own pass where it can (server/unlearning/sinks.py)."""
        return UpdateSinks(self.calibration.sketch, self.ledger, silo, version)

    def take_unlearn(self, erasure: Erasure, decoded: tuple) -> None:
        """Apply a silo's erasure: removal + its delta onto the current model; boundary."""
        if self.active.get(erasure.request_id) is not erasure:
            log.warning("ignored a reply to erasure %s: not in progress", erasure.request_id)
            return  # requeued or finished meanwhile: only the attempt in progress is applied
        delta, basis, names, metrics, gradient = decoded
        delta, bounds = self.bound_delta(erasure, delta)
        if self.lab.silo_part_bounded:
            new, held = self._bounded_silo_part(erasure, delta)
            bounds = {**(bounds or {}), **held}
        else:  # (the server's removal is in force already)
            new = add_floats(self.model.params, delta)
        sig = GradientSignature.from_basis(basis, names)
        grad = None if gradient is None else ForgetGradient.unit(gradient, names)
        self._apply(erasure, new, sig, metrics, bounds, grad)

    def _bounded_silo_part(self, e: Erasure, delta: Params) -> tuple[Params, dict[str, float]]:
        """``lab.erasure.silo_part_bounded``: the silo's own part (its ascent) held to the bound
        the server's removal is held to: the model with the largest share of ``delta`` whose
        held-out score is at most ``lab.erasure.server_removal_max_drop`` below its score before
        the request, and the rest withheld, to follow in steps as the removal's does
        (`_remove_more`). Returns the model and the share applied (``silo_part_applied``)."""
        reference = e.start_report.get("removal_score_before")
        if reference is None:
            reference = self.run.score(self.model.params)
        new, measured = bounded(
            self.model.params, delta, self.run.score, self.lab.server_removal_max_drop, reference
        )
        rest = Remainder.of(delta, measured["removal_applied"], reference)
        if rest is not None:
            self.remainders[silo_part(e.request_id)] = rest
            self.store.note(
                e.request_id,
                actor="server",
                model_version=self.model.version,
                detail=f"{SILO_PART_NOTE} of silo {e.silo}'s work: "
                f"{measured['removal_applied']:g} of it at the boundary (the whole lowered the "
                f"held-out score by more than {self.lab.server_removal_max_drop:g} below its "
                f"level before the request); the rest follows in steps as the removal's does",
            )
        return new, {"silo_part_applied": measured["removal_applied"]}

    def bound_delta(self, erasure: Erasure, delta: Params) -> tuple[Params, dict[str, float]]:
        """``delta`` clipped to the erasure bound, and what was done (`bounds.bound_delta`):
        by the accepted-update norm threshold now, ``server.clip_norm`` and PGA's radius."""
        return bound_delta(
            erasure,
            delta,
            self.cfg,
            self.lab,
            threshold=self.norm_threshold(),
            clip_norm=self.run.cfg.server.clip_norm,
        )

    def _apply(
        self,
        erasure: Erasure,
        new: Params,
        sig: GradientSignature | None,
        metrics: dict[str, float],
        bounds: dict[str, float] | None = None,
        gradient: ForgetGradient | None = None,
    ) -> None:
        """Put the erased model in force: the erasure boundary, verification, durability."""
        # what the calibrating event says of what is protected
        kept = self.calibration.protect(erasure, self.model.params, new, sig, gradient)
        if erasure.sample_ids:
            self.excluded.setdefault(erasure.silo, []).extend(erasure.sample_ids)
        else:
            self.retired.add(erasure.silo)
            self.ledger.forget(str(erasure.silo))
        # the global score just before the erasure: before the server's removal, if it had one
        before = erasure.start_report.get("removal_score_before")
        if before is None:
            before = self.run.score(self.model.params)
        model_before = (self.model.version, model_sha256(self.model.params))
        pre = self.model.params if erasure.pre_erasure is None else erasure.pre_erasure
        erasure.around_boundary, erasure.pre_erasure = (pre, new), None
        self.model.apply_erasure(new)
        erasure.boundary = self.calibration.boundary = self.model.version
        erasure.applied_t = self.run.clock.now
        after = self.run.score(self.model.params)  # just after it
        erasure.metrics_at_boundary = {
            **self.verify_fn(self.model.params, erasure.silo, erasure.sample_ids),
            **{f"silo_{k}": v for k, v in metrics.items()},  # what the silo reported
            **(bounds or {}),  # the server's bound on the silo's delta (bound_delta)
            **kept,  # signature_unique's share removed; whether a forget gradient came
            "score_before": before,
            "score_after": after,
            "boundary_dip": before - after,
        }
        self.applied.add(erasure.request_id)
        self.model.checkpoint()  # the model with the erasure is durable before the store says so
        self.store.transition(
            erasure.request_id,
            State.CALIBRATING,
            actor="server",
            model_version=self.model.version,
            boundary_version=self.model.version,
            metrics=erasure.metrics_at_boundary,
            detail=f"erasure applied at version {self.model.version}; calibrating",
            facts=boundary_facts(self.cfg, self.lab, model_before, self.model.params),
        )
        self.event(erasure, "calibrating", **erasure.metrics_at_boundary)
        self._resume_halted()

    def _resume_halted(self) -> None:
        """A halted federation resumes (in rounds: the next one starts) once its erasure is
        applied or has failed; the next poll halts it again if more requests wait."""
        self.halting = False
        if self.run.halts:
            for silo in self.halted_silos():
                self.silos.release(silo)

    def failed(self, erasure: Erasure, why: str) -> None:
        """The erasure cannot be carried out: ``failed`` with ``why`` (a silo that went down
        is ``requeue``'s, not this)."""
        if self.active.get(erasure.request_id) is not erasure:
            return  # an attempt already given up (requeued): its request has moved on
        self.active.pop(erasure.request_id, None)
        self._end_remainder(erasure, "failed")
        self.store.transition(
            erasure.request_id,
            State.FAILED,
            actor="server",
            model_version=self.model.version,
            detail=why,
        )
        self.event(erasure, "failed", detail=why)
        self._resume_halted()

    def requeue(self, erasure: Erasure, why: SiloLost) -> None:
        """Its silo went down mid-erasure: back to ``queued`` (the audit row says why), to be
        started again by ``poll`` when the silo is back; ``failed`` after
        ``MAX_ATTEMPTS`` losses that were not the silo being offline."""
        rid = erasure.request_id
        if self.active.get(rid) is not erasure or erasure.boundary is not None:
            return  # not in progress, or already applied (then it is not lost)
        if why.offline:
            detail = (
                f"{WENT_OFFLINE}: {why}; will retry when it returns "
                "(not counted against max_attempts)"
            )
            self.not_before[rid] = self.run.clock.now + self.run.cfg.lab.offline_retry_s
        else:
            n = 1 + sum(1 for a in self.store.requeues(rid) if a.detail.startswith(WENT_DOWN))
            if n >= self.max_attempts:
                self.failed(
                    erasure,
                    f"{WENT_DOWN} {n} times (max_attempts={self.max_attempts}); last: {why}",
                )
                return
            detail = (
                f"{WENT_DOWN} (attempt {n} of {self.max_attempts}): {why}; "
                "will retry when it returns"
            )
        del self.active[rid]
        self.waiting.add(erasure.silo)  # no training for it before the erasure starts again
        log.warning("erasure %s of silo %d back to queued: %s", rid, erasure.silo, detail)
        self.store.transition(
            rid, State.QUEUED, actor="server", model_version=self.model.version, detail=detail
        )
        self.event(erasure, "queued", detail=detail)

    def event(self, e: Erasure, state: str, **extra: Any) -> None:
        """The ``erasure`` event of ``e`` entering ``state`` (metrics.jsonl)."""
        self.run.events.write(
            "erasure",
            t=self.run.clock.now,
            version=self.model.version,
            request=e.request_id,
            silo=e.silo,
            state=state,
            **extra,
        )

    def row(self, e: Erasure) -> dict[str, Any]:
        """What the summary reports of an applied erasure (`resume.row`)."""
        return resume.row(e, self.store, self.run.clock.kind, self.run.accepted_between)

    def on_version(self, score: float | None = None) -> None:
        """Check again the erasures whose relearning window has passed: each moves to
        ``verified`` or ``unverified`` (``_checked``) and gets its report row, whose
        ``verified_version`` is the version at which it was checked (either way). Then, when
        this version was evaluated (``score``, its held-out score), apply a step of each
        removal's withheld rest (``_remove_more``). The version a removal or a step makes is left
        alone (a window that ends there is checked at the next version, after its audit note)."""
        if self._removing:
            return
        self._check_windows()
        if score is not None and self.remainders:
            self._remove_more(score)

    def _check_windows(self) -> None:
        for rid, e in list(self.active.items()):
            if e.boundary is None:
                continue
            since = self.model.version - e.boundary
            if since < self.lab.relearn_versions:
                every = self.lab.watch_every
                if every and since > 0 and since % every == 0:
                    self._watch(e, since)
                continue
            after = e.measure(self.model.params, self.verify_fn)
            after["score"] = self.run.score(self.model.params)  # (has it come back?)
            e.around_boundary = None
            self._end_remainder(e, "checked")
            state, reading = _checked(e, after)
            # verified_version: the version at which it was checked, verified or not
            row = {**self.row(e), "after_relearn": after, "verified_version": self.model.version}
            self.report.append({**row, "state": state.value, "reading": reading})
            del self.active[rid]
            self.store.transition(
                rid,
                state,
                actor="server",
                model_version=self.model.version,
                metrics=after,
                detail=f"{state.value} after {self.lab.relearn_versions} versions: {reading}",
                facts=verified_facts(self.model.params),
            )
            self.event(e, state.value, **after)

    def _remove_more(self, score: float) -> None:
        """A step of each withheld rest of a removal whose request is in progress, once the
        held-out score is back to its level before the request: the largest share the bound
        allows then (`Remainder.step`), as a version of its own. The
        step moves the model along the removal's direction, which the part in force already
        protects (``Calibration.removed``); a removal withheld whole at the request gets that
        protection with its first step. A request waiting to start again (its silo went down)
        keeps its rest for when it does."""
        max_drop = self.lab.server_removal_max_drop
        before: float | None = score  # (the evaluation of this version; measured after a step)

        for key, rest in list(self.remainders.items()):
            rid, part = request_of(key)
            e = self.active.get(rid)
            if e is None:
                continue
            old, whole_withheld = self.model.params, rest.left >= 1.0
            new, measured = rest.step(old, self.run.score, max_drop, before)
            if not measured["removal_step"]:
                continue  # the bound allows none of it yet: tried at the next evaluation
            if rest.left <= 0.0:
                del self.remainders[key]
            if whole_withheld:
                self.calibration.removed(e, old, new)
            self._removing = True
            try:
                self.model.apply_erasure(new)
            finally:
                self._removing = False
            before = None
            self.model.checkpoint()  # the model with the step is durable before the audit says so
            self.store.note(
                rid,
                actor="server",
                model_version=self.model.version,
                detail=f"{REMOVAL_NOTE if not part else SILO_PART_NOTE} of silo {e.silo}'s "
                f"work: {_more(measured, max_drop, self.model.version)}",
            )
            self.event(
                e,
                "removed_more",
                score_before=measured["removal_score_before"],
                score_after=measured["removal_score_after"],
                applied=measured["removal_step"],
                applied_total=1.0 - rest.left,
                **({"part": part} if part else {}),
            )

    def _end_remainder(self, e: Erasure, why: str) -> None:
        """``e`` is ``why`` (checked, failed): what is still withheld of its removal is never
        applied, and its audit says so."""
        for key, what in ((e.request_id, REMOVAL_NOTE), (silo_part(e.request_id), SILO_PART_NOTE)):
            rest = self.remainders.pop(key, None)
            if rest is not None:
                self._note_unapplied(e, what, rest, why)

    def _note_unapplied(self, e: Erasure, what: str, rest: Remainder, why: str) -> None:
        self.store.note(
            e.request_id,
            actor="server",
            model_version=self.model.version,
            detail=f"{what} of silo {e.silo}'s work: {1.0 - rest.left:g} of it in "
            f"force when the request was {why}; the rest ({rest.left:g}) was never applied "
            f"(the held-out score was not back to its level before the request, or a step "
            f"would have lowered it by more than {self.lab.server_removal_max_drop:g})",
        )

    def unchecked_at_end(self, e: Erasure) -> str:
        """The run ends with ``e`` applied but its relearning window not over: it cannot be
        checked within this run. Says so in its audit log (a note; the request stays
        ``calibrating``, and a resumed run goes on with it) and returns the same words."""
        since, window = self.model.version - (e.boundary or 0), self.lab.relearn_versions
        why = (
            f"{ENDED_UNCHECKED}: the run ended at version {self.model.version}, {since} of the "
            f"{window} versions of its relearning window after the boundary; it stays "
            "calibrating (a resumed run, run.resume=true, goes on with it)"
        )
        self.store.note(e.request_id, actor="server", model_version=self.model.version, detail=why)
        log.warning("erasure %s: %s", e.request_id, why)
        return why

    def _watch(self, e: Erasure, since: int) -> None:
        """An ``erasure_watch`` event: the erased model's verification metrics ``since``
        versions after the boundary, and its reversion ratio (``lab.erasure.watch_every``)."""
        metrics = e.measure(self.model.params, self.verify_fn)
        self.run.events.write(
            "erasure_watch",
            t=self.run.clock.now,
            version=self.model.version,
            request=e.request_id,
            silo=e.silo,
            since_boundary=since,
            **metrics,
        )

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The erasures in progress, applied and scheduled, the ledger, the verification
        reports; beside them the keys of the calibration's and the rebuild's ``state_dict``."""
        return {
            "ledger": self.ledger.state_dict(),
            "retired": sorted(self.retired),
            "excluded": {str(k): list(v) for k, v in self.excluded.items()},
            "applied": sorted(self.applied),
            "schedule": [list(x) for x in self.schedule],
            "report": list(self.report),
            "calibrating": {
                rid: e.state_dict() for rid, e in self.active.items() if e.boundary is not None
            },
            "remainders": {rid: r.state_dict() for rid, r in self.remainders.items()},
            # the parts' keys beside these (disjoint): the checkpoint's layout as it always was
            **self.calibration.state_dict(),
            **({"history": None} if self.rebuild is None else self.rebuild.state_dict()),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (the parts pick their own keys)."""
        self.calibration.load_state_dict(d)
        if self.rebuild is not None and d.get("history"):  # (absent: FedEraser was off)
            self.rebuild.load_state_dict(d)
        self.ledger.load_state_dict(d["ledger"])
        self.retired = set(d["retired"])
        self.excluded = {int(k): list(v) for k, v in d["excluded"].items()}
        self.applied = set(d["applied"])
        self.schedule = [tuple(x) for x in d["schedule"]]  # type: ignore[misc]
        self.report = list(d["report"])
        for rid, c in d["calibrating"].items():
            self.active[rid] = Erasure.from_state(rid, c)
        self.remainders = {  # (absent in older checkpoints)
            rid: Remainder.from_state(r) for rid, r in d.get("remainders", {}).items()
        }

    def reconcile(self) -> None:
        """After a restart: match the store's unfinished requests with the restored model
        (`resume.reconcile`; an erasing request not applied is started again)."""
        resume.reconcile(
            self.store,
            self.active,
            self.applied,
            self.model.version,
            self.run.roster,
            lambda req: self._start(req, True),
        )


def _checked(e: Erasure, after: dict[str, float]) -> tuple[State, str]:
    """``verified`` when every figure of the checks the server has now (its boundary metrics,
    the silo's membership test, the delta bound, ``after`` the window) is within; else
    ``unverified``; and the verdict in one line (the certificate's, readings.verdict)."""
    checks = server_checks(e.metrics_at_boundary, after, whole_silo=not e.sample_ids)
    v = verdict(checks)
    return (State.VERIFIED if v["verdict"] == VERIFIED else State.UNVERIFIED), summary(v)


def silo_part(request_id: str) -> str:
    """The key of a request's withheld silo part among the remainders (its removal's: the id)."""
    return f"{request_id}:silo"


def request_of(key: str) -> tuple[str, str]:
    """(request id, part) of a remainder's key: part "" for the server's removal, "silo"."""
    rid, _, part = key.partition(":")
    return rid, part


def _applied(measured: dict[str, float], max_drop: float, version: int) -> str:
    """The rest of the removal's audit note: in force at ``version``, whole or the share the
    held-out score bounded (`server.removal.bounded`), or withheld."""
    share = measured["removal_applied"]
    later = (
        "; the rest is applied in steps, each once the held-out score is back to its level "
        "before the request and bounded the same way, until the request is checked"
    )
    if share == 0.0:
        return (
            f" withheld for now: even 1/16 of it lowered the held-out score by more than "
            f"{max_drop:g}{later}; the silo's own part follows with its reply"
        )
    if share == 1.0:
        return f" in force at version {version}; the silo's own part follows with its reply"
    return (
        f", {share:g} of it (the whole lowered the held-out score by more than {max_drop:g}), "
        f"in force at version {version}{later}; the silo's own part follows with its reply"
    )


def _more(measured: dict[str, float], max_drop: float, version: int) -> str:
    """The audit note of a step of a removal's withheld rest (`ErasureCoordinator._remove_more`)."""
    step, left = measured["removal_step"], measured["removal_left"]
    rest = (
        "all of it is in force now"
        if left <= 0.0
        else f"{1.0 - left:g} of it in force now; {left:g} still withheld"
    )
    return (
        f"a further {step:g} of it in force at version {version} (the held-out score, back to "
        f"its level before the request, {measured['removal_score_before']:.4f} -> "
        f"{measured['removal_score_after']:.4f}, bound {max_drop:g}); {rest}"
    )
