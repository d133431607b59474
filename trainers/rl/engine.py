"""The asynchronous RL engine: the run's loop. It asks the schedule what to start, the clock
what comes next, and hands rollouts to the teacher scoring and batches to the learner.

Papers: AReaL (Fu et al. 2025), one-step-off (Noukhovitch et al. 2024), DORA-style streaming
(arXiv 2604.26256); the modes' rules are :mod:`trainers.rl.schedule`'s.

The parts, each with its own state and ``state_dict``: the schedule (which group starts when,
which batch is learnt), the learner, the teacher scoring (:mod:`trainers.rl.scoring`), the
costs (:mod:`trainers.rl.costs`), the core's clock and the statistics (:mod:`trainers.rl
.stats`); the checkpoint composes them (:mod:`trainers.rl.run_checkpoint`). Workers are in this
process (:mod:`trainers.rl.local_backend`) or Ray actors (:mod:`trainers.rl.ray_backend`,
:mod:`trainers.rl.ray_teacher`).

Each pass of the loop learns if a batch is ready, dispatches to free workers, collects what
came back and takes what the clock (:mod:`fedasync.clock`) says comes next: the learner's
step, scored groups or rollouts. On the virtual clock a group takes (its generated tokens) x
``clock.gen_token_s`` on a worker, a learner step (its batch's tokens) x
``clock.learn_token_s`` (the new version is available when it ends) and scoring (the group's
prompt + completion tokens) x ``clock.teacher_token_s`` on the earliest-free teacher server,
one event at a time in time order. On the wall clock (Ray actors) each takes what it takes
and what came back is taken as it comes.

On-policy distillation (``distill.loss`` != none) puts the teacher stage between a group's
arrival and the learner; the schedules are unchanged (a batch is complete when all of it is
scored), so with S = 0 ``async`` and ``streaming`` give sync's weights bit for bit either way.

A signal (Ctrl-C, SIGTERM, SIGHUP) stops the run at the top of the loop's next pass, where
the scheduling state is whole, with a checkpoint of it (:meth:`RLRun.step_loop`); the
:class:`fedasync.interrupt.Interrupted` it raises says where and names the checkpoint.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from fedasync.clock import Clock, VirtualClock, WallClock
from fedasync.devices import pick_device
from fedasync.events import EventLog
from fedasync.interrupt import DeferredStop, Interrupted, shielded
from fedasync.tensors import to_cpu
from fedasync.versions import VersionedSnapshots, staleness
from runkit.folder import RunFolder
from trainers.rl.backend import Backend, Job, ScoreJob, TeacherBackend, build_policy, build_task
from trainers.rl.config import RLConfig, to_container
from trainers.rl.costs import Costs, measure_costs
from trainers.rl.distill import DistillLearner
from trainers.rl.learner import Learner
from trainers.rl.local_backend import LocalBackend
from trainers.rl.policy import warm_start
from trainers.rl.profiles import tail_factor
from trainers.rl.rollout import check_group
from trainers.rl.run_checkpoint import load_run, save_run
from trainers.rl.run_end import close_all, note_stop, save_finished, write_outputs
from trainers.rl.schedule import Schedule
from trainers.rl.scoring import TeacherScoring
from trainers.rl.stats import RunStats, evaluate

log = logging.getLogger("fedasync.rl")

MAX_ATTEMPTS = 2
"""A group whose worker dies this many times is dropped."""

STOP_GRACE_S = 10.0
"""After a first SIGINT/SIGTERM/SIGHUP the loop stops (and saves) at the top of its next pass;
if no pass ends within this many seconds, the signal stops it where it is (no new checkpoint)."""


class RLRun:
    """One RL training run: ``RLRun(cfg, run_dir).run()`` returns the summary. Its parts: the
    schedule (:class:`trainers.rl.schedule.Schedule`), the learner, the teacher scoring
    (:class:`trainers.rl.scoring.TeacherScoring`), the costs, the clock and the statistics
    (:class:`trainers.rl.stats.RunStats`); each keeps its own state and checkpoint."""

    def __init__(
        self,
        cfg: RLConfig,
        run_dir: Path,
        backend: Backend | None = None,
        teacher_backend: TeacherBackend | None = None,
    ):
        self.cfg = cfg
        self.run_dir = run_dir
        self.folder = RunFolder(run_dir.parent, run_dir.name)
        """The run folder: the event log, summary.json and checkpoint.pt (runkit.folder)."""
        self.device = pick_device(cfg.run.device)
        self.task = build_task(cfg)
        r, d = cfg.rollout, cfg.distill
        self.policy = build_policy(cfg).to(self.device)
        self.distill = d.loss != "none"
        args = (self.policy, cfg.learner, r.temperature, self.device)
        self.learner = (
            DistillLearner(*args, d.loss, d.mc_samples) if self.distill else Learner(*args)
        )
        self.schedule = Schedule(cfg)
        self.scoring = TeacherScoring(cfg, self.task, self.device, teacher_backend)
        self.stats = RunStats(r.workers)
        self.costs = Costs.from_config(cfg)
        self.snapshots = VersionedSnapshots(max(r.max_staleness, 1) + 2)
        self.backend: Backend = (
            backend if backend is not None else LocalBackend(cfg, self.task, self.device)
        )
        self.clock: Clock = (
            VirtualClock([1.0] * r.workers, 1.0, jitter=cfg.clock.jitter, seed=cfg.run.seed)
            if r.clock == "virtual"
            else WallClock()
        )
        self.version = 0
        self.learner_done_at: float | None = None
        self.pending_metrics: dict[str, Any] | None = None
        self.die = set(cfg.faults.die_on_groups)
        self.nan = set(cfg.faults.nan_on_groups)
        self.events: EventLog | None = None
        self.phase = "start-up"
        """start-up, training, finishing or plots (the stop line says where it stopped)."""
        self.checkpoint: Path | None = None
        """The checkpoint a stop can resume from: the last one written or the one resumed."""
        self.checkpoint_version: int | None = None

    # ----------------------------------------------------------------- set-up
    def _start(self) -> None:
        """A fresh run (warm start, teacher, costs, the ``start`` event, version 0's
        evaluation), or the one ``checkpoint.pt`` holds with ``run.resume``."""
        cfg = self.cfg
        if cfg.run.resume:
            self.checkpoint = self.folder.checkpoint_path  # a stop while it loads keeps it
            load_run(self)
            self.checkpoint_version = self.version
            return
        self.events = self.folder.start(to_container(cfg))
        if cfg.policy.warm_start_steps > 0:
            self.stats.warm = warm_start(
                self.policy,
                self.task,
                steps=cfg.policy.warm_start_steps,
                batch_size=cfg.policy.warm_start_batch,
                lr=cfg.policy.warm_start_lr,
                seed=cfg.run.seed,
                device=self.device,
            )
        self.policy.eval()
        self.scoring.start(self.backend.kind)
        measure_costs(
            self.costs,
            cfg,
            self.policy,
            self.task,
            self.device,
            self.scoring.teacher,
            sample_reference=not self.clock.realtime,
        )
        self.events.write(
            "start",
            t=0.0,
            version=0,
            config=to_container(cfg),
            **self.costs.state_dict(),
            profile=self.costs.profile,
            teacher=self.scoring.info,
            warm_start=self.stats.warm,
            backend=self.backend.kind,
            clock=self.clock.kind,
        )
        self._publish(0)
        self._evaluate()

    # ----------------------------------------------------------------- scheduling
    def _dispatch(self) -> None:
        """Start what the schedule admits on the free workers."""
        for job in self.schedule.dispatch(self.version, self.clock.now):
            first = job.attempt == 0
            g = job.group_id
            self.backend.submit(job, die=first and g in self.die, nan=first and g in self.nan)

    def _timed(self, job: Job) -> None:
        """Set a job's finish time once its result is in: the clock's, from its tokens."""
        assert self.costs.gen_token_s is not None
        units: float = job.group.tokens if job.group is not None else 0
        if job.error is not None:
            units = units / 2.0
        units *= tail_factor(self.costs.tail_sigma, self.cfg.run.seed, job.group_id, job.attempt)
        job.finishes_at = self.clock.finish_at(
            job.worker, job.job_id, job.dispatched_at, units * self.costs.gen_token_s
        )

    def _arrive(self, job: Job) -> None:
        """A rollout came back: redo or drop it if its worker died, else check its samples and
        send it to the teacher, or make it ready to learn."""
        self.schedule.done(job)
        self.stats.busy_s[job.worker] += self.clock.now - job.dispatched_at
        outcome = "done"
        if job.error is not None or job.group is None:
            outcome = "died"
            reason = (job.error or "no result")[:200]
            log.warning("%s", reason)
            if job.attempt + 1 >= MAX_ATTEMPTS:
                self._drop(job.group_id, "worker died twice")
            else:
                self.stats.redone += 1
                self.schedule.redo.append((job.group_id, job.attempt + 1))
        else:
            group = check_group(job.group)
            for why in group.rejected:
                self.stats.rejected += 1
                self.event("reject", version=self.version, group=job.group_id, reason=why)
            if len(group.trajectories) < 2:
                self._drop(job.group_id, "fewer than 2 valid trajectories")
            elif self.distill:
                self.scoring.send(group, self.clock.now)
            else:
                self.schedule.make_ready(self.clock.now, group)
        self._rollout_event(job, job.group.tokens if job.group is not None else 0, outcome)

    def _scored(self, job: ScoreJob) -> None:
        """A group came back from the teacher: check its caches, then it may be learnt."""
        group, rejected = self.scoring.take(job)
        for why in rejected:
            self.stats.rejected += 1
            self.event("reject", version=self.version, group=group.group_id, reason=why)
        self.event(
            "score",
            version=self.version,
            group=group.group_id,
            start=job.dispatched_at,
            attempts=job.attempts,
            scorer=job.scorer,
        )
        if len(group.trajectories) < 2:
            self._drop(group.group_id, "fewer than 2 trajectories scored")
        else:
            self.schedule.make_ready(self.clock.now, group)

    def _rollout_event(self, job: Job, tokens: int, outcome: str) -> None:
        """One ``rollout`` event: the job's worker, version, start, finish (``t``) and outcome."""
        self.event(
            "rollout",
            version=self.version,
            group=job.group_id,
            worker=job.worker,
            behaviour=job.version,
            start=job.dispatched_at,
            tokens=tokens,
            outcome=outcome,
        )

    def _drop(self, group_id: int, reason: str, counted: bool = False) -> None:
        """Drop a group (``counted``: the schedule has counted it already) and say why."""
        self.stats.dropped[reason] += 1
        if not counted:
            self.schedule.drop(group_id)
        self.event("drop", version=self.version, group=group_id, reason=reason)

    def _maybe_learn(self) -> None:
        """Start a learner step on the batch the schedule gives, if the learner is free."""
        if self.learner_done_at is not None or self.version >= self.cfg.run.max_steps:
            return
        batch, dropped = self.schedule.take_batch(self.version)
        for group_id, reason in dropped:
            self._drop(group_id, reason, counted=True)
        if batch is None:
            return
        S = self.schedule.S
        for g in batch:
            tau = staleness(self.version, g.version)
            assert tau <= S or self.cfg.rollout.mode == "one_step_off", (tau, S)
        t0 = time.perf_counter()
        metrics = self.learner.step(batch, self.version)
        metrics["learn_s"] = time.perf_counter() - t0
        metrics["groups"] = [g.group_id for g in batch]
        self.stats.learner_tokens += metrics["tokens"]
        metrics["learner_tokens"] = self.stats.learner_tokens
        assert self.costs.learn_token_s is not None
        self.learner_done_at = self.clock.ends_at(
            self.clock.now, metrics["tokens"] * self.costs.learn_token_s
        )
        self.pending_metrics = metrics

    def _publish(self, version: int) -> None:
        """Keep ``version``'s weights and hand them to the workers; retire the oldest."""
        params = to_cpu(dict(self.policy.state_dict()))
        self.snapshots.put(version, params)
        self.backend.publish(version, params)
        oldest = self.snapshots.oldest
        if oldest is not None:
            self.backend.retire(oldest)

    def _finish_step(self) -> None:
        """The learner's step ends: the new version, its ``step`` event, streaming's aborts,
        and the evaluation and checkpoint when due."""
        assert self.pending_metrics is not None
        m, st = self.pending_metrics, self.stats
        self.pending_metrics, self.learner_done_at = None, None
        self.version += 1
        self._publish(self.version)
        prev_t = st.steps[-1]["t"] if st.steps else 0.0
        dt = self.clock.now - prev_t
        m["tokens_per_s"] = m["tokens"] / dt if dt > 0 else None
        m["dropped_total"] = dict(st.dropped)
        m["t"] = self.clock.now
        m["version"] = self.version
        st.steps.append({k: m[k] for k in ("t", "version", "reward", "accuracy")})
        self.event(
            "step",
            version=self.version,
            **{k: v for k, v in m.items() if k not in ("t", "version")},
        )
        for job in self.schedule.stale_in_flight(self.version):  # can no longer be learnt
            st.busy_s[job.worker] += self.clock.now - job.dispatched_at
            self.schedule.done(job)
            self._drop(job.group_id, "stale in flight: aborted")
            self._rollout_event(job, 0, "aborted")
        if self.version % self.cfg.run.eval_every == 0 or self.version >= self.cfg.run.max_steps:
            self._evaluate()
        every = self.cfg.run.checkpoint_every
        if every and self.version % every == 0 and self.version < self.cfg.run.max_steps:
            self._save()

    def _evaluate(self) -> None:
        """Evaluate the policy now: the ``eval`` event; the time the target is first reached."""
        m = evaluate(self.cfg, self.policy, self.scoring.teacher, self.task, self.device)
        row = {"t": self.clock.now, "version": self.version, **m}
        row["learner_tokens"] = self.stats.learner_tokens
        self.stats.evals.append(row)
        self.event("eval", **{k: v for k, v in row.items() if k != "t"})
        target = self.cfg.run.target_accuracy
        if target is not None and m["accuracy"] >= target and self.stats.reached_target_at is None:
            self.stats.reached_target_at = self.clock.now

    def event(self, name: str, /, **fields: Any) -> None:
        """One event (at now unless ``t`` is given), once the event log is open."""
        if self.events is not None:
            fields.setdefault("t", self.clock.now)
            self.events.write(name, **fields)

    def _done(self) -> bool:
        """``run.max_steps`` versions made, or the target accuracy reached."""
        return self.version >= self.cfg.run.max_steps or self.stats.reached_target_at is not None

    # ----------------------------------------------------------------- the loop
    def step_loop(self, progress: Any = None) -> None:
        """Run until ``run.max_steps`` versions or the target accuracy (``progress``: one
        ``update(1)`` per step).

        Each pass learns if a batch is ready, dispatches to free workers and collects. On the
        virtual clock the clock moves to the earliest of the step's end, a scoring's end and a
        group's end; on the wall clock what has arrived is taken as it comes. Raises
        RuntimeError when nothing is in flight and nothing can be learnt (a deadlock).

        A first SIGINT, SIGTERM or SIGHUP stops it at the top of the next pass where no learner
        step is pending (the scheduling state is whole there): ``checkpoint.pt`` is written and
        :class:`fedasync.interrupt.Interrupted` raised (``at_safe_point``). A second signal, or
        no such pass within ``STOP_GRACE_S``, raises at once and keeps the last checkpoint. An
        exception once a stop was asked for (a Ray actor the signal reached) is part of the
        stop: the Interrupted is raised instead.
        """
        with DeferredStop(STOP_GRACE_S) as stop:
            try:
                while not self._done():
                    if self.learner_done_at is None:
                        self._stop_here(stop)
                    self._pass(progress)
                self._stop_here(stop)  # asked for during the last pass: the run is whole
            except Interrupted:
                raise
            except Exception as e:
                if stop.requested is None:
                    raise
                log.info("during the stop: %s: %s", type(e).__name__, str(e)[:200])
                raise Interrupted(stop.requested) from None

    def _stop_here(self, stop: DeferredStop) -> None:
        """A safe point: when a stop was asked for, save the run and raise the Interrupted."""
        try:
            stop.check()
        except Interrupted:
            with shielded():  # one write; a second Ctrl-C must not tear it
                self._save()
            raise

    def _pass(self, progress: Any) -> None:
        """One pass of the loop (``step_loop``): learn, dispatch, collect what came back, then
        take what the clock says comes next: the learner's step, scored groups or rollouts."""
        self._maybe_learn()
        self._dispatch()
        if not self.schedule.inflight and self.learner_done_at is None and not self.scoring.jobs:
            raise RuntimeError(
                f"deadlock at version {self.version}: nothing in flight, nothing to "
                f"learn (ready {len(self.schedule.ready)}, redo {len(self.schedule.redo)})"
            )
        wait_all = not self.clock.realtime  # the virtual clock orders them by finish time
        asked = [j for j in self.schedule.inflight.values() if j.finishes_at == math.inf]
        if asked:
            wait = 0.05 if self.learner_done_at is None else 0.0
            for j in self.backend.collect(asked, wait_all=wait_all, timeout=wait):
                self._timed(j)
        self.scoring.collect(self.clock, wait_all, self.costs.teacher_token_s)
        jobs = {
            str(j.job_id): j for j in self.schedule.inflight.values() if j.finishes_at != math.inf
        }
        scores = {str(j.job_id): j for j in self.scoring.jobs.values() if j.finishes_at != math.inf}
        t_learn = self.learner_done_at if self.learner_done_at is not None else math.inf
        times = [
            t_learn,
            *(self.clock.next_event_time(m) if m else math.inf for m in (scores, jobs)),
        ]
        kinds = self.clock.kinds_due(times)  # virtual: the first; wall: all that came back
        if not kinds and not asked:
            time.sleep(0.02)  # wall clock: only the teacher is busy, and has nothing yet
        for kind in kinds:
            self.clock.advance_to(times[kind])
            if kind == 0:  # the step makes a version: the next pass plans anew
                self._finish_step()
                if progress is not None:
                    progress.update(1)
                return
            taken: dict[str, Any] = scores if kind == 1 else jobs
            due = self.clock.select(taken, taken.keys()) or []
            for j in sorted((taken[k] for k in due), key=lambda j: (j.finishes_at, j.job_id)):
                if kind == 1:
                    self._scored(j)
                else:
                    self._arrive(j)

    def run(self) -> dict[str, Any]:
        """Start (or resume from ``checkpoint.pt``), train, close the backends; write ``policy.pt``
        and ``summary.json`` to the run folder and return the summary.

        A signal stops it (``step_loop``) with :class:`fedasync.interrupt.Interrupted`, which
        says where (``where``) and the checkpoint to resume from (``checkpoint``; None before
        there is one). One that comes once training is over is taken when the outputs are
        written: a checkpoint of the finished run is written, and resuming from it writes the
        outputs again."""
        from tqdm import tqdm

        from fedasync.progress import progress

        bar = None
        try:
            self._start()
            bar = progress(
                self.cfg.run.max_steps,
                f"rl {self.cfg.rollout.mode}",
                tty_bar=tqdm,
                initial=self.version,
                unit="step",
                disable=not self.cfg.run.progress,
            )
            self.phase = "training"
            self.step_loop(bar)
        except KeyboardInterrupt as e:
            with shielded():  # bounded (Ray's stop waits 10 s at most); not cut short
                close_all(self, bar, stopping=True)
            self.note_stop(e)
            raise
        except BaseException:
            close_all(self, bar, stopping=False)
            raise
        self.phase = "finishing"
        try:
            with DeferredStop(grace_s=0) as held:  # a signal now waits for the outputs
                close_all(self, bar, stopping=False)
                summary = self._outputs()
            if held.requested is not None:
                raise Interrupted(held.requested, at_safe_point=True)
        except KeyboardInterrupt as e:
            self.save_finished()
            self.note_stop(e)
            raise
        return summary

    def _outputs(self) -> dict[str, Any]:
        """Write the outputs; the summary (:func:`trainers.rl.run_end.write_outputs`)."""
        return write_outputs(self)

    def save_finished(self) -> Path:
        """A checkpoint of the finished run; its path (:func:`trainers.rl.run_end.save_finished`)."""
        return save_finished(self)

    def note_stop(self, e: BaseException) -> None:
        """Say on ``e`` where the run stopped (:func:`trainers.rl.run_end.note_stop`)."""
        note_stop(self, e)

    def summary(self) -> dict[str, Any]:
        """The run's numbers: versions, time (s, run clock), accuracies, drops, utilisation."""
        at = (self.clock.now, self.clock.kind, self.backend.kind, self.version)
        return self.stats.summary(self.cfg, *at, self.costs, self.scoring)

    # ----------------------------------------------------------------- checkpoints
    def _save(self) -> Path:
        """Write the run's checkpoint (:func:`trainers.rl.run_checkpoint.save_run`)."""
        return save_run(self)
