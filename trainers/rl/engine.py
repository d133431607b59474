"""The asynchronous RL engine: who generates which group under which version, when the
learner steps, and what it may learn from.

Papers: AReaL (Fu et al. 2025) admission rule for bounded staleness; one-step-off (Noukhovitch
et al. 2024, asynchronous RLHF); multi-version streaming rollout after DORA (arXiv 2604.26256).

Groups are numbered 0, 1, 2, ...; group g is prompt ``task.sample(g, seed)``, its samples
drawn from a generator seeded by (seed, g), under the newest policy version a worker has when
it starts (the group is generated from start to end by that version). Batch k is groups
[kB, (k+1)B). The learner at version v makes version v+1 from one batch of B groups. Modes:

- ``sync``: batch v is generated under version v; the learner waits for all of it, workers
  wait for the learner.
- ``one_step_off``: batch k+1 is generated under version k while the learner trains on batch
  k (it starts when batch k is all generated); staleness 1.
- ``async``: group g of batch k may start once the learner's version is >= k − S; the learner
  takes batches in order, each once all of it has arrived. Staleness <= S by construction.
- ``streaming``: a group may start while fewer than (v + S + 1)·B groups have been admitted
  (dropped ones not counted); the learner takes the first B groups to finish, whatever their
  batch, so it never waits for a long tail. A group whose staleness would exceed S is dropped
  (aborted in flight at the version that makes it hopeless, freeing its worker).

With S = 0 the three rules admit the same groups under the same versions and the learner takes
the same batches, so ``async`` and ``streaming`` give the weights of ``sync`` bit for bit.

On-policy distillation (``distill.loss`` != none, :mod:`trainers.rl.distill`) adds one stage
between a group's arrival and the learner: the group goes to a teacher scorer (``distill
.teachers`` of them: virtual servers, or Ray actors) and becomes learnable when its finite
teacher cache comes back; on the virtual clock scoring takes (the group's prompt + completion
tokens) x ``clock.teacher_token_s`` on the earliest-free server, in arrival order. The
schedules above are unchanged (a batch is complete when all of it is scored), so S = 0 still
gives sync's weights bit for bit.

Time is the core's clock: on the virtual clock a group takes (its generated tokens) x
``clock.gen_token_s`` on a worker and a learner step (its batch's tokens) x
``clock.learn_token_s``; the new version is available when the step ends. On the wall clock
(Ray actors) both take what they take.

A signal (Ctrl-C, SIGTERM, SIGHUP) stops the run at the top of the loop's next pass, where
the scheduling state is whole, with a checkpoint of it (:meth:`RLRun.step_loop`); the
:class:`fedasync.interrupt.Interrupted` it raises says where and names the checkpoint.

One file (about 1200 lines) because the four schedules, the teacher stage, the two clocks, the
checkpoint and the stop all read and write one scheduling state on :class:`RLRun`, saved and
restored as a whole; split, each part would reach into that state from another module. The Ray
backends are apart (:mod:`trainers.rl.ray_backend`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from fedasync.checkpoint import load_checkpoint, save_checkpoint
from fedasync.clock import Clock, VirtualClock, WallClock
from fedasync.devices import pick_device
from fedasync.errors import CheckpointError
from fedasync.events import EventLog
from fedasync.interrupt import DeferredStop, Interrupted, shielded
from fedasync.staleness import StalenessBound
from fedasync.tensors import to_cpu
from fedasync.versions import VersionedSnapshots, staleness
from trainers.rl.backend import Backend, Job, ScoreJob, TeacherBackend, build_policy, build_task
from trainers.rl.config import RLConfig, to_container
from trainers.rl.costs import Costs, measure_costs
from trainers.rl.distill import DistillLearner
from trainers.rl.learner import Learner
from trainers.rl.local_backend import LocalBackend
from trainers.rl.policy import greedy_accuracy, warm_start
from trainers.rl.profiles import tail_factor
from trainers.rl.rollout import EVAL_OFFSET, Group, check_group
from trainers.rl.scoring import TeacherScoring, teacher_divergence
from trainers.rl.tasks import VOCAB_SIZE

log = logging.getLogger("fedasync.rl")

MAX_ATTEMPTS = 2
"""A group whose worker dies this many times is dropped."""

STOP_GRACE_S = 10.0
"""After a first SIGINT/SIGTERM/SIGHUP the loop stops (and saves) at the top of its next pass;
if no pass ends within this many seconds, the signal stops it where it is (no new checkpoint)."""


class RLRun:
    """One RL training run: ``RLRun(cfg, run_dir).run()`` returns the summary."""

    def __init__(
        self,
        cfg: RLConfig,
        run_dir: Path,
        backend: Backend | None = None,
        teacher_backend: TeacherBackend | None = None,
    ):
        self.cfg = cfg
        self.run_dir = run_dir
        self.device = pick_device(cfg.run.device)
        self.task = build_task(cfg)
        r = cfg.rollout
        self.S = r.max_staleness
        self.B = r.batch_groups
        self.bound = StalenessBound(max_staleness=self.S)
        self.policy = build_policy(cfg).to(self.device)
        self.distill = cfg.distill.loss != "none"
        self.learner = (
            DistillLearner(
                self.policy,
                cfg.learner,
                r.temperature,
                self.device,
                cfg.distill.loss,
                cfg.distill.mc_samples,
            )
            if self.distill
            else Learner(self.policy, cfg.learner, r.temperature, self.device)
        )
        self.scoring = TeacherScoring(cfg, self.task, self.device, teacher_backend)
        self.learner_tokens = 0
        self.snapshots = VersionedSnapshots(max(self.S, 1) + 2)
        self.backend: Backend = (
            backend if backend is not None else LocalBackend(cfg, self.task, self.device)
        )
        self.clock: Clock = (
            VirtualClock([1.0] * r.workers, 1.0, jitter=cfg.clock.jitter, seed=cfg.run.seed)
            if r.clock == "virtual"
            else WallClock()
        )
        self.costs = Costs.from_config(cfg)
        # scheduling state (all of it goes into the checkpoint)
        self.version = 0
        self.next_group = 0
        self.next_job = 0
        self.admitted_dropped = 0  # dropped groups (streaming's admission does not count them)
        self.inflight: dict[int, Job] = {}  # by worker
        self.redo: list[tuple[int, int]] = []  # (group id, attempt) to generate again
        self.ready: list[tuple[float, Group]] = []  # (finish time, group) not yet learnt
        self.finished_per_batch: Counter[int] = Counter()
        self.learner_done_at: float | None = None
        self.pending_metrics: dict[str, Any] | None = None
        self.dropped: Counter[str] = Counter()
        self.rejected = 0
        self.redone = 0
        self.busy_s = [0.0] * r.workers
        self.evals: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self.reached_target_at: float | None = None
        self.die = set(cfg.faults.die_on_groups)
        self.nan = set(cfg.faults.nan_on_groups)
        self.events: EventLog | None = None
        self.warm: dict[str, float] = {}
        self.phase = "start-up"
        """start-up, training, finishing or plots (the stop line says where it stopped)."""
        self.checkpoint: Path | None = None
        """The checkpoint a stop can resume from: the last one written or the one resumed."""
        self.checkpoint_version: int | None = None

    # ----------------------------------------------------------------- set-up
    def _start(self) -> None:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt = self.run_dir / "checkpoint.pt"
        if cfg.run.resume:
            if not ckpt.is_file():
                raise CheckpointError(f"run.resume=true but {ckpt} does not exist")
            self.checkpoint = ckpt  # a stop while it loads leaves it as it was
            self._load(ckpt)
            self.checkpoint_version = self.version
            return
        for name in ("metrics.jsonl", "summary.json", "checkpoint.pt"):
            (self.run_dir / name).unlink(missing_ok=True)
        self.events = EventLog(self.run_dir / "metrics.jsonl")
        if cfg.policy.warm_start_steps > 0:
            self.warm = warm_start(
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
            warm_start=self.warm,
            backend=self.backend.kind,
            clock=self.clock.kind,
        )
        self._publish(0)
        self._evaluate()

    # ----------------------------------------------------------------- scheduling
    def _batch(self, g: int) -> int:
        return g // self.B

    def _may_start(self, g: int) -> bool:
        mode, v, k = self.cfg.rollout.mode, self.version, self._batch(g)
        if mode == "sync":
            return k <= v
        if mode == "one_step_off":
            return k == 0 or (self.finished_per_batch[k - 1] >= self.B and v >= k - 1)
        if mode == "async":
            return k <= v + self.S
        return g - self.admitted_dropped < (v + self.S + 1) * self.B  # streaming

    def _dispatch(self) -> None:
        for w in range(self.cfg.rollout.workers):
            if w in self.inflight:
                continue
            if self.redo and self._may_start(self.redo[0][0]):
                g, attempt = self.redo.pop(0)
            elif not self.redo and self._may_start(self.next_group):
                g, attempt = self.next_group, 0
                self.next_group += 1
            else:
                return
            job = Job(self.next_job, g, w, self.version, attempt, self.clock.now)
            self.next_job += 1
            self.inflight[w] = job
            first = attempt == 0
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
        del self.inflight[job.worker]
        self.busy_s[job.worker] += self.clock.now - job.dispatched_at
        outcome = "done"
        if job.error is not None or job.group is None:
            outcome = "died"
            reason = (job.error or "no result")[:200]
            log.warning("%s", reason)
            if job.attempt + 1 >= MAX_ATTEMPTS:
                self._drop(job.group_id, "worker died twice")
            else:
                self.redone += 1
                self.redo.append((job.group_id, job.attempt + 1))
        else:
            group = check_group(job.group)
            for why in group.rejected:
                self.rejected += 1
                self._write("reject", version=self.version, group=job.group_id, reason=why)
            if len(group.trajectories) < 2:
                self._drop(job.group_id, "fewer than 2 valid trajectories")
            elif self.distill:
                self.scoring.send(group, self.clock.now)
            else:
                self._make_ready(group)
        self._rollout_event(job, job.group.tokens if job.group is not None else 0, outcome)

    def _make_ready(self, group: Group) -> None:
        self.ready.append((self.clock.now, group))
        self.finished_per_batch[self._batch(group.group_id)] += 1

    def _scored(self, job: ScoreJob) -> None:
        """A group came back from the teacher: check its caches, then it may be learnt."""
        group, rejected = self.scoring.take(job)
        for why in rejected:
            self.rejected += 1
            self._write("reject", version=self.version, group=group.group_id, reason=why)
        self._write(
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
            self._make_ready(group)

    def _rollout_event(self, job: Job, tokens: int, outcome: str) -> None:
        """One ``rollout`` event: the job's worker, version, start, finish (``t``) and outcome."""
        self._write(
            "rollout",
            version=self.version,
            group=job.group_id,
            worker=job.worker,
            behaviour=job.version,
            start=job.dispatched_at,
            tokens=tokens,
            outcome=outcome,
        )

    def _drop(self, group_id: int, reason: str) -> None:
        self.dropped[reason] += 1
        self.admitted_dropped += 1
        self.finished_per_batch[self._batch(group_id)] += 1  # settled: its batch goes on
        self._write("drop", version=self.version, group=group_id, reason=reason)

    def _take_batch(self) -> list[Group] | None:
        mode = self.cfg.rollout.mode
        if mode == "streaming":
            self.ready.sort(key=lambda x: (x[0], x[1].group_id))
            kept: list[tuple[float, Group]] = []
            for item in self.ready:
                d = self.bound.check(staleness(self.version, item[1].version))
                if d.action == "reject":
                    self._drop(item[1].group_id, f"stale: {d.reason}")
                else:
                    kept.append(item)
            self.ready = kept
            if len(kept) < self.B:
                return None
            batch, self.ready = kept[: self.B], kept[self.B :]
        else:  # batches in order: batch v, once all of it has arrived
            mine = [x for x in self.ready if self._batch(x[1].group_id) == self.version]
            if self.finished_per_batch[self.version] < self.B:  # arrived or dropped
                return None
            batch = mine
            self.ready = [x for x in self.ready if self._batch(x[1].group_id) != self.version]
        return sorted((g for _, g in batch), key=lambda g: g.group_id)

    def _maybe_learn(self) -> None:
        if self.learner_done_at is not None or self.version >= self.cfg.run.max_steps:
            return
        batch = self._take_batch()
        if batch is None:
            return
        for g in batch:
            tau = staleness(self.version, g.version)
            assert tau <= self.S or self.cfg.rollout.mode == "one_step_off", (tau, self.S)
        t0 = time.perf_counter()
        metrics = self.learner.step(batch, self.version)
        metrics["learn_s"] = time.perf_counter() - t0
        metrics["groups"] = [g.group_id for g in batch]
        self.learner_tokens += metrics["tokens"]
        metrics["learner_tokens"] = self.learner_tokens
        assert self.costs.learn_token_s is not None
        self.learner_done_at = self.clock.ends_at(
            self.clock.now, metrics["tokens"] * self.costs.learn_token_s
        )
        self.pending_metrics = metrics

    def _publish(self, version: int) -> None:
        params = to_cpu(dict(self.policy.state_dict()))
        self.snapshots.put(version, params)
        self.backend.publish(version, params)
        oldest = self.snapshots.oldest
        if oldest is not None:
            self.backend.retire(oldest)

    def _finish_step(self) -> None:
        assert self.pending_metrics is not None
        m = self.pending_metrics
        self.pending_metrics, self.learner_done_at = None, None
        self.version += 1
        self._publish(self.version)
        prev_t = self.steps[-1]["t"] if self.steps else 0.0
        dt = self.clock.now - prev_t
        m["tokens_per_s"] = m["tokens"] / dt if dt > 0 else None
        m["dropped_total"] = dict(self.dropped)
        m["t"] = self.clock.now
        m["version"] = self.version
        self.steps.append({k: m[k] for k in ("t", "version", "reward", "accuracy")})
        self._write(
            "step",
            version=self.version,
            **{k: v for k, v in m.items() if k not in ("t", "version")},
        )
        if self.cfg.rollout.mode == "streaming":  # abort what can no longer be learnt from
            for job in list(self.inflight.values()):
                if self.version - job.version > self.S:
                    self.busy_s[job.worker] += self.clock.now - job.dispatched_at
                    del self.inflight[job.worker]
                    self._drop(job.group_id, "stale in flight: aborted")
                    self._rollout_event(job, 0, "aborted")
        if self.version % self.cfg.run.eval_every == 0 or self.version >= self.cfg.run.max_steps:
            self._evaluate()
        every = self.cfg.run.checkpoint_every
        if every and self.version % every == 0 and self.version < self.cfg.run.max_steps:
            self._save(self.run_dir / "checkpoint.pt")

    def _evaluate(self) -> None:
        idx = [EVAL_OFFSET + i for i in range(self.cfg.run.eval_prompts)]
        acc = greedy_accuracy(self.policy, self.task, idx, self.cfg.run.seed, self.device)
        row: dict[str, Any] = {"t": self.clock.now, "version": self.version, "accuracy": acc}
        if self.distill:
            assert self.scoring.teacher is not None
            row |= teacher_divergence(
                self.policy,
                self.scoring.teacher,
                self.task,
                idx,
                self.cfg.run.seed,
                self.cfg.rollout.temperature,
                self.device,
            )
        row["learner_tokens"] = self.learner_tokens
        self.evals.append(row)
        self._write("eval", **{k: v for k, v in row.items() if k != "t"})
        target = self.cfg.run.target_accuracy
        if target is not None and acc >= target and self.reached_target_at is None:
            self.reached_target_at = self.clock.now

    def _write(self, event: str, **fields: Any) -> None:
        if self.events is not None:
            fields.setdefault("t", self.clock.now)
            self.events.write(event, **fields)

    def _done(self) -> bool:
        if self.version >= self.cfg.run.max_steps:
            return True
        return self.reached_target_at is not None

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
                self._save(self.run_dir / "checkpoint.pt")
            raise

    def _pass(self, progress: Any) -> None:
        """One pass of the loop (``step_loop``): learn, dispatch, collect what came back, then
        take what the clock says comes next: the learner's step, scored groups or rollouts."""
        self._maybe_learn()
        self._dispatch()
        if not self.inflight and self.learner_done_at is None and not self.scoring.jobs:
            raise RuntimeError(
                f"deadlock at version {self.version}: nothing in flight, nothing to "
                f"learn (ready {len(self.ready)}, redo {len(self.redo)})"
            )
        wait_all = not self.clock.realtime  # the virtual clock orders them by finish time
        asked = [j for j in self.inflight.values() if j.finishes_at == math.inf]
        if asked:
            wait = 0.05 if self.learner_done_at is None else 0.0
            for j in self.backend.collect(asked, wait_all=wait_all, timeout=wait):
                self._timed(j)
        self.scoring.collect(self.clock, wait_all, self.costs.teacher_token_s)
        jobs = {str(j.job_id): j for j in self.inflight.values() if j.finishes_at != math.inf}
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
                self._close(bar, stopping=True)
            self.note_stop(e)
            raise
        except BaseException:
            self._close(bar, stopping=False)
            raise
        self.phase = "finishing"
        try:
            with DeferredStop(grace_s=0) as held:  # a signal now waits for the outputs
                self._close(bar, stopping=False)
                summary = self._outputs()
            if held.requested is not None:
                raise Interrupted(held.requested, at_safe_point=True)
        except KeyboardInterrupt as e:
            self.save_finished()
            self.note_stop(e)
            raise
        return summary

    def _close(self, bar: Any, stopping: bool) -> None:
        """Close the progress bar and the backends; ``stopping``: an error in doing so (a Ray
        the signal reached) is logged, not raised."""
        for close in (
            bar.close if bar is not None else None,
            self.scoring.close,
            self.backend.close,
        ):
            if close is None:
                continue
            try:
                close()
            except Exception as e:
                if not stopping:
                    raise
                log.info("closing during the stop: %s: %s", type(e).__name__, str(e)[:200])

    def _outputs(self) -> dict[str, Any]:
        """``policy.pt``, the ``end`` event and ``summary.json``; the summary."""
        summary = self.summary()
        torch.save(to_cpu(dict(self.policy.state_dict())), self.run_dir / "policy.pt")
        if self.cfg.policy.kind == "hf":  # and <run>/hf_policy/, loadable with policy.hf_path
            from trainers.rl.hf import export_policy

            export_policy(self.policy, self.run_dir)
        self._write("end", version=self.version, **{k: summary[k] for k in ("final_accuracy",)})
        if self.events is not None:
            self.events.close()
            self.events = None
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def save_finished(self) -> Path:
        """A checkpoint of the finished run (a signal stopped it while it wrote its outputs or
        drew its plots): resuming from it writes them again. Its path."""
        path = self.run_dir / "checkpoint.pt"
        with shielded():
            if self.events is None:
                self.events = EventLog(self.run_dir / "metrics.jsonl")
            self._save(path)
            self.events.close()
            self.events = None
        return path

    def note_stop(self, e: BaseException) -> None:
        """Say on ``e`` (an Interrupted) where the run stopped and its checkpoint."""
        if not isinstance(e, Interrupted):
            return
        e.run_dir, e.checkpoint = self.run_dir, self.checkpoint
        if self.phase == "start-up":
            e.where = "during start-up"
        elif self.phase == "finishing":
            e.where = f"after training ({self.version} versions), writing its outputs"
        elif self.phase == "plots":
            e.where = f"after training ({self.version} versions), drawing its plots"
        else:
            e.where = f"at version {self.version} (t={self.clock.now:.1f} s {self.clock.kind})"
        if self.checkpoint is not None and self.checkpoint_version not in (None, self.version):
            e.where += f", the last checkpoint at version {self.checkpoint_version}"

    def summary(self) -> dict[str, Any]:
        """The run's numbers: versions, time (s, run clock), accuracies, drops, utilisation."""
        now = self.clock.now
        workers = self.cfg.rollout.workers
        util = sum(self.busy_s) / (workers * now) if now > 0 else None
        return {
            "mode": self.cfg.rollout.mode,
            "correction": self.cfg.learner.correction,
            "max_staleness": self.S,
            "workers": workers,
            "clock": self.clock.kind,
            "backend": self.backend.kind,
            "versions": self.version,
            "time_s": now,
            "final_accuracy": self.evals[-1]["accuracy"] if self.evals else None,
            "initial_accuracy": self.evals[0]["accuracy"] if self.evals else None,
            "target_accuracy": self.cfg.run.target_accuracy,
            "time_to_target_s": self.reached_target_at,
            "evals": self.evals,
            "dropped": dict(self.dropped),
            "rejected_trajectories": self.rejected,
            "redone_groups": self.redone,
            "worker_utilisation": util,
            "gen_token_s": self.costs.gen_token_s,
            "learn_token_s": self.costs.learn_token_s,
            "warm_start": self.warm,
            "learner_tokens": self.learner_tokens,
            "distill": self._distill_summary(),
        }

    def _distill_summary(self) -> dict[str, Any] | None:
        if not self.distill:
            return None
        from trainers.rl.distill import cache_bytes_per_token

        d, last = self.cfg.distill, (self.evals[-1] if self.evals else {})
        return {
            "loss": d.loss,
            "top_k": d.top_k,
            "mc_samples": d.mc_samples,
            "teacher": self.scoring.info,
            "teacher_token_s": self.costs.teacher_token_s,
            "cache_bytes_per_token": cache_bytes_per_token(d.top_k, VOCAB_SIZE, d.mc_samples),
            "final_teacher_rkl": last.get("teacher_rkl"),
            "final_teacher_fkl": last.get("teacher_fkl"),
            **self.scoring.counts(),
        }

    # ----------------------------------------------------------------- checkpoints
    def _save(self, path: Path) -> None:
        assert self.events is not None and self.learner_done_at is None
        state = {
            "config": to_container(self.cfg),
            "version": self.version,
            "learner": self.learner.state_dict(),
            "snapshots": self.snapshots.state_dict(),
            "clock": self.clock.state_dict(),
            "next_group": self.next_group,
            "next_job": self.next_job,
            "admitted_dropped": self.admitted_dropped,
            "inflight": [
                {k: v for k, v in asdict(j).items() if k not in ("group", "error", "finishes_at")}
                for j in self.inflight.values()
            ],
            "redo": [list(x) for x in self.redo],
            "ready": [[t, g.to_dict()] for t, g in self.ready],
            "scoring": self.scoring.state_dict(),
            "teacher_token_s": self.costs.teacher_token_s,
            "learner_tokens": self.learner_tokens,
            "finished_per_batch": {str(k): v for k, v in self.finished_per_batch.items()},
            "dropped": dict(self.dropped),
            "rejected": self.rejected,
            "redone": self.redone,
            "busy_s": list(self.busy_s),
            "evals": self.evals,
            "steps": self.steps,
            "reached_target_at": self.reached_target_at,
            "gen_token_s": self.costs.gen_token_s,
            "learn_token_s": self.costs.learn_token_s,
            "warm": self.warm,
            "events_offset": self.events.offset(),
        }
        save_checkpoint(path, state)
        self.checkpoint, self.checkpoint_version = path, self.version
        self._write("checkpoint", version=self.version, path=str(path))

    def _load(self, path: Path) -> None:
        s = load_checkpoint(path)
        if s["config"] != {**to_container(self.cfg), "run": s["config"]["run"]}:
            raise CheckpointError(
                f"{path} was written by a run with another configuration (only run.* may differ)"
            )
        self.version = int(s["version"])
        self.learner.load_state_dict(s["learner"])
        self.snapshots.load_state_dict(s["snapshots"])
        for v in self.snapshots.versions():
            snap = self.snapshots.get(v)
            assert snap is not None
            self.backend.publish(v, snap)
        self.clock.load_state_dict(s["clock"])
        self.next_group, self.next_job = int(s["next_group"]), int(s["next_job"])
        self.admitted_dropped = int(s["admitted_dropped"])
        self.redo = [(int(a), int(b)) for a, b in s["redo"]]
        self.ready = [(float(t), Group.from_dict(g)) for t, g in s["ready"]]
        self.finished_per_batch = Counter(
            {int(k): int(v) for k, v in s["finished_per_batch"].items()}
        )
        self.dropped = Counter(s["dropped"])
        self.rejected, self.redone = int(s["rejected"]), int(s["redone"])
        self.busy_s = [float(x) for x in s["busy_s"]]
        self.evals, self.steps = list(s["evals"]), list(s["steps"])
        self.reached_target_at = s["reached_target_at"]
        self.costs.load_state_dict(s)
        self.warm = dict(s["warm"])
        self.learner_tokens = int(s["learner_tokens"])
        self.events = EventLog(self.run_dir / "metrics.jsonl")
        self.events.truncate(int(s["events_offset"]))
        self._write("resume", version=self.version, path=str(path))
        if self.distill:
            self.scoring.start(self.backend.kind)
        self.scoring.load_state_dict(s["scoring"])  # the groups at it again, same times
        for j in s["inflight"]:  # the same groups again, under the same versions and times
            job = Job(**j)
            self.inflight[job.worker] = job
            first = job.attempt == 0
            self.backend.submit(
                job, die=first and job.group_id in self.die, nan=first and job.group_id in self.nan
            )
