"""Typed configuration of a pipeline-parallel run (``fedasync pipeline``), validated once where
the run starts.

defaults <- YAML file (``--config``) <- ``key=value`` overrides, loaded by
:func:`runkit.configload.load_structured` on the same omegaconf conventions as ``fedasync
simulate`` and ``fedasync rl``: unknown keys, wrong types and values out of range are errors
that name the key as ``section.key`` (``fedasync.errors.ConfigError``: one line, exit 2). Every
key is documented by the docstring under its field (a test checks). String choices avoid
``on``/``off``/``yes``/``no``, which YAML reads as booleans.

Each section checks its own keys in ``__post_init__`` (ranges in RANGES, choices, keys within
it that must agree, such as PACI's drift bound); PipelineConfig checks what spans sections. A
config is never changed once built (``dataclasses.replace`` derives another). Choices are
``Literal`` types; omegaconf is shown each as a str carrying its Literal, for the reasons in
runkit.configload's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fedasync.ranges import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Range
from runkit import configload
from runkit.configload import check, check_ranges, choices, load_structured, recheck
from runkit.keys import DEVICES as DEVICES  # re-exported: the choices of run.device
from runkit.keys import TrainerKeys
from trainers.pipeline.schedule import SCHEDULES, SYNCHRONOUS, max_drift, micro_for_drift

Schedule = Literal["gpipe", "1f1b", "2bw", "paci"]
"""``pipeline.schedule``: trainers.pipeline.schedule.SCHEDULES (checked equal at import)."""
Backend = Literal["emulate", "processes"]
"""``pipeline.backend``."""
Comm = Literal["auto", "gloo", "nccl"]
"""``pipeline.comm``."""
OptimizerName = Literal["adamw", "muon"]
"""``optim.name``: trainers.pipeline.optim.OPTIMIZERS (a test checks they are equal)."""
MuonDtype = Literal["auto", "float32", "bfloat16"]
"""``optim.muon_dtype``: trainers.pipeline.optim.MUON_DTYPES (a test checks they are equal)."""

BACKENDS: tuple[str, ...] = choices(Backend)
COMMS: tuple[str, ...] = choices(Comm)
OPTIMIZERS: tuple[str, ...] = choices(OptimizerName)
MUON_DTYPES: tuple[str, ...] = choices(MuonDtype)

if choices(Schedule) != tuple(SCHEDULES):  # not an assert: kept under python -O
    raise AssertionError(f"Schedule {choices(Schedule)} != SCHEDULES {SCHEDULES}")

if not TYPE_CHECKING:  # what omegaconf sees: a str carrying its Literal (module docstring)
    Schedule, Backend, Comm, OptimizerName, MuonDtype = (
        Annotated[str, t] for t in (Schedule, Backend, Comm, OptimizerName, MuonDtype)
    )


@dataclass
class RunSection(TrainerKeys):
    """``run.*``: the common run keys (runkit.keys.TrainerKeys: ``run.seed`` seeds the model's
    initialisation, the same weights however the model is cut into stages) and the run's
    length, evaluation, checkpoints and threads."""

    name: str = "pipeline"
    """Run folder name under ``run.out_dir``."""
    steps: int = 200
    """Optimiser steps to train; one batch (``data.batch`` sequences) per step."""
    eval_every: int = 25
    """Evaluate the held-out loss every this many steps."""
    eval_batches: int = 8
    """Held-out batches per evaluation (drawn from the validation stream)."""
    checkpoint_every: int = 50
    """Write a checkpoint every this many steps (0: never)."""
    threads: int = 1
    """Torch threads per process (per stage process with ``pipeline.backend=processes``)."""

    def __post_init__(self) -> None:
        """Checked when built: the common keys, then ranges."""
        super().__post_init__()
        check_ranges(self, "run.", RANGES)


@dataclass
class ModelSection:
    """``model.*``: the GPT that is cut into stages."""

    d_model: int = 128
    """Width of the decoder-only transformer."""
    n_layers: int = 4
    """Transformer blocks, shared out among the stages as evenly as they go."""
    n_heads: int = 4
    """Attention heads (must divide ``model.d_model``)."""
    context: int = 128
    """Ids per training window (the model's longest input)."""

    def __post_init__(self) -> None:
        """Checked when built: ranges, and that the heads divide the width."""
        check_ranges(self, "model.", RANGES)
        check(
            self.d_model % self.n_heads == 0,
            f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}",
        )


@dataclass
class DataSection:
    """``data.*``: the corpus (or synthetic tokens) and the batch shape."""

    batch: int = 16
    """Sequences per batch (one optimiser step), split into ``pipeline.micro`` micro-batches;
    must be divisible by ``pipeline.micro``."""
    val_fraction: float = 0.1
    """Share of every play held out for evaluation, in (0, 0.5]."""
    seed: int = 0
    """Seeds the sampling of training and held-out windows (apart from ``run.seed``)."""

    def __post_init__(self) -> None:
        """Checked when built: ranges."""
        check_ranges(self, "data.", RANGES)


@dataclass
class PipelineSection:
    """``pipeline.*``: the schedule, stages, micro-batches and transport."""

    schedule: Schedule = "paci"
    """gpipe | 1f1b (flushed every batch: synchronous) | 2bw (PipeDream-2BW: computes under
    weights ``pipeline.delay`` steps old) | paci (no flush, the forward/backward drift bounded
    by ``pipeline.max_drift``)."""
    stages: int = 2
    """Pipeline stages P (1 <= P <= ``model.n_layers``)."""
    micro: int = 4
    """Micro-batches per batch m (PACI's local accumulation: more slows the version clock)."""
    delay: int = 1
    """2bw only: the version delay of the weights a batch is computed under (0 or 1)."""
    max_drift: int = 1
    """paci: the staleness bound, the most optimiser steps a stage may take between a
    micro-batch's forward and its backward (>= 1); needs ceil((P - 1) / m) <= it."""
    backend: Backend = "processes"
    """emulate (one process runs the schedule, stage by stage) or processes (one
    torch.distributed process per stage)."""
    comm: Comm = "auto"
    """torch.distributed backend of ``processes``: auto (nccl on CUDA, gloo otherwise), gloo
    or nccl."""

    def __post_init__(self) -> None:
        """Checked when built: ranges, the choices, and PACI's drift bound."""
        check_ranges(self, "pipeline.", RANGES)
        check(
            self.schedule in SCHEDULES,
            f"pipeline.schedule must be one of {SCHEDULES}, got {self.schedule!r:.40}",
        )
        check(
            self.backend in BACKENDS,
            f"pipeline.backend must be one of {BACKENDS}, got {self.backend!r:.40}",
        )
        check(self.comm in COMMS, f"pipeline.comm must be one of {COMMS}, got {self.comm!r:.40}")
        if self.schedule == "paci":
            drift = max_drift(self.schedule, self.stages, self.micro)
            check(
                drift <= self.max_drift,
                f"pipeline.micro={self.micro} lets {self.stages} stages drift up to {drift} "
                f"optimiser steps between a micro-batch's forward and backward, over "
                f"pipeline.max_drift={self.max_drift}: the smallest pipeline.micro that keeps "
                f"it is {micro_for_drift(self.stages, self.max_drift)} (or raise "
                "pipeline.max_drift)",
            )


@dataclass
class OptimSection:
    """``optim.*``: the optimiser (AdamW or Muon), its learning rate, warm-up and Muon's
    orthogonalisation dtype."""

    name: OptimizerName = "adamw"
    """adamw, or muon (Muon on the blocks' matrices, AdamW for embeddings, head and vectors,
    with an RMS-matched learning rate)."""
    lr: float = 0.003
    """Learning rate (> 0)."""
    momentum: float = 0.95
    """Muon's momentum, in [0, 1) (unused by adamw)."""
    muon_dtype: MuonDtype = "auto"
    """The dtype Muon's Newton-Schulz orthogonalisation runs in: auto (float32 on the CPU,
    bfloat16 on CUDA), float32 or bfloat16 (what ``torch.optim.Muon`` always uses; slow on a CPU
    without bfloat16 matrix instructions). Unused by adamw."""
    weight_decay: float = 0.0
    """Decoupled weight decay (>= 0)."""
    warmup: int = 50
    """Steps of linear learning-rate warm-up from 0 (0: none). Without it AdamW at lr 3e-3 sits on
    the unigram plateau (loss 3.3) for a seed-dependent 50-250 steps."""

    def __post_init__(self) -> None:
        """Checked when built: ranges and the optimiser's name."""
        check_ranges(self, "optim.", RANGES)
        check(
            self.name in OPTIMIZERS,
            f"optim.name must be one of {OPTIMIZERS}, got {self.name!r:.40}",
        )
        check(
            self.muon_dtype in MUON_DTYPES,
            f"optim.muon_dtype must be one of {MUON_DTYPES}, got {self.muon_dtype!r:.40}",
        )


@dataclass
class CorrectionSection:
    """``correction.*``: the delay error feedback."""

    error_feedback: bool = False
    """Correct the delayed gradient with error feedback (2bw and paci only: a synchronous
    schedule has no delay to correct)."""
    beta: float = 1.0
    """Coefficient of the error-feedback correction, in [0, 2]."""

    def __post_init__(self) -> None:
        """Checked when built: ranges (the schedule it needs, PipelineConfig)."""
        check_ranges(self, "correction.", RANGES)


@dataclass
class FaultSection:
    """``fault.*``: a stage process killed at a step (fault tests)."""

    kill_stage: int = -1
    """A stage process to kill mid-run (-1: none; needs ``pipeline.backend=processes`` and a
    stage < ``pipeline.stages``)."""
    kill_at_step: int = 0
    """``faults.kill_stage`` is killed (SIGKILL) right after its optimiser step of this step,
    before it saves anything for it (< ``run.steps``)."""

    def __post_init__(self) -> None:
        """Checked when built: ranges (the stage and step it needs, PipelineConfig)."""
        check_ranges(self, "faults.", RANGES)


@dataclass
class PipelineConfig:
    """The whole ``fedasync pipeline`` config (one section per key prefix)."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    optim: OptimSection = field(default_factory=OptimSection)
    correction: CorrectionSection = field(default_factory=CorrectionSection)
    faults: FaultSection = field(default_factory=FaultSection)

    def __post_init__(self) -> None:
        """Checked when built (each section has checked itself): the keys of different
        sections that must agree."""
        run, m, d, p = self.run, self.model, self.data, self.pipeline
        check(
            not (p.comm == "nccl" and run.device == "cpu"),
            "pipeline.comm=nccl needs CUDA, but run.device=cpu (use pipeline.comm=gloo or auto)",
        )
        check(
            p.stages <= m.n_layers,
            f"pipeline.stages={p.stages} exceeds model.n_layers={m.n_layers} (a stage needs a "
            "block)",
        )
        check(
            d.batch % p.micro == 0,
            f"data.batch={d.batch} must be divisible by pipeline.micro={p.micro} (equal "
            "micro-batches)",
        )
        check(
            not (self.correction.error_feedback and p.schedule in SYNCHRONOUS),
            f"correction.error_feedback=true needs a delayed schedule (2bw or paci): "
            f"pipeline.schedule={p.schedule} flushes every batch, so there is no delay to correct",
        )
        f = self.faults
        if f.kill_stage >= 0:
            check(
                f.kill_stage < p.stages,
                f"faults.kill_stage={f.kill_stage} must be < pipeline.stages={p.stages} (or -1)",
            )
            check(
                p.backend == "processes",
                f"faults.kill_stage={f.kill_stage} needs pipeline.backend=processes "
                "(the emulator has no stage process to kill)",
            )
            check(
                f.kill_at_step < run.steps,
                f"faults.kill_at_step={f.kill_at_step} must be < run.steps={run.steps} "
                "(else the stage never dies)",
            )


RANGES: dict[str, Range] = {
    "run.seed": NON_NEGATIVE,
    "run.steps": AT_LEAST_ONE,
    "run.eval_every": AT_LEAST_ONE,
    "run.eval_batches": Range(1, 10_000),
    "run.checkpoint_every": NON_NEGATIVE,
    "run.threads": Range(1, 1024),
    "model.d_model": Range(8, 65_536),
    "model.n_layers": Range(1, 1024),
    "model.n_heads": Range(1, 1024),
    "model.context": AT_LEAST_ONE,
    "data.batch": AT_LEAST_ONE,
    "data.val_fraction": Range(0, 0.5, lo_open=True),
    "data.seed": NON_NEGATIVE,
    "pipeline.stages": Range(1, 1024),
    "pipeline.micro": AT_LEAST_ONE,
    "pipeline.delay": Range(0, 1),
    "pipeline.max_drift": AT_LEAST_ONE,
    "optim.lr": POSITIVE,
    "optim.momentum": Range(0, 1, hi_open=True),
    "optim.weight_decay": NON_NEGATIVE,
    "optim.warmup": NON_NEGATIVE,
    "correction.beta": Range(0, 2),
    "faults.kill_stage": Range(-1),
    "faults.kill_at_step": NON_NEGATIVE,
}
"""Every numeric key's allowed values (a test checks that none is left out)."""


def validate(cfg: PipelineConfig) -> PipelineConfig:
    """Check ``cfg`` again, every section then the whole, and return it; ConfigError naming
    the key. A config is checked when it is built, so this only repeats those checks."""
    return recheck(cfg)


def load_pipeline_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> PipelineConfig:
    """The config, checked as it is built: defaults <- YAML ``path`` <- ``key=value``
    overrides."""
    return load_structured(PipelineConfig, path, overrides, "pipeline.schedule=paci")


def to_container(cfg: PipelineConfig) -> dict[str, Any]:
    """The config as plain dicts (for metrics.jsonl and the checkpoint)."""
    return configload.to_container(cfg)
