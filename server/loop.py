"""The asynchronous server loop on Flower's Grid (push_messages / pull_messages).

FedAsync (Xie et al. 2019) and FedBuff (Nguyen et al. 2022) as one event loop: every silo is
kept busy; each reply is validated, corrected and folded in as soon as it is taken, the
version bumps, and that silo is sent the newest model at once. ``sync`` mode is the
synchronous FedAvg baseline on the same silos and clock: a barrier waits for every silo's
reply before the round is averaged, so one straggler stalls everyone.

Which reply is taken next is the clock's decision (fedasync/clock.py): virtual-finish order in
simulation (deterministic for a seed), arrival order on the wall clock in deployment. A silo
whose job failed (client error, crash) is sent work again after ``down_s`` of an injected
crash or at once; a message unanswered for ``server.reply_timeout_s`` wall seconds is
abandoned and its silo re-sent work, so a silent silo holds nothing up; every message
carries that limit as its Flower TTL, so a SuperLink drops what nobody fetched in time and a
SuperNode never starts expired work. A silo the SuperLink reports offline is sent work again
after ``server.offline_retry_s``. On the wall clock the loop polls for replies every
``server.poll_interval_s`` (each poll is a request to the SuperLink), and ``run.budget_s``
counts from the first dispatch, not from the roster query.

One silo, at most one job (train, unlearn or calibration) in flight, always: every message
leaves through the dispatcher's ``send``, which refuses (logs, counts in ``dispatches_refused``
and writes a ``dispatch_refused`` event) work for a silo that already holds a job or waits out a failure,
instead of sending it. Erasure work is started only on an idle silo (server/unlearning/).

The server is made of parts it owns, each with its own ``state_dict``: the dispatcher and the
fault schedule (server/dispatch.py), the intake (server/intake.py), the correction pipeline
(server/pipeline.py), privacy (server/privacy.py), the run statistics (server/stats.py) and
the erasure coordinator (server/unlearning/; ``NoErasure`` in a run that cannot erase, so
the loop never asks whether there is one). A training reply reads top-down from
``pull_messages`` (``_poll``) through ``run`` → ``_take`` (intake's ``read_reply`` and
``check_reply``) → ``_fold`` (the pipeline's ``fold``) → ``_publish`` → ``_new_version``.
One module (about 700 lines) because that event loop is one state machine: dispatching, taking
replies, publishing versions and checkpointing all read and advance the same clock, version
and jobs in flight; what is not the loop's own is in the parts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from fedasync import Params, Rejection, RejectReason
from fedasync.clock import Clock, InFlight, Next, VirtualClock, WallClock
from fedasync.events import EventLog
from fedasync.flat import flatten
from fedasync.flat import same as flat_same
from fedasync.tensors import is_finite
from protocol.config import to_dict
from protocol.erasure_messages import reported_work
from protocol.messages import TrainRefusal
from protocol.reading import ErrorReply
from server.cancel import JobCanceller
from server.checkpoint import write_checkpoint
from server.clock import client_setup, silo_speeds
from server.config import FedAsyncConfig
from server.dispatch import Dispatcher, FaultSchedule
from server.intake import Accepted, Intake, Job, JobKind, read_reply
from server.pipeline import CorrectionPipeline
from server.privacy import ServerPrivacy, Stop
from server.requests import JobRequests
from server.roster import discover_silos
from server.stats import RunStats
from server.unlearn_messages import SiloLost, read_unlearn_reply
from server.unlearning import ErasureCoordinator, NoErasure, UpdateCalibration

log = logging.getLogger("fedasync.server")


class AsyncServer:
    """Runs one federated training job on ``grid`` and returns its result record.

    Made of parts it owns, each with a ``state_dict`` that ``state_dict`` combines: the
    dispatcher (jobs in flight, retries) and the fault schedule (server/dispatch.py), the
    intake (server/intake.py), the correction pipeline (server/pipeline.py), privacy
    (server/privacy.py), the run statistics (server/stats.py) and the erasure part: the
    erasure coordinator when erasures are possible (server/unlearning/, set by the caller),
    else ``NoErasure``; its ``calibration`` calibrates every accepted update (a no-op then).
    """

    def __init__(
        self,
        cfg: FedAsyncConfig,
        grid: Grid,
        run_dir: Path,
        initial_params: Params,
        evaluate_fn: Any,
        wall_clock: bool = False,
        *,
        sample_ids_fn: Any = None,
        id_salt: str = "",
        erasure: Callable[[AsyncServer], ErasureCoordinator] | None = None,
        progress: Callable[[float], Any] | None = None,
    ):
        self.cfg = cfg
        self.grid = grid
        self.run_dir = run_dir
        # one flat buffer per dtype (fedasync/flat.py): every fold and correction is fused
        self.params: Params = flatten(initial_params, device="cpu")
        self.evaluate_fn = evaluate_fn
        self.version = 0
        self.barrier = cfg.server.mode == "sync"
        self.speeds = silo_speeds(cfg.silos, cfg.run.seed)
        self.clock: Clock = (
            WallClock()
            if wall_clock
            else VirtualClock(
                self.speeds,
                cfg.silos.step_time_s,
                jitter=cfg.silos.jitter,
                latency_s=cfg.silos.latency_s,
                seed=cfg.run.seed,
            )
        )
        self.events = EventLog(run_dir / "metrics.jsonl")
        self.jobs = Dispatcher(grid, self.clock, self.events, cfg.server.corrections.max_snapshots)
        self.faults = FaultSchedule([to_dict(f) for f in cfg.faults])
        self.intake = Intake(cfg.server)
        self.pipeline = CorrectionPipeline(cfg)
        self.dc_lambda = cfg.server.corrections.delay_compensation
        self.privacy = ServerPrivacy.for_run(cfg.server.dp, run_dir)
        self.stats = RunStats()
        self.setup_json = client_setup(cfg).to_json()
        self.roster: dict[int, int] = {}
        self.num_samples: dict[int, int] = {}
        self.arrived: dict[str, Message] = {}
        self.cancels = JobCanceller(
            self.jobs,
            self.events,
            self.arrived,
            now=lambda: self.clock.now,
            version=lambda: self.version,
            on_discard=self._discarded,
        )
        self.ckpt_path = run_dir / "checkpoint.pt"
        self.progress: Any = None  # fedasync.progress's bar or lines, made when run() starts
        self._make_progress = progress
        self.requests = JobRequests(self, sample_ids_fn)  # silo -> its sample ids, or None
        self.id_salt = id_salt  # the silos report their ids' digests under it (deployment)
        self.silo_reports: dict[int, Any] = {}  # silo -> its roster reply (protocol QueryReply)
        self.started_at: float | None = None  # clock time of the first dispatch (budget origin)
        # the erasure part: a coordinator made for this server, or NoErasure (cannot erase)
        self.erasure: ErasureCoordinator | NoErasure = (
            NoErasure() if erasure is None else erasure(self)
        )
        # how a reply is taken, and what an abandoned job leaves to do, by the job's kind
        self._takers: dict[JobKind, Callable[[Job, Message], bool]] = {
            JobKind.TRAIN: self._take_train,
            JobKind.CALIBRATE: self._take_calibration,
            JobKind.UNLEARN: self._take_unlearn,
        }
        self._abandoned: dict[JobKind, Callable[[Job, str], None]] = {
            JobKind.TRAIN: lambda job, detail: None,
            JobKind.CALIBRATE: lambda job, _: self.erasure.take_calibration(job, None),
            JobKind.UNLEARN: lambda job, detail: self.erasure.requeue(
                job.erasure, SiloLost(detail)
            ),
        }

    @property
    def calibration(self) -> UpdateCalibration:
        """The erasure part's calibration of accepted updates (a no-op without erasures)."""
        return self.erasure.calibration

    @property
    def inflight(self) -> InFlight[Job]:
        """The jobs in flight, by message id (the dispatcher's)."""
        return self.jobs.inflight

    # ---------------------------------------------------------------- set-up
    def connect(self) -> None:
        """Wait for the silos' nodes and learn which node is which silo, and what each reports
        of its data (sample and class counts; with ``id_salt``, its ids' digests)."""
        self.roster, self.num_samples = discover_silos(
            self.grid,
            self.setup_json,
            self.cfg.silos.count,
            self.cfg.server.wait_for_nodes_s,
            salt=self.id_salt,
            reports=self.silo_reports,
        )
        counts = {s: list(r.class_counts) for s, r in self.silo_reports.items() if r.class_counts}
        self.events.write(
            "roster",
            t=self.clock.now,
            version=self.version,
            silos={
                str(s): {
                    "node": n,
                    "num_samples": self.num_samples[s],
                    "speed": self.speeds[s],
                    **({"class_counts": counts[s]} if s in counts else {}),
                }
                for s, n in self.roster.items()
            },
        )

    # ---------------------------------------------------------------- dispatch
    def dispatch(
        self,
        silo: int,
        *,
        job_id: int | None = None,
        base_version: int | None = None,
        timing: tuple[float, float] | None = None,
        fault: str | None = None,
    ) -> None:
        """Send ``silo`` a train message with the newest model (or, on resume, its old job)."""
        if silo in self.cfg.silos.exclude:
            return  # retraining without this silo's data
        if silo in self.privacy.stopped:
            return  # it refused further work (out of privacy budget)
        if not self.erasure.may_train(silo):
            return  # retired by a whole-silo erasure, erasing or about to, or halted
        why = self.jobs.holding(silo)
        if why is not None:  # (before a fault or a job id is spent on it; send checks again)
            self.jobs.refuse(silo, JobKind.TRAIN, why, job_id, self.version)
            return
        self.requests.train(silo, job_id, base_version, timing, fault)

    def holding(self, silo: int) -> str | None:
        """Why ``silo`` may not be sent work now (None: it is idle)."""
        return self.jobs.holding(silo)

    def is_down(self, silo: int) -> bool:
        """A silo whose work failed and that waits to be sent work again (offline)."""
        return self.jobs.is_down(silo)

    def dispatch_calibration(self, silo: int, start: Params, steps: int, erasure: Any) -> bool:
        """FedEraser: a train message of ``steps`` local steps from the model being rebuilt."""
        return self.requests.calibration(silo, start, steps, erasure)

    def dispatch_unlearn(self, silo: int, start: Params, erasure: Any) -> bool:
        """Send ``silo`` a train.unlearn message (server/requests.py); False when refused."""
        return self.requests.unlearn(silo, start, erasure)

    def silo_sample_ids(self, silo: int) -> list[str]:
        """The sample ids ``silo`` holds (empty where the server holds no silo data)."""
        return self.requests.silo_sample_ids(silo)

    def updates_accepted_between(self, t0: float, t1: float) -> int:
        """Updates accepted in the clock interval ``(t0, t1]``."""
        return self.stats.accepted_between(t0, t1)

    def apply_erasure(self, params: Params) -> None:
        """The erasure's model becomes the newest version (the erasure boundary)."""
        self._new_version(params)

    # ---------------------------------------------------------------- the loop
    def _poll(self) -> None:
        waiting = list(self.jobs.unanswered)  # in send order
        waiting += self.cancels.waiting_ids()  # (pulled to be dropped: none is left behind)
        if waiting:
            for reply in self.grid.pull_messages(waiting):
                mid = reply.metadata.reply_to_message_id
                if self.cancels.on_reply(mid, reply):
                    continue
                self.arrived[mid] = reply
                self.jobs.answered(mid)

    def cancel_for_erasure(self, silo: int, request_id: str) -> bool:
        """Cancel ``silo``'s training job in flight for erasure ``request_id``
        (server/cancel.py); True when the silo is idle now."""
        self.cancels.cancel(silo, request_id)
        return self.jobs.holding(silo) is None

    def _discarded(self, job: Job, reply: Message) -> None:
        """A cancelled job's reply: its privacy spend still counts, and a refusal (out of
        budget) still stops the silo; nothing else of it is used."""
        got = read_reply(reply)
        note = self.privacy.take(job.silo, job.job_id, got)
        if note.stop is not None:
            self._stopped(note.stop)

    def _abandon_timed_out(self) -> None:
        limit = self.cfg.server.reply_timeout_s
        self.cancels.expire(limit)
        expired = []
        for mid in self.jobs.unanswered:  # sent in order, so the oldest first
            if time.monotonic() - self.inflight[mid].wall_sent <= limit:
                break
            expired.append(mid)
        for mid in expired:
            job = self.jobs.take(mid)
            detail = f"no reply within {limit:g}s wall (job {job.job_id} abandoned)"
            self._reject(job, Rejection(RejectReason.CLIENT_ERROR, detail))
            self._after_failure(job, down_s=0.0)
            self._abandoned[job.kind](job, detail)

    @property
    def deadline(self) -> float:
        """Clock time at which the run stops: ``run.budget_s`` after the first dispatch."""
        start = self.clock.now if self.started_at is None else self.started_at
        return start + self.cfg.run.budget_s

    def run(self) -> None:
        """Train until ``run.budget_s`` has passed since the first dispatch (or
        ``run.max_versions``)."""
        if self._make_progress is not None and self.progress is None:
            self.progress = self._make_progress(self.clock.now)
        if self.started_at is None:
            self.started_at = self.clock.now  # 0 on the virtual clock
        budget = self.deadline
        for silo in sorted(self.roster):
            self._budget_refuses(silo)  # a ledger kept across runs may be spent already
        if not self.inflight:
            for silo in sorted(self.roster):
                self.dispatch(silo)
        while True:
            if self._at_cap():
                break
            self.erasure.poll()
            t_job = self.clock.next_event_time(self.inflight)
            t_retry = self.jobs.retries[0][0] if self.jobs.retries else float("inf")
            t_erase = self.erasure.next_time()
            what, t_next = self.clock.next(t_job, t_retry, t_erase)
            if t_next > budget or (
                not self.inflight and not self.jobs.retries and t_erase == float("inf")
            ):
                break
            if what is Next.TIMER:
                self.clock.advance_to(t_erase)
                continue  # the scheduled erasure is submitted by poll() at the loop's top
            if what is Next.RETRY:
                _, silo = self.jobs.next_retry()
                self.clock.advance_to(t_retry)
                if not self.barrier:
                    self.dispatch(silo)
                continue
            due = self._wait_due()
            if due is None or self._settle(due):
                continue
            self.clock.advance_to(max(self.inflight[m].finishes_at for m in due))
            ready: list[int] = []
            # simultaneous replies in job order: message ids are random (uuid4), and folding
            # in their order made a seed's run differ in the last bits from one run to the next
            for mid in sorted(due, key=lambda m: self.inflight[m].job_id):
                if self._at_cap():
                    # the cap is exact: replies that came in the same poll as the one that
                    # reached it are left, like any reply still out when a run ends
                    break
                job = self.jobs.take(mid)
                if self._take(job, self.arrived.pop(mid)):
                    ready.append(job.silo)
            if self.barrier:
                if not self.inflight:
                    self._close_round()
            elif not self._at_cap():
                for silo in sorted(ready):
                    self.dispatch(silo)
            self.jobs.prune_sent()
            self._tick()

    def _settle(self, due: list[str]) -> bool:
        """Virtual clock: jobs among ``due`` whose length their silo decided (``Job.work``)
        finish after the work their reply reports (within the job's bounds; a reply that
        reports none, an error, counts the least) rather than now; True when one moved (the
        loop then takes whatever is due first)."""
        moved = False
        for mid in due:
            job = self.inflight[mid]
            if job.work is None:
                continue
            least, most = job.work
            reported = reported_work(self.arrived[mid])
            units = least if reported is None else min(max(reported, least), most)
            finish = job.dispatched_at + self.clock.span(job.silo, units)  # type: ignore[attr-defined]
            self.jobs.reschedule(mid, max(finish, job.finishes_at))
            moved = moved or finish > job.finishes_at + 1e-9
        return moved

    def _at_cap(self) -> bool:
        """The run made ``run.max_versions`` versions."""
        cap = self.cfg.run.max_versions
        return cap is not None and self.version >= cap

    def _wait_due(self) -> list[str] | None:
        entered = time.monotonic()
        while True:
            self._poll()
            due = self.clock.select(self.inflight, self.arrived.keys())
            if due is not None:
                return due
            self._abandon_timed_out()
            if not self.clock.realtime:  # the reply to take is known; wait for that one only
                if not self.inflight:
                    return None
                time.sleep(0.005)
                continue
            if self.clock.now > self.deadline or (
                self.jobs.retries and self.jobs.retries[0][0] <= self.clock.now
            ):
                return None  # the loop's top re-sends work to silos that are due
            if not self.inflight and not self.jobs.retries:
                if self.erasure.next_time() < float("inf"):
                    # nothing in flight (a halted federation) while an erasure waits out its
                    # pause: the loop's top would otherwise spin until it is due
                    time.sleep(self.cfg.server.poll_interval_s)
                return None
            if self.erasure.enabled and time.monotonic() - entered > 1.0:
                return None  # the loop's top starts live erasure requests within a second
            time.sleep(self.cfg.server.poll_interval_s)

    def _close_round(self) -> None:
        """Sync mode: average what the round brought, then send everyone the new model."""
        cal = self.calibration
        res = self.pipeline.flush(self.params, cal.project if cal.projects_applied else None)
        if res is not None and res.params is not None:
            self.privacy.record_release(res.released, self.version + 1, res.noise_std)
            self.erasure.record(None, res.contributions, self.version)
            self._publish(res.params, "round")
        # silos that were down rejoin at the start of the next round
        self.jobs.clear_retries()
        for silo in sorted(self.roster):
            self.dispatch(silo)

    # ---------------------------------------------------------------- one reply
    def _take(self, job: Job, reply: Message) -> bool:
        """Take one reply, by its job's kind (``_takers``); True when its silo may be sent work
        at once."""
        return self._takers[job.kind](job, reply)

    def _checked(self, job: Job, reply: Message) -> tuple[Accepted | Rejection | None, Any]:
        """A train or calibration reply read and checked by the intake (None: the silo refused,
        out of privacy budget, and is stopped), and privacy's note of it."""
        got = read_reply(reply)  # an update, a refusal, or why it cannot be read
        note = self.privacy.take(job.silo, job.job_id, got)
        if isinstance(got, TrainRefusal):  # out of privacy budget: the silo is stopped
            if note.stop is not None:
                self._stopped(note.stop)
            return None, note
        if isinstance(got, Rejection):
            return got, note
        ref = self.params
        return self.intake.check(
            got, job, version=self.version, reference=ref, roster=self.roster
        ), note

    def _take_train(self, job: Job, reply: Message) -> bool:
        """A training reply: validated, then folded (``_fold``)."""
        res, note = self._checked(job, reply)
        if res is None:
            return False
        if isinstance(res, Rejection):
            self._reject(job, res)
            if res.reason is RejectReason.CLIENT_ERROR:
                self._after_failure(job, down_s=self._down_s(job, reply))
                return False
            return True
        if note.epsilon is not None:
            res.update.metrics["dp_epsilon"] = note.epsilon
        if self._budget_refuses(job.silo, job.job_id):
            return False
        self._fold(job, res)
        return True

    def _take_calibration(self, job: Job, reply: Message) -> bool:
        """FedEraser's calibration reply: handed to the coordinator, never folded; its silo is
        sent regular work again only when the rebuild is done."""
        res, _ = self._checked(job, reply)
        if isinstance(res, Rejection):
            self._reject(job, res)
        self.erasure.take_calibration(
            job, None if res is None or isinstance(res, Rejection) else res.update
        )
        return False

    def _take_unlearn(self, job: Job, reply: Message) -> bool:
        """A silo's erasure result: validate it, then let the coordinator apply it."""
        erasure = job.erasure
        result = read_unlearn_reply(reply, self.params)
        if isinstance(result, SiloLost):  # it went down mid-erasure: queued again, not failed
            self.erasure.requeue(erasure, result)
            self._after_failure(job, down_s=self._down_s(job, reply))
            return False  # sent work, and the erasure, again once it is back
        if isinstance(result, str):
            log.error("erasure %s failed: %s", erasure.request_id, result)
            self.erasure.failed(erasure, result)
            return True  # the silo goes back to training; the request says why it failed
        self.erasure.take_unlearn(erasure, result)
        return bool(erasure.sample_ids)  # a retired silo is not sent work again

    def _stopped(self, stop: Stop) -> None:
        self.events.write("silo_stopped", t=self.clock.now, version=self.version, **stop.event())

    def _budget_refuses(self, silo: int, job_id: int | None = None) -> bool:
        """True when central DP's budget stops ``silo`` (now, or earlier in this run)."""
        refuses, stop = self.privacy.over_budget(silo, job_id)
        if stop is not None:  # newly stopped
            self._stopped(stop)
        return refuses

    def _down_s(self, job: Job, reply: Message) -> float:
        """How long a failed silo waits before it is sent work again."""
        if reply.has_error() and ErrorReply(reply.error.code, reply.error.reason).offline:
            return self.cfg.server.offline_retry_s  # not at once: the SuperLink would refuse again
        return self.faults.crash_down_s(job.silo) if job.fault == "crash" else 0.0

    def _after_failure(self, job: Job, down_s: float) -> None:
        """Re-send the silo work after ``down_s`` (0: as soon as the loop goes on)."""
        if not self.barrier:
            self.jobs.retry_after(job.silo, down_s)

    def _reject(self, job: Job, rej: Rejection) -> None:
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
            t=self.clock.now,
            version=self.version,
            silo=job.silo,
            job=job.job_id,
            reason=rej.reason.value,
            detail=rej.detail,
        )

    def _fold(self, job: Job, acc: Accepted) -> None:
        """Correct and fold an accepted update (server/pipeline.py), count it, and publish the
        new model when the fold made one."""
        update, cal = acc.update, self.calibration
        w_base = self.jobs.sent.get(job.base_version)
        # its base weights dropped (server.corrections.max_snapshots): no delay compensation
        dc_skipped = w_base is None and acc.staleness > 0 and self.dc_lambda > 0
        if not cal.compensates(job):
            w_base, dc_skipped = None, False
        overlaps: list[float] = []  # what the calibration measured, the last one logged

        def calibrate(tensors: Params) -> Params | Rejection:
            calibrated, overlap = cal.calibrate(job, tensors)
            if overlap is not None:
                overlaps.append(overlap)
            return calibrated

        def project(change: Params) -> Params:
            projected, overlap = cal.project_measured(change)
            if overlap is not None:
                overlaps.append(overlap)
            return projected

        res = self.pipeline.fold(
            self.params,
            update,
            staleness=acc.staleness,
            factor=acc.decision.factor,
            norm=acc.norm,
            w_base=w_base,
            calibrate=calibrate,
            project=project if cal.projects_applied else None,
        )
        if overlaps:
            update.metrics["calibration_overlap"] = overlaps[-1]
        if isinstance(res, Rejection):
            self._reject(job, res)
            return
        if res.released:
            self.privacy.record_release(res.released, self.version + 1, res.noise_std)
            update.metrics["central_epsilon"] = self.privacy.central_epsilon[job.silo]
        self.stats.accept(job.silo, acc.staleness, res.weight, res.flushed, self.clock.now)
        if dc_skipped:
            self.stats.dc_skip()
        # the silos' exact shares of what this fold applied (kept only by an erasure part)
        self.erasure.record(job.silo, res.contributions, self.version, acc.norm)
        self.events.write(
            "update",
            t=self.clock.now,
            version=self.version,
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
            self._publish(res.params, f"update of silo {job.silo} (job {job.job_id})")

    def _publish(self, params: Params, cause: str) -> None:
        """A fold's model becomes the next version, unless it is non-finite. Every update is
        checked finite and bounded before it is folded, so a NaN/Inf model is the server's
        doing (an overflow, a server optimiser gone wrong): it is refused and the model stays
        where it was. Published, it would make every silo's next update non-finite and every
        silo would be blamed (``non_finite``) for the rest of the run."""
        if not is_finite(params):
            self.stats.refuse_version()
            log.error(
                "the model after the %s is not finite: refused, the model stays at version %d",
                cause,
                self.version,
            )
            self.events.write(
                "version_refused",
                t=self.clock.now,
                version=self.version,
                reason="non_finite_model",
                cause=cause,
            )
            return
        self._new_version(params)

    def _new_version(self, params: Params) -> None:
        if not flat_same(params, self.params):
            params = flatten(params)  # (an erasure's model, a restored checkpoint: rare)
        self.params = params
        self.version += 1
        self.events.write("version", t=self.clock.now, version=self.version)
        if self.barrier or self.version % self.cfg.server.eval_every == 0:
            self.evaluate()  # sync rounds are few and long: evaluate every one
        every = self.cfg.server.checkpoint_every
        if every and self.version % every == 0:
            self.checkpoint()
        self.erasure.on_version()

    def evaluate(self) -> dict[str, float]:
        """Evaluate the global model (``evaluate_fn``), record it and write an ``eval`` event."""
        res = self.evaluate_fn(self.params)
        rec = {"t": self.clock.now, "version": self.version, **res}
        self.stats.evaluated(rec)
        self.events.write("eval", **rec)
        if self.progress is not None:
            self.progress.set_postfix(
                version=self.version, score=f"{res['score']:.3f}", refresh=False
            )
        return res

    def _tick(self) -> None:
        if self.progress is not None:
            elapsed = self.clock.now - (self.started_at or 0.0)
            self.progress.n = min(elapsed, self.cfg.run.budget_s)
            self.progress.refresh()

    # ---------------------------------------------------------------- checkpoints
    def checkpoint(self) -> None:
        """Write ``checkpoint.pt`` and a ``checkpoint`` event (server/checkpoint.py)."""
        write_checkpoint(self)
