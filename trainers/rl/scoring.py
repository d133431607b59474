"""Teacher scoring for on-policy distillation: the stage between a group's arrival and the
learner. A group goes to one of ``distill.teachers`` scorers (virtual servers in this process,
or Ray actors), comes back with its finite teacher cache, and is checked before it may be
learnt; :func:`teacher_divergence` measures the student against the teacher at evaluations.

Paper: none beyond :mod:`trainers.rl.distill`'s. On the virtual clock scoring takes (the
group's prompt + completion tokens) x ``clock.teacher_token_s`` (x the times it was sent) on
the earliest-free server, in arrival order (:meth:`TeacherScoring.time`). A teacher that dies
(``faults.teacher_die_on_groups``, once per group) is restarted and the request sent again.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fedasync.clock import Clock
from fedasync.tensors import to_cpu
from trainers.rl.backend import ScoreJob, TeacherBackend
from trainers.rl.config import RLConfig
from trainers.rl.distill import check_cache, kl_divergence
from trainers.rl.rollout import Group
from trainers.rl.tasks import Task


def seq_tokens(group: Group) -> int:
    """Tokens the teacher reads to score ``group`` (prompt + completion of every sample)."""
    return sum(len(t.prompt) + len(t.tokens) for t in group.trajectories)


class TeacherScoring:
    """The groups at the teacher, by job id, and the scorers' queue (virtual clock).

    ``teacher`` / ``info`` are the teacher model and what :func:`trainers.rl.teacher
    .load_or_train_teacher` reported of it, once :meth:`start` has run; ``backend`` is where the
    groups are scored (given, or made by :meth:`start`)."""

    def __init__(
        self,
        cfg: RLConfig,
        task: Task,
        device: torch.device,
        backend: TeacherBackend | None = None,
    ):
        self.cfg, self.task, self.device = cfg, task, device
        self.enabled = cfg.distill.loss != "none"
        self.backend = backend
        self.teacher: torch.nn.Module | None = None
        self.info: dict[str, Any] = {}
        self.jobs: dict[int, ScoreJob] = {}
        self.next_id = 0
        self.free_at = [0.0] * cfg.distill.teachers
        self.die = set(cfg.faults.teacher_die_on_groups)
        self.died_on: set[int] = set()

    def start(self, rollout_kind: str) -> None:
        """Load (or train once and cache) the teacher and start its scorers: Ray actors beside
        Ray rollout workers (``rollout_kind``), else in this process. Nothing without
        distillation, or when started already."""
        if not self.enabled or self.teacher is not None:
            return
        from trainers.rl.teacher import load_or_train_teacher

        self.teacher, self.info = load_or_train_teacher(
            self.cfg, self.task, self.device, progress=self.cfg.run.progress
        )
        if self.backend is None:
            if rollout_kind == "ray":
                from trainers.rl.ray_teacher import RayTeacherPool

                self.backend = RayTeacherPool(
                    self.cfg, to_cpu(dict(self.teacher.state_dict())), self.device
                )
            else:
                from trainers.rl.local_backend import LocalTeacher

                self.backend = LocalTeacher(self.teacher, self.cfg.distill.top_k, self.device)

    def send(self, group: Group, at: float, attempts: int = 1) -> ScoreJob:
        """Send ``group`` (arrived at ``at``) to the teacher; the job, now pending."""
        assert self.backend is not None
        job = ScoreJob(self.next_id, group, at, attempts=attempts)
        self.next_id += 1
        self.jobs[job.job_id] = job
        die = group.group_id in self.die and group.group_id not in self.died_on
        if die:
            self.died_on.add(group.group_id)
        self.backend.submit(job, die)
        return job

    def collect(self, clock: Clock, wait_all: bool, token_s: float | None) -> None:
        """Ask the scorers for the pending jobs (``wait_all``: wait until every one is scored)
        and time the scored ones, in arrival order, on ``clock``: on the virtual clock each
        takes its tokens x ``token_s`` (x the times it was sent) on the earliest-free of the
        virtual servers; on the wall clock it ends now."""
        if not self.jobs:
            return
        assert self.backend is not None and token_s is not None
        self.backend.collect(list(self.jobs.values()), wait_all=wait_all, timeout=0.0)
        for job in sorted(self.jobs.values(), key=lambda j: j.job_id):
            if not job.done or job.finishes_at != math.inf:
                continue
            seconds = job.attempts * seq_tokens(job.group) * token_s
            job.scorer, job.finishes_at = clock.queue(self.free_at, job.dispatched_at, seconds)

    def take(self, job: ScoreJob) -> tuple[Group, list[str]]:
        """A job came back: the group with the samples whose cache can be learnt from, and why
        each other one was rejected."""
        del self.jobs[job.job_id]
        group, d = job.group, self.cfg.distill
        keep, rejected = [], []
        for i, t in enumerate(group.trajectories):
            why = check_cache(t, d.top_k, d.mc_samples)
            if why is None:
                keep.append(t)
            else:
                rejected.append(f"group {group.group_id} sample {i}: {why}")
        group.trajectories = keep
        return group, rejected

    def close(self) -> None:
        """Stop the scorers."""
        if self.backend is not None:
            self.backend.close()

    def counts(self) -> dict[str, int]:
        """Teachers restarted after dying and requests re-sent to them."""
        b = self.backend
        return {
            "teacher_restarts": b.restarts if b is not None else 0,
            "teacher_resent": b.resent if b is not None else 0,
        }

    def state_dict(self) -> dict[str, Any]:
        """The pending jobs (their groups and times) and the queue's state."""
        return {
            "jobs": [
                [j.job_id, j.dispatched_at, j.finishes_at, j.attempts, j.group.to_dict(), j.scorer]
                for j in sorted(self.jobs.values(), key=lambda j: j.job_id)
            ],
            "next_id": self.next_id,
            "free_at": list(self.free_at),
            "died_on": sorted(self.died_on),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore ``state_dict``'s state and send the pending jobs again, with their ids and
        times (they finish when they would have); the teacher must be started."""
        self.free_at = [float(x) for x in d["free_at"]]
        self.died_on = {int(x) for x in d["died_on"]}
        for job_id, at, finishes, attempts, g, scorer in d["jobs"]:
            self.next_id = int(job_id)
            sj = self.send(Group.from_dict(g), float(at), int(attempts))
            sj.finishes_at, sj.scorer = float(finishes), int(scorer)
        self.next_id = int(d["next_id"])


@torch.no_grad()
def teacher_divergence(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    task: Task,
    indices: list[int],
    seed: int,
    temperature: float,
    device: torch.device,
) -> dict[str, float | None]:
    """Per-token KL between student and teacher (whole vocabulary) on one student sample of
    each prompt ``task.sample(i, seed)``: ``teacher_rkl`` = KL(π‖p_T), ``teacher_fkl`` =
    KL(p_T‖π), means over the sampled tokens; ``teacher_recovery`` / ``teacher_on_path``: how
    often the teacher's argmax is the task's expert token after / up to a sample's first
    mistake (:func:`trainers.rl.teacher.agreement`; None without such positions)."""
    from trainers.rl.policy import generate, sequence_distributions
    from trainers.rl.rollout import sample_generator
    from trainers.rl.teacher import agreement, expert_targets

    prompts, comps, asked = [], [], []
    for i in indices:
        p = task.sample(i, seed)
        asked.append(p)
        s = generate(
            student,
            p.tokens,
            1,
            task.max_new_tokens,
            sample_generator(seed, i),
            temperature=temperature,
            device=device,
        )[0]
        prompts.append(p.tokens)
        comps.append(s.tokens)
    s_all, mask, _ = sequence_distributions(student, prompts, comps, temperature, device)
    t_all, _, _ = sequence_distributions(teacher, prompts, comps, 1.0, device)
    rkl, fkl = kl_divergence(s_all, t_all), kl_divergence(t_all, s_all)
    n = mask.sum().clamp(min=1)
    agree = agreement(t_all, mask, *expert_targets(task, asked, comps, t_all.device))
    return {
        "teacher_rkl": float((rkl * mask).sum() / n),
        "teacher_fkl": float((fkl * mask).sum() / n),
        "teacher_recovery": agree["recovery"],
        "teacher_on_path": agree["on_path"],
    }
