"""The asynchronous server loop on Flower's Grid (push_messages / pull_messages).

One event loop for every strategy (server/strategies.py): FedAsync (Xie et al. 2019) and
FedBuff (Nguyen et al. 2022) keep every silo busy, each reply validated, corrected and folded
in as soon as it is taken and that silo sent the newest model at once; synchronous FedAvg, the
baseline on the same silos and clock, waits for every silo's reply before the round is
averaged, so one straggler stalls everyone. The strategy decides the fold rule and what is
sent when; the loop never asks which one runs.

Which reply is taken next is the clock's decision (fedasync/clock.py): virtual-finish order in
simulation (deterministic for a seed), arrival order on the wall clock in deployment. Failed
silos are sent work again by the dispatcher's retries (server/dispatch.py); a message
unanswered for ``server.reply_timeout_s`` wall seconds is abandoned; ``run.budget_s`` counts
from the first dispatch. One silo, at most one job in flight, always.

This module is the event loop only: dispatching, taking replies in order, publishing
versions, and checkpoints (the loop's own state and its parts' ``state_dict``s by name). The
rest are its parts (docs/how-it-works.md), each given what it reads: the requests it sends
(server/job_requests.py), the dispatcher, how a reply is taken (server/replies.py), the intake,
pipeline, privacy, statistics and the erasure part (server/unlearning/; ``NoErasure`` in a
run that cannot erase). ``server.app.build_server`` builds it complete.

One file (over 500 lines) because it is one thing: the loop's own state (the version, the
model, the clock's origin) and every method that reads or writes it: the dispatch, the event
loop, a new version, the checkpoint, and what its parts may ask of it (a strategy's
``StrategyHost``, the erasure part's ``ServedModel`` and ``SiloJobs``). Each part's work is in its own module,
given the values and callables it needs when the loop is built.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from fedasync import Params
from fedasync.clock import Clock, InFlight, Next
from fedasync.events import EventLog
from fedasync.flat import flatten
from fedasync.flat import same as flat_same
from fedasync.tensors import is_finite
from protocol.config import to_dict
from server.cancel import JobCanceller
from server.checkpoint import (
    CheckpointState,
    Part,
    Stateful,
    check_mode,
    compose,
    load_state,
    restore,
    save_state,
)
from server.clock import client_setup, run_clock, silo_speeds
from server.config import FedAsyncConfig
from server.corrections import CorrectionPipeline
from server.dispatch import MAX_SNAPSHOTS, Dispatcher, FaultSchedule
from server.evaluation import BestModel
from server.intake import Intake, Job, JobKind
from server.job_requests import JobRequests
from server.models import MODELS_DIR, ModelStore
from server.privacy import ServerPrivacy
from server.replies import ReplyRouter
from server.reply_pull import POLL_INTERVAL_S, REPLY_STALL_S, ReplyPuller
from server.roster import discover_silos, roster_event
from server.stats import ServerStats
from server.strategies import strategy_for
from server.summary import RunFacts
from server.unlearning import ErasureCoordinator, ErasureFactory, ErasureRun, NoErasure

log = logging.getLogger("fedasync.server")


class AsyncServer:
    """Runs one federated training job on ``grid``: the event loop over the parts it owns
    (module docstring). ``erasure`` makes the erasure coordinator for this server (None:
    ``NoErasure``); ``progress`` makes the progress display from the clock time ``run`` starts
    at; ``sample_ids_fn`` gives a silo's sample ids where the server holds them (simulation);
    ``id_salt`` is what the silos salt their ids' digests with (deployment)."""

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
        erasure: ErasureFactory | None = None,
        progress: Callable[[float], Any] | None = None,
    ):
        self.cfg = cfg
        self.grid = grid
        self.puller = ReplyPuller(grid, cfg.server.reply_timeout_s, REPLY_STALL_S)
        self.run_dir = run_dir
        # one flat buffer per dtype (fedasync/flat.py): every fold and correction is fused
        self.params: Params = flatten(initial_params, device="cpu")
        self.evaluate_fn = evaluate_fn
        self.version = 0
        self.strategy = strategy_for(cfg)  # the fold rule, and what is sent when
        self.speeds = silo_speeds(cfg.silos, cfg.lab.speed, cfg.run.seed)
        self.clock: Clock = run_clock(cfg, self.speeds, wall_clock)
        self.events = EventLog(run_dir / "metrics.jsonl")
        self.jobs = Dispatcher(grid, self.clock, self.events, MAX_SNAPSHOTS)
        self.faults = FaultSchedule([to_dict(f) for f in cfg.lab.faults])
        self.intake = Intake(cfg.server, cfg.lab)
        self.pipeline = CorrectionPipeline(cfg, self.strategy.aggregator())
        self.privacy = ServerPrivacy.for_run(cfg.server.dp, run_dir)
        self.stats = ServerStats()
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
            on_discard=lambda job, reply: self.replies.discarded(job, reply),
        )
        self.ckpt_path = run_dir / "checkpoint.pt"
        self.models = ModelStore(run_dir / MODELS_DIR, cfg.server.keep_models)  # (snapshots)
        self.best = BestModel()  # the model at its best evaluation (the ``best`` bundle)
        self.progress: Any = None  # fedasync.progress's bar or lines, made when run() starts
        self._make_progress = progress
        self.requests = JobRequests(
            cfg,
            self.setup_json,
            run_dir,
            jobs=self.jobs,
            faults=self.faults,
            clock=self.clock,
            events=self.events,
            roster=self.roster,
            model=lambda: (self.version, self.params),
            erased_ids=lambda silo: self.erasure.excluded.get(silo, []),
            sample_ids_fn=sample_ids_fn,  # silo -> its sample ids, or None
        )
        self.id_salt = id_salt  # the silos report their ids' digests under it (deployment)
        self.silo_reports: dict[int, Any] = {}  # silo -> its roster reply (protocol QueryReply)
        self.started_at: float | None = None  # clock time of the first dispatch (budget origin)
        # the erasure part: a coordinator made for this server, or NoErasure (cannot erase)
        self.erasure: ErasureCoordinator | NoErasure = NoErasure()
        if erasure is not None:  # the model it changes, the silos' jobs, the run's values
            self.erasure = erasure(
                self,
                self,
                ErasureRun(
                    cfg,
                    self.clock,
                    self.events,
                    self.roster,
                    self.num_samples,
                    score=lambda params: float(self.evaluate_fn(params)["score"]),
                    sample_ids=self.requests.silo_sample_ids,
                    accepted_between=self.stats.accepted_between,
                    norm_threshold=self.intake.norms.threshold,
                    at_boundary=self.pipeline.at_boundary,
                    halts=self.strategy.halts_for_erasure,
                    rebuilds=self.strategy.rebuilds_for_erasure,
                ),
            )
        self.replies = ReplyRouter(  # how a reply is taken, by its job's kind
            model=lambda: (self.version, self.params),
            roster=self.roster,
            intake=self.intake,
            privacy=self.privacy,
            pipeline=self.pipeline,
            stats=self.stats,
            events=self.events,
            now=lambda: self.clock.now,
            erasure=self.erasure,
            base_weights=lambda version: self.jobs.sent.get(version),
            crash_down_s=self.faults.crash_down_s,
            offline_retry_s=cfg.lab.offline_retry_s,
            failed=lambda silo, down_s: self.strategy.failed(self, silo, down_s),
            publish=self.publish,
        )

    @property
    def inflight(self) -> InFlight[Job]:
        """The jobs in flight, by message id (the dispatcher's)."""
        return self.jobs.inflight

    # ---------------------------------------------------------------- set-up
    def connect(self) -> None:
        """Wait for the silos' nodes and learn which node is which silo, and what each reports
        of its data (sample and class counts; with ``id_salt``, its ids' digests): the
        ``roster`` event (server/roster.py)."""
        roster, samples = discover_silos(
            self.grid,
            self.setup_json,
            self.cfg.silos.count,
            self.cfg.server.wait_for_nodes_s,
            salt=self.id_salt,
            reports=self.silo_reports,
        )
        self.roster.update(roster)  # (filled in place: the parts hold it)
        self.num_samples.update(samples)
        silos = roster_event(self.roster, self.num_samples, self.speeds, self.silo_reports)
        self.events.write("roster", t=self.clock.now, version=self.version, silos=silos)

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, silo: int, resend: Mapping[str, Any] | None = None) -> None:
        """Send ``silo`` a train message with the newest model (or, on resume, its old job:
        ``resend``, as the checkpoint keeps it, ``Dispatcher.jobs_to_resend``)."""
        if silo in self.cfg.lab.exclude:
            return  # retraining without this silo's data
        if silo in self.privacy.stopped:
            return  # it refused further work (out of privacy budget)
        if not self.erasure.may_train(silo):
            return  # retired by a whole-silo erasure, erasing or about to, or halted
        why = self.jobs.holding(silo)
        if why is not None:  # (before a fault or a job id is spent on it; send checks again)
            job_id = None if resend is None else resend["job_id"]
            self.jobs.refuse(silo, JobKind.TRAIN, why, job_id, self.version)
            return
        self.requests.train(silo, resend)

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
        """Send ``silo`` a train.unlearn message (server/job_requests.py); False when refused."""
        return self.requests.unlearn(silo, start, erasure)

    def apply_erasure(self, params: Params) -> None:
        """The erasure's model becomes the newest version (the erasure boundary). No model
        from before it is kept (the best so far, the snapshots): they carry the erased data."""
        self.best.forget()
        self._new_version(params)
        self.models.drop(before=self.version)

    # ---------------------------------------------------------------- the loop
    def _poll(self) -> None:
        waiting = list(self.jobs.unanswered)  # in send order
        waiting += self.cancels.waiting_ids()  # (pulled to be dropped: none is left behind)
        if waiting:
            for reply in self.puller.pull(waiting):
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

    def _abandon_timed_out(self) -> None:
        limit = self.cfg.server.reply_timeout_s
        self.cancels.expire(limit)
        for job in self.jobs.take_timed_out(limit):
            self.replies.abandon(
                job, f"no reply within {limit:g}s wall (job {job.job_id} abandoned)"
            )

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
            self.replies.budget_refuses(silo)  # a ledger kept across runs may be spent already
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
                self.strategy.free(self, silo)
                continue
            due = self._wait_due()
            if due is None or self.jobs.settle(due, self.arrived):
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
            self.strategy.replies_taken(self, [] if self._at_cap() else ready)
            self.jobs.prune_sent()
            self._tick()

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
                    time.sleep(POLL_INTERVAL_S)
                return None
            if self.erasure.enabled and time.monotonic() - entered > 1.0:
                return None  # the loop's top starts live erasure requests within a second
            time.sleep(POLL_INTERVAL_S)

    def flush(self) -> None:
        """Fold what the aggregator holds as the next version (a round's end: the strategy
        asks for it)."""
        cal = self.erasure.calibration  # (a no-op without erasures)
        res = self.pipeline.flush(self.params, cal.project if cal.projects_applied else None)
        if res is not None and res.params is not None:
            self.privacy.record_release(res.released, self.version + 1, res.noise_std)
            self.erasure.record(None, res.contributions, self.version)
            self.publish(res.params, "round")

    def retry_after(self, silo: int, down_s: float) -> None:
        """``silo`` is free again ``down_s`` clock seconds from now (the dispatcher's retry)."""
        self.jobs.retry_after(silo, down_s)

    def release(self, silo: int) -> None:
        """``silo`` may train again (an erasure released it): the strategy sends it work now
        or at its next round."""
        self.strategy.free(self, silo)

    # ---------------------------------------------------------------- one reply
    def _take(self, job: Job, reply: Message) -> bool:
        """Take one reply (server/replies.py); True when its silo may be sent work at once."""
        return self.replies.take(job, reply)

    def publish(self, params: Params, cause: str) -> None:
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
        score = None
        if self.strategy.evaluates(self.version):
            score = self.evaluate().get("score")
        every = self.cfg.server.checkpoint_every
        if every and self.version % every == 0:
            self.checkpoint()
        self.erasure.on_version(score)

    def silo_eval(self, silo: int, result: dict[str, float]) -> None:
        """Write ``silo``'s evaluation of the global model as a ``silo_eval`` event."""
        self.events.write("silo_eval", t=self.clock.now, version=self.version, silo=silo, **result)

    def evaluate(self) -> dict[str, float]:
        """Evaluate the global model (``evaluate_fn``), record it and write an ``eval`` event."""
        res = self.evaluate_fn(self.params)
        rec = {"t": self.clock.now, "version": self.version, **res}
        self.stats.evaluated(rec)
        self.events.write("eval", **rec)
        self.best.offer(self.version, res.get("score"), self.params)
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

    def facts(self) -> RunFacts:
        """What the run's summary says besides the statistics (server/summary.py)."""
        silos = range(self.cfg.silos.count)
        return RunFacts(
            mode=self.cfg.server.mode,
            silos=self.cfg.silos.count,
            target=self.cfg.lab.target_accuracy,
            version=self.version,
            clock_kind=self.clock.kind,
            virtual_time_s=None if self.clock.realtime else self.clock.now,
            speeds=list(self.speeds),
            num_samples=dict(self.num_samples),
            privacy={s: self.privacy.row(s) for s in silos},
            dispatches_refused=self.jobs.refused,
            cancels=self.cancels.summary(),
            faults=self.faults.fired,
        )

    # ---------------------------------------------------------------- checkpoints
    def parts(self) -> dict[str, Stateful]:
        """The parts a checkpoint holds, by name, in the order they are restored."""
        return {
            "dispatcher": Part(
                lambda: self.jobs.state_dict(self.params, self.version), self.jobs.load_state_dict
            ),
            "faults": self.faults,
            "pipeline": self.pipeline,
            "intake": self.intake,
            "stats": self.stats,
            "privacy": self.privacy,
            "cancels": self.cancels,
            "erasure": self.erasure,  # (None without erasures)
            "best": self.best,  # (None before an evaluation scored)
        }

    def state_dict(self) -> CheckpointState:
        """Everything the loop needs to continue as if it had never stopped: the version and
        weights, the train jobs in flight (re-sent identically; an erasure in flight is
        restarted from the erasure store instead), the event log's length, the clock, and
        each part's ``state_dict`` (server/checkpoint.py)."""
        return CheckpointState(
            mode=self.cfg.server.mode,
            version=self.version,
            params=self.params,
            jobs=self.jobs.jobs_to_resend(),
            events_offset=self.events.offset(),
            loop={"clock": self.clock.state_dict(), "started_at": self.started_at},
            parts=compose(self.parts()),
        )

    def load_state_dict(self, state: CheckpointState) -> None:
        """Restore what ``state_dict`` returned (the jobs in flight are ``resume``'s)."""
        self.version = int(state.version)
        self.params = flatten(state.params)  # (saved as a plain dict)
        self.clock.load_state_dict(state.loop["clock"])
        started = state.loop["started_at"]
        self.started_at = 0.0 if started is None else float(started)  # the budget's origin
        restore(self.parts(), state.parts)

    def checkpoint(self) -> None:
        """Write the model snapshot (server/models.py), then ``checkpoint.pt`` (atomically,
        with a digest) and a ``checkpoint`` event."""
        self.models.save(self.version, self.params)
        save_state(self.ckpt_path, self.state_dict())
        self.events.write("checkpoint", t=self.clock.now, version=self.version)

    def resume(self) -> bool:
        """Restore from ``checkpoint.pt`` if present and re-send the jobs that were in flight;
        False when there is none (the run starts afresh)."""
        if not self.ckpt_path.exists():
            return False
        state = load_state(self.ckpt_path)
        check_mode(self.ckpt_path, state, self.cfg.server.mode)
        self.load_state_dict(state)
        self.events.truncate(state.events_offset)
        self.models.drop(after=self.version)  # written past the checkpoint by the run that stopped
        self.erasure.reconcile()
        self.events.write("resume", t=self.clock.now, version=self.version)
        log.info(
            "resumed from %s at version %d, t=%.1f", self.ckpt_path, self.version, self.clock.now
        )
        # jobs whose base weights the checkpoint kept go out first, as they were: re-sending a
        # job whose weights were dropped stores the current model, which could evict them
        for j in sorted(state.jobs, key=lambda j: not self.requests.base_kept(j["base_version"])):
            self.dispatch(j["silo"], resend=j)
        busy = {j.silo for j in self.inflight.values()}
        for silo in sorted(self.roster):  # between two jobs at the checkpoint (a reply just taken)
            if silo not in busy and not self.is_down(silo):
                self.strategy.free(self, silo)
        return True
