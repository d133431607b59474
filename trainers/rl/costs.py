"""The run's costs per token on the virtual clock: generation, learning and teacher scoring,
given (``clock.*``), measured once at start, or set by a cost profile (``clock.profile``,
:mod:`trainers.rl.profiles`) from the generation cost.

Paper: none. ``measure_costs`` times four groups' generation, their scoring and one learner
step on copies of the starting policy (the run's own state is untouched); the profile's
calibration samples sync's first batches as the starting policy draws them.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from trainers.rl.config import RLConfig
from trainers.rl.distill import DistillLearner, score_group
from trainers.rl.learner import Learner
from trainers.rl.profiles import PROFILES, SAMPLED_BATCHES, calibrate
from trainers.rl.rollout import generate_group
from trainers.rl.scoring import seq_tokens
from trainers.rl.tasks import Task

log = logging.getLogger("fedasync.rl")


@dataclass
class Costs:
    """Seconds per token of generation, learning and teacher scoring (None: not known yet),
    and what the cost profile recorded (``profile``: the ``start`` event's)."""

    gen_token_s: float | None
    learn_token_s: float | None
    teacher_token_s: float | None
    profile: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: RLConfig) -> Costs:
        """The costs ``clock.*`` gives (None where they are to be measured)."""
        c = cfg.clock
        return cls(c.gen_token_s, c.learn_token_s, c.teacher_token_s, {"name": c.profile})

    @property
    def tail_sigma(self) -> float:
        """The profile's long tail of generation times (0: none)."""
        return PROFILES[self.profile["name"]].tail_sigma

    def state_dict(self) -> dict[str, Any]:
        """The three costs (the profile is the config's)."""
        return {
            "gen_token_s": self.gen_token_s,
            "learn_token_s": self.learn_token_s,
            "teacher_token_s": self.teacher_token_s,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore ``state_dict``'s costs."""
        self.gen_token_s, self.learn_token_s = d["gen_token_s"], d["learn_token_s"]
        self.teacher_token_s = d["teacher_token_s"]


def measure_costs(
    costs: Costs,
    cfg: RLConfig,
    policy: torch.nn.Module,
    task: Task,
    device: torch.device,
    teacher: torch.nn.Module | None,
    sample_reference: bool,
) -> None:
    """Fill in ``costs`` (per-token costs of generation, teacher scoring and learning) by
    measuring once what is not given, then apply the profile; ``sample_reference``: record
    the reference sync step from sampled batches (the virtual clock's)."""
    distill = cfg.distill.loss != "none"
    need_teacher = distill and costs.teacher_token_s is None
    if costs.gen_token_s is not None and costs.learn_token_s is not None and not need_teacher:
        _apply_profile(
            costs, cfg, policy, task, device, sample_reference
        )  # local: records the reference step and its limit
        return
    if costs.gen_token_s is not None and cfg.clock.profile != "local":
        _apply_profile(
            costs, cfg, policy, task, device, sample_reference
        )  # the profile sets the rest from the given generation cost
        return
    probe = copy.deepcopy(policy)
    probe.eval()
    groups, t0 = [], time.perf_counter()
    for i in range(4):
        groups.append(
            generate_group(
                probe,
                task,
                seed=cfg.run.seed + 1,
                group_id=i,
                version=0,
                group_size=cfg.rollout.group_size,
                temperature=cfg.rollout.temperature,
                device=device,
                mc_samples=cfg.distill.mc_samples,
            )
        )
    gen = (time.perf_counter() - t0) / max(sum(g.tokens for g in groups), 1)
    if distill:
        assert teacher is not None
        t0 = time.perf_counter()
        for g in groups:
            score_group(teacher, g, cfg.distill.top_k, device)
        scored = time.perf_counter() - t0
        if costs.teacher_token_s is None:
            costs.teacher_token_s = scored / max(sum(seq_tokens(g) for g in groups), 1)
        learner: Learner = DistillLearner(
            probe,
            cfg.learner,
            cfg.rollout.temperature,
            device,
            cfg.distill.loss,
            cfg.distill.mc_samples,
        )
    else:
        learner = Learner(probe, cfg.learner, cfg.rollout.temperature, device)
    t0 = time.perf_counter()
    m = learner.step(groups, 0)
    learn = (time.perf_counter() - t0) / max(m["tokens"], 1)
    if costs.gen_token_s is None:
        costs.gen_token_s = gen
    if costs.learn_token_s is None:
        costs.learn_token_s = learn
    log.info(
        "measured: %.3g s per generated token, %.3g s per learnt token, %s s per scored token",
        gen,
        learn,
        f"{costs.teacher_token_s:.3g}" if distill else "-",
    )
    _apply_profile(costs, cfg, policy, task, device, sample_reference)


def _reference_tokens(
    cfg: RLConfig, policy: torch.nn.Module, task: Task, device: torch.device
) -> list[tuple[int, int]]:
    """(generated, prompt + generated) tokens of sync's first batches, as the starting
    policy samples them (the groups are pure functions of weights, seed and group id)."""
    probe = copy.deepcopy(policy)
    probe.eval()
    r = cfg.rollout
    out = []
    for g in range(SAMPLED_BATCHES * r.batch_groups):
        group = generate_group(
            probe,
            task,
            seed=cfg.run.seed,
            group_id=g,
            version=0,
            group_size=r.group_size,
            temperature=r.temperature,
            device=device,
        )
        out.append((group.tokens, seq_tokens(group)))
    return out


def _apply_profile(
    costs: Costs,
    cfg: RLConfig,
    policy: torch.nn.Module,
    task: Task,
    device: torch.device,
    sample_reference: bool,
) -> None:
    """Record the reference sync step and the limit an overlapping schedule can reach
    (``start`` event); a ``clock.profile`` other than local first sets the learner's and
    teacher's costs from the generation cost, so generation is its share of a sync step."""
    distill = cfg.distill.loss != "none"
    name = cfg.clock.profile
    assert costs.gen_token_s is not None
    r, d = cfg.rollout, cfg.distill
    cal = calibrate(
        name,
        task,
        seed=cfg.run.seed,
        batch_groups=r.batch_groups,
        group_size=r.group_size,
        workers=r.workers,
        gen_token_s=costs.gen_token_s,
        distill=distill,
        teachers=d.teachers,
        learn_token_s=costs.learn_token_s,
        teacher_token_s=costs.teacher_token_s,
        tokens=_reference_tokens(cfg, policy, task, device) if sample_reference else None,
    )
    costs.learn_token_s, costs.teacher_token_s = cal.learn_token_s, cal.teacher_token_s
    costs.profile = {
        "name": name,
        "gen_fraction": cal.gen_fraction,
        "tail_sigma": PROFILES[name].tail_sigma,
        "reference_sync_step_s": cal.sync_step_s(d.teachers),
        "reference_makespan_s": cal.makespan_s,
        "reference_learn_s": cal.learn_s,
        "limit": cal.limit(r.workers, d.teachers),
    }
    if name == "local":
        return
    log.info(
        "clock.profile=%s: learner %.3g s per token%s, so generation is %.0f%% of a "
        "reference sync step (%.3g s); an overlapping schedule gains at most %.2fx",
        name,
        cal.learn_token_s,
        f", teacher {cal.teacher_token_s:.3g} s per token" if distill else "",
        100 * cal.gen_fraction,
        cal.sync_step_s(d.teachers),
        cal.limit(r.workers, d.teachers),
    )
