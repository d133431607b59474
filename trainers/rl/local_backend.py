"""The one-process backends: rollout workers (``LocalBackend``) and teacher scorers
(``LocalTeacher``) that do their work in this process when it is submitted.

Paper: none. Every worker and scorer is virtual: the engine's clock gives them their times.
The Ray backends beside them are in :mod:`trainers.rl.ray_backend`.
"""

from __future__ import annotations

import copy
import logging

import torch

from trainers.rl.backend import Job, ScoreJob, build_policy
from trainers.rl.config import RLConfig
from trainers.rl.distill import score_group
from trainers.rl.rollout import generate_group
from trainers.rl.tasks import Task

log = logging.getLogger("fedasync.rl")


class LocalBackend:
    """Every worker is virtual; a group is generated in this process when it is submitted."""

    kind = "local"

    def __init__(self, cfg: RLConfig, task: Task, device: torch.device):
        self.cfg, self.task, self.device = cfg, task, device
        self.model = build_policy(cfg).to(device)
        self.model.eval()
        self.loaded: int | None = None
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def publish(self, version: int, params: dict[str, torch.Tensor]) -> None:
        """Keep ``version``'s weights (not copied)."""
        self.weights[version] = params

    def retire(self, below: int) -> None:
        """Drop the weights of versions below ``below``."""
        for v in [v for v in self.weights if v < below]:
            del self.weights[v]

    def submit(self, job: Job, die: bool, nan: bool) -> None:
        """Generate the group now under ``job.version``; ``nan`` makes its first log-prob NaN,
        ``die`` sets ``job.error`` after the group is made (the time is spent, the tokens lost)."""
        if self.loaded != job.version:
            self.model.load_state_dict(self.weights[job.version])
            self.loaded = job.version
        group = generate_group(
            self.model,
            self.task,
            seed=self.cfg.run.seed,
            group_id=job.group_id,
            version=job.version,
            group_size=self.cfg.rollout.group_size,
            temperature=self.cfg.rollout.temperature,
            device=self.device,
            nan_first=nan,
            mc_samples=self.cfg.distill.mc_samples,
        )
        group.worker = job.worker
        job.group = group
        if die:  # it dies half-way: the time is spent, the tokens are lost
            job.error = f"worker {job.worker} died generating group {job.group_id}"

    def collect(self, jobs: list[Job], wait_all: bool, timeout: float) -> list[Job]:
        """The jobs with a group or an error: every submitted one (generated at submit)."""
        return [j for j in jobs if j.group is not None or j.error is not None]

    def close(self) -> None:
        """Nothing to stop."""
        return None


class LocalTeacher:
    """The teacher in this process: a group is scored when it is submitted."""

    kind = "local"

    def __init__(self, teacher: torch.nn.Module, top_k: int, device: torch.device):
        self.teacher, self.top_k, self.device = teacher, top_k, device
        self.state = copy.deepcopy(teacher.state_dict())
        self.restarts = 0
        self.resent = 0

    def submit(self, job: ScoreJob, die: bool) -> None:
        """Score the group now; ``die`` first restarts the teacher from its saved weights."""
        if die:  # the scorer dies holding the request: rebuilt, the request sent again
            log.warning(
                "teacher died scoring group %d: restarted, request re-sent", job.group.group_id
            )
            self.teacher.load_state_dict(self.state)
            self.restarts += 1
            self.resent += 1
            job.attempts += 1
        score_group(self.teacher, job.group, self.top_k, self.device)
        job.done = True

    def collect(self, jobs: list[ScoreJob], wait_all: bool, timeout: float) -> list[ScoreJob]:
        """The jobs already ``done``: every submitted one, as scoring happens at submit."""
        return [j for j in jobs if j.done]

    def close(self) -> None:
        """Nothing to stop."""
        return None
