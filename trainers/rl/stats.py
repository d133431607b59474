"""What an RL run measures, counts and reports: its evaluations (:func:`evaluate`), drops,
rejected samples, redone groups, the workers' busy time, the steps, the learner's tokens and
the warm start; their checkpoint, and the run's ``summary.json``.

Paper: none.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from trainers.rl.config import RLConfig
from trainers.rl.costs import Costs
from trainers.rl.policy import greedy_accuracy
from trainers.rl.rollout import EVAL_OFFSET
from trainers.rl.scoring import TeacherScoring, teacher_divergence
from trainers.rl.tasks import VOCAB_SIZE, Task


def evaluate(
    cfg: RLConfig,
    policy: torch.nn.Module,
    teacher: torch.nn.Module | None,
    task: Task,
    device: torch.device,
) -> dict[str, Any]:
    """Greedy accuracy on the ``run.eval_prompts`` held-out prompts, and with a ``teacher``
    the KLs to it and its agreement with the expert (:func:`trainers.rl.scoring
    .teacher_divergence`)."""
    idx = [EVAL_OFFSET + i for i in range(cfg.run.eval_prompts)]
    row: dict[str, Any] = {"accuracy": greedy_accuracy(policy, task, idx, cfg.run.seed, device)}
    if teacher is not None:
        t = cfg.rollout.temperature
        row |= teacher_divergence(policy, teacher, task, idx, cfg.run.seed, t, device)
    return row


@dataclass
class RunStats:
    """The run's counters and records (``busy_s``: seconds each worker spent on jobs)."""

    workers: int
    dropped: Counter[str] = field(default_factory=Counter)
    rejected: int = 0
    redone: int = 0
    busy_s: list[float] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    reached_target_at: float | None = None
    learner_tokens: int = 0
    warm: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Every worker starts idle."""
        if not self.busy_s:
            self.busy_s = [0.0] * self.workers

    def state_dict(self) -> dict[str, Any]:
        """Everything it holds (plain values)."""
        return {
            "dropped": dict(self.dropped),
            "rejected": self.rejected,
            "redone": self.redone,
            "busy_s": list(self.busy_s),
            "evals": self.evals,
            "steps": self.steps,
            "reached_target_at": self.reached_target_at,
            "learner_tokens": self.learner_tokens,
            "warm": self.warm,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore ``state_dict``'s values."""
        self.dropped = Counter(d["dropped"])
        self.rejected, self.redone = int(d["rejected"]), int(d["redone"])
        self.busy_s = [float(x) for x in d["busy_s"]]
        self.evals, self.steps = list(d["evals"]), list(d["steps"])
        self.reached_target_at = d["reached_target_at"]
        self.learner_tokens = int(d["learner_tokens"])
        self.warm = dict(d["warm"])

    def summary(
        self,
        cfg: RLConfig,
        now: float,
        clock: str,
        backend: str,
        versions: int,
        costs: Costs,
        scoring: TeacherScoring,
    ) -> dict[str, Any]:
        """The run's numbers (``summary.json``): versions, time (s, run clock, now ``now``),
        accuracies, drops, utilisation, costs, and the distillation's."""
        workers = cfg.rollout.workers
        util = sum(self.busy_s) / (workers * now) if now > 0 else None
        return {
            "mode": cfg.rollout.mode,
            "correction": cfg.learner.correction,
            "max_staleness": cfg.rollout.max_staleness,
            "workers": workers,
            "clock": clock,
            "backend": backend,
            "versions": versions,
            "time_s": now,
            "final_accuracy": self.evals[-1]["accuracy"] if self.evals else None,
            "initial_accuracy": self.evals[0]["accuracy"] if self.evals else None,
            "target_accuracy": cfg.run.target_accuracy,
            "time_to_target_s": self.reached_target_at,
            "evals": self.evals,
            "dropped": dict(self.dropped),
            "rejected_trajectories": self.rejected,
            "redone_groups": self.redone,
            "worker_utilisation": util,
            "gen_token_s": costs.gen_token_s,
            "learn_token_s": costs.learn_token_s,
            "warm_start": self.warm,
            "learner_tokens": self.learner_tokens,
            "distill": self._distill(cfg, costs, scoring),
        }

    def _distill(self, cfg: RLConfig, costs: Costs, scoring: TeacherScoring) -> dict | None:
        """The distillation's part of the summary (None without distillation)."""
        if not scoring.enabled:
            return None
        from trainers.rl.distill import cache_bytes_per_token

        d, last = cfg.distill, (self.evals[-1] if self.evals else {})
        return {
            "loss": d.loss,
            "top_k": d.top_k,
            "mc_samples": d.mc_samples,
            "teacher": scoring.info,
            "teacher_token_s": costs.teacher_token_s,
            "cache_bytes_per_token": cache_bytes_per_token(d.top_k, VOCAB_SIZE, d.mc_samples),
            "final_teacher_rkl": last.get("teacher_rkl"),
            "final_teacher_fkl": last.get("teacher_fkl"),
            **scoring.counts(),
        }
