"""What the engine asks of where groups are generated and scored: the job records (``Job``,
``ScoreJob``), the ``Backend`` and ``TeacherBackend`` protocols, and ``build_policy`` /
``build_task``, the one place a policy and a task are made (the run, the local and Ray
workers).

Paper: none. The one-process backends are in :mod:`trainers.rl.local_backend`, the Ray ones in
:mod:`trainers.rl.ray_backend`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from trainers.rl.config import RLConfig
from trainers.rl.policy import PolicyConfig, TinyLM
from trainers.rl.rollout import Group
from trainers.rl.tasks import VOCAB_SIZE, Task, make_task


@dataclass
class Job:
    """One group in flight on one worker."""

    job_id: int
    group_id: int
    worker: int
    version: int
    attempt: int
    dispatched_at: float
    finishes_at: float = math.inf
    group: Group | None = None
    error: str | None = None
    """Set when the worker died on it (the group is then redone or dropped)."""


@dataclass
class ScoreJob:
    """One group's teacher scoring."""

    job_id: int
    group: Group
    dispatched_at: float
    """When the group was sent to the teacher (it arrived from its worker)."""
    finishes_at: float = math.inf
    attempts: int = 1
    """Times it was sent (a teacher that dies is restarted and its pending requests re-sent)."""
    scorer: int = -1
    """The virtual teacher server that scored it (virtual clock)."""
    done: bool = False


class Backend(Protocol):
    """Where groups are generated: in this process, or on Ray actors."""

    kind: str

    def publish(self, version: int, params: dict[str, torch.Tensor]) -> None:
        """Make ``version``'s weights available to workers."""

    def retire(self, below: int) -> None:
        """Versions below ``below`` will not be asked for again."""

    def submit(self, job: Job, die: bool, nan: bool) -> None:
        """Start ``job``; ``die``/``nan`` inject the configured faults."""

    def collect(self, jobs: list[Job], wait_all: bool, timeout: float) -> list[Job]:
        """Jobs of ``jobs`` whose result (``group`` or ``error``) has arrived; with
        ``wait_all`` block until every one has, else return what arrives within ``timeout``."""

    def close(self) -> None:
        """Stop the workers."""


class TeacherBackend(Protocol):
    """Where the teacher scores groups: in this process, or on Ray actors."""

    kind: str
    restarts: int
    """Teachers restarted after dying."""
    resent: int
    """Requests re-sent to a restarted teacher."""

    def submit(self, job: ScoreJob, die: bool) -> None:
        """Score ``job.group`` (fill its caches); ``die`` kills the teacher holding it first."""

    def collect(self, jobs: list[ScoreJob], wait_all: bool, timeout: float) -> list[ScoreJob]:
        """Jobs of ``jobs`` now ``done``; with ``wait_all`` block until every one is."""

    def close(self) -> None:
        """Stop the teachers."""


def build_policy(cfg: RLConfig) -> torch.nn.Module:
    """The policy of the run's seed, before the warm start: a TinyLM, or with policy.kind=hf
    a transformers causal LM behind the same interface (trainers.rl.hf). The one place a
    policy is made (the run, the local and Ray workers)."""
    p = cfg.policy
    torch.manual_seed(cfg.run.seed)
    if p.kind == "hf":
        from trainers.rl.hf import build_hf_policy

        return build_hf_policy(p, build_task(cfg))
    return TinyLM(
        PolicyConfig(
            vocab_size=VOCAB_SIZE, d_model=p.d_model, n_layers=p.n_layers, n_heads=p.n_heads
        )
    )


def build_task(cfg: RLConfig) -> Task:
    """The configured task (``task.name`` with its length bounds and tail)."""
    t = cfg.task
    return make_task(t.name, min_len=t.min_len, max_len=t.max_len, tail=t.tail)
