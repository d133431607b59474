"""Typed configuration of an RL run (``fedasync rl``), validated once where the run starts.

defaults <- YAML file (``--config``) <- ``key=value`` overrides, on the same omegaconf
conventions as ``fedasync simulate``: unknown keys, wrong types and values out of range are
errors that name the key (``fedasync.errors.ConfigError``: one line, exit 2). Every key is
documented by the docstring under its field; docs/rl.md lists them all (a test checks).

Each section checks its own keys in ``__post_init__`` (ranges in RANGES, choices, keys within
it that must agree); RLConfig checks what spans sections. A config is never changed once built
(``dataclasses.replace`` derives another). Choices are ``Literal`` types (``learner.weight_fn``
is the core's fedasync.staleness.WeightFnName); omegaconf is shown each as a str carrying its
Literal, for the reasons in runkit.configload's docstring.

Every key is documented where it is declared (the docs and a test read it); the ranges and
the Hugging Face checks are in :mod:`trainers.rl.config_values`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fedasync.staleness import WEIGHT_FUNCTIONS, WeightFnName
from runkit import configload
from runkit.configload import check, check_ranges, choices, load_structured, recheck
from runkit.keys import TrainerKeys
from trainers.rl.config_values import RANGES, check_hf_config, check_hf_path

TaskName = Literal["sort", "reverse", "copy", "add"]
"""``task.name``: trainers.rl.tasks.TASKS (a test checks they are equal)."""
PolicyKind = Literal["tiny", "hf"]
"""``policy.kind``."""
RolloutMode = Literal["sync", "one_step_off", "async", "streaming"]
"""``rollout.mode``."""
Backend = Literal["local", "ray"]
"""``rollout.backend``."""
ClockKind = Literal["virtual", "wall"]
"""``rollout.clock``."""
Correction = Literal["none", "tis", "decoupled", "drop", "weight"]
"""``learner.correction``."""
DistillLoss = Literal["none", "forward_kl", "reverse_kl", "pg_kl", "pg_kl_online"]
"""``distill.loss``."""
ProfileName = Literal["local", "gen45", "gen70", "gen80", "gen80_tail"]
"""``clock.profile``: trainers.rl.profiles.PROFILES (a test checks they are equal)."""

TASK_NAMES: tuple[str, ...] = choices(TaskName)
POLICY_KINDS: tuple[str, ...] = choices(PolicyKind)
MODES: tuple[str, ...] = choices(RolloutMode)
CORRECTIONS: tuple[str, ...] = choices(Correction)
BACKENDS: tuple[str, ...] = choices(Backend)
PROFILE_NAMES: tuple[str, ...] = choices(ProfileName)
CLOCKS: tuple[str, ...] = choices(ClockKind)
DISTILL_LOSSES: tuple[str, ...] = choices(DistillLoss)

if not TYPE_CHECKING:  # what omegaconf sees: a str carrying its Literal (module docstring)
    TaskName, RolloutMode, Backend = (Annotated[str, t] for t in (TaskName, RolloutMode, Backend))
    ClockKind, Correction, DistillLoss, WeightFnName = (
        Annotated[str, t] for t in (ClockKind, Correction, DistillLoss, WeightFnName)
    )
    ProfileName = Annotated[str, ProfileName]
    PolicyKind = Annotated[str, PolicyKind]


@dataclass
class RunSection(TrainerKeys):
    """``run.*``: the common run keys (runkit.keys.TrainerKeys: ``run.seed`` seeds the policy's
    initialisation, the warm start, the prompts and every sample; ``run.resume`` keeps the
    staleness bound) and the run's length, evaluation and checkpoints."""

    name: str = "rl"
    """Run folder name under ``run.out_dir``."""
    max_steps: int = 40
    """Learner steps (policy versions) to train."""
    target_accuracy: float | None = None
    """Stop at the first evaluation whose held-out accuracy reaches this (None: never)."""
    eval_every: int = 5
    """Evaluate greedy exact-match accuracy on held-out prompts every this many steps."""
    eval_prompts: int = 64
    """Held-out prompts per evaluation (indices disjoint from training and warm start)."""
    checkpoint_every: int = 0
    """Write ``checkpoint.pt`` every this many learner steps (0: never)."""

    def __post_init__(self) -> None:
        """Checked when built: the common keys, then ranges."""
        super().__post_init__()
        check_ranges(self, "run.", RANGES)


@dataclass
class TaskSection:
    """``task.*``: the verifiable task the policy is trained on."""

    name: TaskName = "sort"
    """The task (trainers.rl.tasks.TASKS): sort, reverse, copy or add."""
    min_len: int = 2
    """Shortest problem (list length)."""
    max_len: int = 16
    """Longest problem; lengths between are drawn from a truncated Pareto (long-tailed)."""
    tail: float = 1.2
    """Tail exponent of the length distribution: smaller is heavier-tailed."""

    def __post_init__(self) -> None:
        """Checked when built: ranges, the task, and its lengths in order."""
        check_ranges(self, "task.", RANGES)
        check(
            self.name in TASK_NAMES,
            f"task.name must be one of {TASK_NAMES}, got {self.name!r:.40}",
        )
        check(
            self.min_len <= self.max_len,
            f"task.min_len={self.min_len} > task.max_len={self.max_len}",
        )


@dataclass
class PolicySection:
    """``policy.*``: the policy (TinyLM, or a Hugging Face causal LM) and its warm start."""

    kind: PolicyKind = "tiny"
    """tiny (our own small GPT, trainers.rl.policy) or hf (a transformers causal LM, built from
    hf_config or loaded from hf_path; needs ``pip install fedasync[hf]``; docs/rl.md)."""
    d_model: int = 64
    """Width of the decoder-only transformer (kind=tiny)."""
    n_layers: int = 2
    """Transformer blocks (kind=tiny)."""
    n_heads: int = 4
    """Attention heads (must divide d_model; kind=tiny)."""
    hf_config: dict[str, Any] | None = None
    """kind=hf: the fields of a transformers model config to build a fresh model from, e.g.
    {n_layer: 2, n_embd: 32, n_head: 2}; model_type names the architecture (default gpt2);
    vocab_size defaults to the task vocabulary's size, and may not be smaller."""
    hf_path: str | None = None
    """kind=hf: a local directory written by save_pretrained (e.g. a run's hf_policy/) to load
    instead, with local_files_only (nothing is downloaded)."""
    warm_start_steps: int = 150
    """Supervised steps before RL, so that RL starts from a working but imperfect policy."""
    warm_start_lr: float = 0.003
    """Learning rate of the warm start (Adam)."""
    warm_start_batch: int = 32
    """Prompts per warm-start step."""

    def __post_init__(self) -> None:
        """Checked when built: ranges, the kind, that the heads divide the width, and for
        kind=hf exactly one of hf_config and hf_path, its fields and its vocabulary's size."""
        check_ranges(self, "policy.", RANGES)
        check(
            self.kind in POLICY_KINDS,
            f"policy.kind must be one of {POLICY_KINDS}, got {self.kind!r:.40}",
        )
        check(
            self.d_model % self.n_heads == 0,
            f"policy.n_heads={self.n_heads} must divide policy.d_model={self.d_model}",
        )
        if self.kind != "hf":
            check(
                self.hf_config is None and self.hf_path is None,
                "policy.hf_config and policy.hf_path are for policy.kind=hf "
                f"(policy.kind={self.kind})",
            )
            return
        check(
            (self.hf_config is None) != (self.hf_path is None),
            "policy.kind=hf needs exactly one of policy.hf_config (build a model from a config) "
            "and policy.hf_path (load a saved one), got "
            + ("both" if self.hf_config is not None else "neither"),
        )
        if self.hf_config is not None:
            check_hf_config(self.hf_config)
        else:
            assert self.hf_path is not None
            check_hf_path(self.hf_path)


@dataclass
class RolloutSection:
    """``rollout.*``: the mode (sync, async, streaming), staleness and backend."""

    mode: RolloutMode = "streaming"
    """sync | one_step_off | async | streaming (docs/rl.md: how the modes schedule work)."""
    workers: int = 8
    """Rollout workers (Ray actors with backend=ray; virtual workers otherwise)."""
    group_size: int = 8
    """G: samples per prompt; GRPO's advantage is the reward against the group's mean and std."""
    batch_groups: int = 8
    """B: groups (prompts) per learner step."""
    max_staleness: int = 2
    """S: no trajectory more than S versions older than the learner is ever learnt from; async
    and streaming admit new work only within it (0 makes both equal to sync, bit for bit)."""
    temperature: float = 1.0
    """Sampling temperature (behaviour log-probs are of the tempered distribution)."""
    backend: Backend = "local"
    """local (one process, same semantics) or ray (one actor per worker, weights by version
    through the object store). Without Ray, ray falls back to local and says so."""
    clock: ClockKind = "virtual"
    """virtual (deterministic: generation and learning cost tokens x per-token cost) or wall."""

    def __post_init__(self) -> None:
        """Checked when built: ranges, the choices, and that a wall clock has Ray's actors."""
        check_ranges(self, "rollout.", RANGES)
        check(self.mode in MODES, f"rollout.mode must be one of {MODES}, got {self.mode!r:.40}")
        check(
            self.backend in BACKENDS,
            f"rollout.backend must be one of {BACKENDS}, got {self.backend!r:.40}",
        )
        check(
            self.clock in CLOCKS, f"rollout.clock must be one of {CLOCKS}, got {self.clock!r:.40}"
        )
        check(
            not (self.clock == "wall" and self.backend == "local"),
            "rollout.clock=wall needs rollout.backend=ray (one process has no concurrency to time)",
        )


@dataclass
class LearnerSection:
    """``learner.*``: the GRPO learner, its staleness correction and weights."""

    lr: float = 0.0003
    """Adam learning rate of the policy (1e-3 and above degraded held-out accuracy on sort)."""
    correction: Correction = "decoupled"
    """How stale tokens are corrected: none | tis | decoupled | drop | weight (docs/rl.md)."""
    clip_eps: float = 0.2
    """PPO clip range of the ratio against the proximal policy (decoupled)."""
    tis_cap: float = 2.0
    """C: cap of the truncated importance weight (tis, weight) and of decoupled PPO's
    behaviour weight."""
    drop_beyond: int = 0
    """correction=drop: trajectories staler than this are dropped, the rest learnt as fresh."""
    weight_fn: WeightFnName = "polynomial"
    """correction=weight: the core's staleness weight s(τ) (constant, polynomial, hinge,
    exponential), times the truncated importance weight."""
    weight_a: float = 0.5
    """Parameter a of the staleness weight."""
    weight_b: float = 4.0
    """Parameter b of the hinge staleness weight."""
    minibatches: int = 1
    """Optimiser steps per learner step (the batch split in this many parts); one version each
    learner step."""
    max_grad_norm: float = 1.0
    """Gradient clipping (global L2 norm)."""

    def __post_init__(self) -> None:
        """Checked when built: ranges, the correction and the weight function."""
        check_ranges(self, "learner.", RANGES)
        check(
            self.correction in CORRECTIONS,
            f"learner.correction must be one of {CORRECTIONS}, got {self.correction!r:.40}",
        )
        check(
            self.weight_fn in WEIGHT_FUNCTIONS,
            f"learner.weight_fn must be one of {tuple(WEIGHT_FUNCTIONS)}, "
            f"got {self.weight_fn!r:.40}",
        )


@dataclass
class DistillSection:
    """``distill.*``: on-policy distillation from a cached teacher."""

    loss: DistillLoss = "none"
    """none (GRPO on rewards; not ``off``, which YAML reads as false) or on-policy
    distillation from a teacher: forward_kl | reverse_kl
    (on the teacher's top-k plus tail bucket) | pg_kl (advantage log p_T − log μ, stale) |
    pg_kl_online (advantage recomputed under the current student at learner time)."""
    top_k: int = 8
    """k: teacher log-probs cached per token (0: the whole vocabulary); the rest of the
    teacher's mass is one tail bucket, so the cache is a proper distribution."""
    mc_samples: int = 1
    """N: tokens scored per position for pg_kl losses, the generated one plus N − 1 drawn from
    the behaviour student (multi-sample Monte Carlo)."""
    teachers: int = 1
    """Teacher scorers: Ray actors with rollout.backend=ray, virtual servers otherwise."""
    teacher_path: str | None = None
    """A teacher's weights (policy.pt of a run with the teacher_* shape); None: train one once
    and cache it (see cache_dir)."""
    cache_dir: str | None = None
    """Where trained teachers are cached; None: $FEDASYNC_DATA/teachers if set, else
    <run.out_dir>/teachers."""
    teacher_d_model: int = 128
    """Width of the teacher (a larger TinyLM than the student)."""
    teacher_n_layers: int = 3
    """Teacher blocks."""
    teacher_n_heads: int = 4
    """Teacher attention heads."""
    teacher_steps: int = 1500
    """Supervised training steps of the teacher on the task."""
    teacher_lr: float = 0.002
    """Adam learning rate of the teacher's training."""
    teacher_batch: int = 64
    """Prompts per teacher training step."""
    teacher_min_accuracy: float = 0.8
    """Held-out accuracy below which a freshly trained teacher is reported as weak (warning)."""
    teacher_seed: int = 0
    """Seeds the teacher's initialisation and training (not run.seed: one teacher serves
    every seed of a study)."""
    teacher_dagger_steps: int = 0
    """DAgger steps after the supervised ones (0: teacher forcing only): the teacher learns the
    task's expert next token on prefixes it and a weaker model sampled, mistakes included."""
    teacher_dagger_lr: float = 0.0005
    """Adam learning rate of the DAgger steps (lower than the supervised one: a fresh optimiser
    on a trained teacher; at 1e-3 its held-out accuracy fell before recovery rose)."""
    teacher_weak_steps: int = 100
    """The weaker model of the DAgger steps: the teacher's own weights after this many
    supervised steps."""
    teacher_weak_share: float = 0.5
    """Share of each DAgger batch sampled by the weaker model (the rest: the teacher)."""

    def __post_init__(self) -> None:
        """Checked when built: ranges, the loss, the teacher's heads, and that several Monte
        Carlo samples go with a sampled loss."""
        check_ranges(self, "distill.", RANGES)
        check(
            self.loss in DISTILL_LOSSES,
            f"distill.loss must be one of {DISTILL_LOSSES}, got {self.loss!r:.40}",
        )
        check(
            self.teacher_d_model % self.teacher_n_heads == 0,
            f"distill.teacher_n_heads={self.teacher_n_heads} must divide "
            f"distill.teacher_d_model={self.teacher_d_model}",
        )
        check(
            self.teacher_dagger_steps == 0 or self.teacher_weak_steps <= self.teacher_steps,
            f"distill.teacher_weak_steps={self.teacher_weak_steps} must be at most "
            f"distill.teacher_steps={self.teacher_steps} (the weaker model is the teacher's "
            f"own weights after that many supervised steps)",
        )
        check(
            self.mc_samples == 1 or self.loss in ("pg_kl", "pg_kl_online"),
            f"distill.mc_samples={self.mc_samples} needs a sampled loss (pg_kl or "
            f"pg_kl_online); {self.loss} sums over the teacher's top-k instead",
        )


@dataclass
class ClockSection:
    """``clock.*``: the virtual clock's costs per token and per step."""

    gen_token_s: float | None = None
    """Virtual seconds a worker takes per generated token (None: measured once at start)."""
    learn_token_s: float | None = None
    """Virtual seconds the learner takes per token of a batch (None: measured once at start)."""
    jitter: float = 0.0
    """Seeded jitter of each job's duration, in [0, 1)."""
    teacher_token_s: float | None = None
    """Virtual seconds a teacher scorer takes per token it scores (None: measured at start)."""
    profile: ProfileName = "local"
    """Cost profile (trainers.rl.profiles): local keeps the measured costs; gen45, gen70, gen80
    set the learner's (and teacher's) cost so generation is that share of a sync step;
    gen80_tail adds a long tail to each group's generation time (p99 8.1x the median)."""

    def __post_init__(self) -> None:
        """Checked when built: ranges, the profile, and that it is not given costs it sets."""
        check_ranges(self, "clock.", RANGES)
        check(
            self.profile in PROFILE_NAMES,
            f"clock.profile must be one of {PROFILE_NAMES}, got {self.profile!r:.40}",
        )
        check(
            self.profile == "local"
            or (self.learn_token_s is None and self.teacher_token_s is None),
            f"clock.profile={self.profile} sets clock.learn_token_s and clock.teacher_token_s "
            "from the generation cost: give one or the other",
        )


@dataclass
class FaultSection:
    """``fault.*``: a rollout worker killed at a step (fault tests)."""

    die_on_groups: list[int] = field(default_factory=list)
    """Group ids whose first attempt dies mid-trajectory (the worker is lost; with Ray the
    actor process really exits); the group is redone, or dropped when it would be too stale."""
    nan_on_groups: list[int] = field(default_factory=list)
    """Group ids whose first trajectory reports a NaN behaviour log-prob (rejected, counted)."""
    teacher_die_on_groups: list[int] = field(default_factory=list)
    """Group ids whose first teacher scoring kills the teacher (with Ray its actor process
    exits); the teacher is restarted and its pending requests re-sent, counted."""

    def __post_init__(self) -> None:
        """Checked when built: ranges."""
        check_ranges(self, "faults.", RANGES)


@dataclass
class RLConfig:
    """The whole ``fedasync rl`` config (one section per key prefix)."""

    run: RunSection = field(default_factory=RunSection)
    task: TaskSection = field(default_factory=TaskSection)
    policy: PolicySection = field(default_factory=PolicySection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    learner: LearnerSection = field(default_factory=LearnerSection)
    distill: DistillSection = field(default_factory=DistillSection)
    clock: ClockSection = field(default_factory=ClockSection)
    faults: FaultSection = field(default_factory=FaultSection)

    def __post_init__(self) -> None:
        """Checked when built (each section has checked itself): the keys of different
        sections that must agree."""
        r, lr = self.rollout, self.learner
        check(
            lr.minibatches <= r.batch_groups * r.group_size,
            f"learner.minibatches={lr.minibatches} exceeds the batch's "
            f"{r.batch_groups * r.group_size} trajectories",
        )
        check(
            self.clock.profile == "local" or r.clock == "virtual",
            f"clock.profile={self.clock.profile} sets virtual costs: it needs "
            "rollout.clock=virtual",
        )


def validate(cfg: RLConfig) -> RLConfig:
    """Check ``cfg`` again, every section then the whole, and return it; ConfigError naming
    the key. A config is checked when it is built, so this only repeats those checks."""
    return recheck(cfg)


def load_rl_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RLConfig:
    """The config, checked as it is built: defaults <- YAML ``path`` <- ``key=value``
    overrides."""
    return load_structured(RLConfig, path, overrides, "rollout.mode=streaming")


def to_container(cfg: RLConfig) -> dict[str, Any]:
    """The config as plain dicts (for metrics.jsonl and the checkpoint)."""
    return configload.to_container(cfg)
