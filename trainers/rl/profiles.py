"""Cost profiles of the virtual clock: where generation takes a given share of a sync step.

On this machine a learner step costs several times a batch's generation (the policy is tiny and
the learner runs on one core), so a synchronous RL step is about 20% generation and no schedule
can beat sync by more than ~1.25x. The systems asynchronous RL is built for are the other way
round: a data-parallel learner over many devices, a rollout fleet decoding long answers. A
profile (``clock.profile``) puts the virtual clock in such a regime by setting the learner's (and
the teacher's) cost per token relative to the generation cost, so that in a reference sync step
generation takes ``gen_fraction`` of the step. It changes costs only, never the learning rule:
under ``sync`` every profile gives the same weights (tests/test_rl_profiles.py), and the async
modes differ only in which trajectories arrive when.

Profiles (sources in docs/rl.md, "Cost profiles"):

- ``local``: the costs measured at start (or given), unchanged.
- ``gen45``: generation 45% of a sync step (verl's published 7B breakdowns: 30-50%).
- ``gen70``: 70% (verl's 32B DAPO breakdown).
- ``gen80``: 80% (DORA's upper figure: rollout is 50-80% of an RL step).
- ``gen80_tail``: 80% with a reasoning workload's long tail: each group's generation time is
  stretched by a seeded log-normal factor (median 1, σ = 0.9: p99 = 8.1x the median), keyed by
  (seed, group, attempt), so every mode sees the same group take the same time.

Calibration (:func:`calibrate`). The reference sync steps are the run's own first
:data:`SAMPLED_BATCHES` batches (group g is ``task.sample(g, seed)``) as the starting policy
samples them: exactly sync's first batches. Each group's generation time is its generated
tokens x the generation cost, stretched by its tail factor; a batch's generation time is its
makespan on the workers (list scheduling in group order, as the engine dispatches), its learner
tokens the groups' prompt + completion tokens. With ``M`` the mean makespan and ``Lt`` the mean
learner tokens (plus, for distillation, ``r`` x the mean scored tokens / teachers, the teacher
being a forward pass only: ``r`` = :data:`TEACHER_RATIO` of the learner's cost per token), the
learner's cost per token is ``(1 − f) / f · M / Lt``. Later steps differ as the policy's
answer lengths change; the benchmark prints the share a run realises. (Without samples,
:func:`reference` uses the reference answers' lengths.)

The limit (:meth:`Calibration.limit`). A schedule that overlaps generation with learning takes at least
max(learner step, generation work / workers, scoring work / teachers) per version, so its
speedup in seconds per version is at most (sync step) / that; with enough workers it is the
Amdahl bound 1 / (1 − f): 1.82x at 45%, 3.33x at 70%, 5x at 80%.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedasync import seeds
from trainers.rl.tasks import Task


@dataclass(frozen=True)
class CostProfile:
    """A named regime of the virtual clock."""

    name: str
    gen_fraction: float | None
    """Generation's share of a reference sync step; None keeps the measured costs."""
    tail_sigma: float
    """σ of the log-normal stretch of each group's generation time (0: none)."""
    source: str


PROFILES: dict[str, CostProfile] = {
    p.name: p
    for p in (
        CostProfile("local", None, 0.0, "the costs measured on this machine at start"),
        CostProfile("gen45", 0.45, 0.0, "verl 7B step breakdowns: generation 30-50% of a step"),
        CostProfile("gen70", 0.70, 0.0, "verl 32B DAPO step breakdown: generation ~70%"),
        CostProfile("gen80", 0.80, 0.0, "DORA: rollout is 50-80% of an RL step (upper figure)"),
        CostProfile(
            "gen80_tail",
            0.80,
            0.9,
            "DORA's 80% with reasoning-length tails: p99 of a group's generation 8.1x its median",
        ),
    )
}
"""Every profile by name (``clock.profile``)."""

TEACHER_RATIO = 0.5
"""A teacher's cost per scored token relative to the learner's per learnt token: a forward pass
(about a third of forward + backward) of a model about 1.5x the student's."""

CALIBRATION_BATCHES = 32
"""Reference sync steps the calibration averages over (from reference answers' lengths)."""
SAMPLED_BATCHES = 4
"""Reference sync steps the engine samples with the starting policy to calibrate on."""


def tail_factor(sigma: float, seed: int, group_id: int, attempt: int) -> float:
    """Group ``group_id``'s (attempt ``attempt``) generation-time stretch: log-normal, median 1.

    Deterministic in its arguments (the same in every mode and process); 1.0 when ``sigma`` = 0.
    """
    if sigma <= 0.0:
        return 1.0
    rng = seeds.rng(seed, "rl.slowdown", group_id, attempt)
    return float(math.exp(sigma * rng.standard_normal()))


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` derived, and the reference step it derived it from."""

    profile: str
    gen_fraction: float
    learn_token_s: float
    teacher_token_s: float | None
    makespan_s: float
    """Mean generation time of a reference sync batch (its longest worker)."""
    gen_work_s: float
    """Mean generation work of a reference batch (the sum over its groups)."""
    learn_tokens: float
    score_tokens: float

    def sync_step_s(self, teachers: int = 1) -> float:
        """The reference sync step: generation, then scoring (if any), then learning."""
        return self.makespan_s + self.learn_s + self.score_s(teachers)

    @property
    def learn_s(self) -> float:
        """The reference learner step."""
        return self.learn_tokens * self.learn_token_s

    def score_s(self, teachers: int = 1) -> float:
        """The reference batch's scoring, spread over ``teachers`` servers."""
        if self.teacher_token_s is None:
            return 0.0
        return self.score_tokens * self.teacher_token_s / teachers

    def limit(self, workers: int, teachers: int = 1) -> float:
        """The most an overlapping schedule can gain over sync in seconds per version."""
        floor = max(self.learn_s, self.gen_work_s / workers, self.score_s(teachers))
        return self.sync_step_s(teachers) / floor


def makespan(durations: Sequence[float], workers: int) -> float:
    """Finish time of ``durations`` taken in order by the first free of ``workers``."""
    free = [0.0] * min(workers, max(len(durations), 1))
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def reference(
    task: Task,
    *,
    seed: int,
    batch_groups: int,
    group_size: int,
    workers: int,
    gen_token_s: float,
    tail_sigma: float = 0.0,
    batches: int = CALIBRATION_BATCHES,
    tokens: Sequence[tuple[int, int]] | None = None,
) -> tuple[float, float, float, float]:
    """The mean reference sync batch: (makespan s, generation work s, learner tokens, scored
    tokens), over the run's own first batches of prompts.

    ``tokens[g]`` = (generated, prompt + generated) tokens of group ``g`` as the starting policy
    samples it (the engine passes its first batches); without it each group costs G x (its
    reference answer + EOS) generated tokens, ``batches`` batches of them.
    """
    if tokens is not None:
        batches = len(tokens) // batch_groups
        if batches < 1:
            raise ValueError(f"{len(tokens)} groups make no batch of {batch_groups}")
    spans, works, learn = [], [], []
    for k in range(batches):
        times, lt = [], 0
        for g in range(k * batch_groups, (k + 1) * batch_groups):
            if tokens is not None:
                gen, seq = tokens[g]
            else:
                prompt = task.sample(g, seed)
                answer = len(task.reference(prompt)) + 1  # + EOS
                gen, seq = group_size * answer, group_size * (len(prompt.tokens) + answer)
            times.append(gen * gen_token_s * tail_factor(tail_sigma, seed, g, 0))
            lt += seq
        spans.append(makespan(times, workers))
        works.append(sum(times))
        learn.append(lt)
    lt_mean = float(np.mean(learn))
    # the teacher reads prompt + completion, as the learner does
    return float(np.mean(spans)), float(np.mean(works)), lt_mean, lt_mean


def calibrate(
    name: str,
    task: Task,
    *,
    seed: int,
    batch_groups: int,
    group_size: int,
    workers: int,
    gen_token_s: float,
    distill: bool = False,
    teachers: int = 1,
    learn_token_s: float | None = None,
    teacher_token_s: float | None = None,
    batches: int = CALIBRATION_BATCHES,
    tokens: Sequence[tuple[int, int]] | None = None,
) -> Calibration:
    """The learner's (and teacher's) cost per token that give profile ``name``'s share.

    For ``local`` the given ``learn_token_s`` (and ``teacher_token_s``) are kept: the result
    then only describes the reference step and its limit under the measured costs.
    """
    p = PROFILES[name]
    m, work, lt_mean, st_mean = reference(
        task,
        seed=seed,
        batch_groups=batch_groups,
        group_size=group_size,
        workers=workers,
        gen_token_s=gen_token_s,
        tail_sigma=p.tail_sigma,
        batches=batches,
        tokens=tokens,
    )
    if p.gen_fraction is None:
        if learn_token_s is None:
            raise ValueError(f"profile {name!r} keeps the measured costs: give learn_token_s")
        t = teacher_token_s if distill else None
        step = m + lt_mean * learn_token_s + (st_mean * t / teachers if t else 0.0)
        f = m / step
    else:
        f = p.gen_fraction
        per_learn_token = lt_mean + (TEACHER_RATIO * st_mean / teachers if distill else 0.0)
        learn_token_s = (1.0 - f) / f * m / per_learn_token
        t = TEACHER_RATIO * learn_token_s if distill else None
    return Calibration(
        profile=name,
        gen_fraction=f,
        learn_token_s=learn_token_s,
        teacher_token_s=t,
        makespan_s=m,
        gen_work_s=work,
        learn_tokens=lt_mean,
        score_tokens=st_mean,
    )
