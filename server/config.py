"""Typed configuration of a fedasync run, each part validated where it is built.

Every key is documented by the docstring under its field; docs/configuration.md lists them all.
Every numeric key has its allowed values in RANGES. Each section checks its own keys in
``__post_init__`` (ranges, choices, the keys within it that must agree), so a section that
exists is valid whoever built it: omegaconf (``OmegaConf.to_object`` calls the constructors),
``dataclasses.replace`` or a test. FedAsyncConfig checks what needs the whole config: keys of
different sections that must agree, the silos that ``erasures`` and the ``lab`` section name (their keys carry
their index, which an entry does not know) and the client and data sections, whose classes are
protocol.config's. Every error is a ConfigError (a fedasync.errors.UserError) naming the key.
A config is never changed once built: derive another with ``dataclasses.replace``. Experiments
are YAML files (simulations/configs/) plus ``key=value`` overrides.

Choices are ``Literal`` types; the staleness weight functions and the server optimiser kinds
are the core's own (fedasync.staleness.WeightFnName, fedasync.optim.OptimizerKind). To mypy a
choice field is its Literal. To omegaconf it is a ``str`` that carries the Literal
(``Annotated[str, Literal[...]]``, rebound below under ``not TYPE_CHECKING``): omegaconf 2.3
refuses Literal annotations, and 2.4 would check them itself in its own words before the
section does, changing the messages. `choices` reads the allowed values from either form.

The one reference of every ``fedasync simulate`` key, a section per key prefix, each
documented field by field (docs/configuration.md and a test read it), in four modules: this
one (the whole config and the run, server, silos and engine sections), the erasure sections
(server/config_erasure.py: ``unlearning``, ``erasures``), the benchmarks' and tests'
instruments (server/config_lab.py: ``lab``) and every numeric key's range (server/config_ranges.py, ``RANGES``, importable from here too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fedasync.optim import OptimizerKind
from fedasync.ranges import (
    check,
    check_ranges,
    choices,
    numeric_values,
    recheck,
)
from fedasync.staleness import WEIGHT_FUNCTIONS, WeightFnName
from protocol.config import PRECISIONS, ClientConfig, DataConfig, TaskConfig
from runkit import configload
from runkit.keys import RunKeys
from server.config_erasure import ErasureRequestConfig, UnlearningConfig
from server.config_lab import LabConfig
from server.config_migrate import migrated
from server.config_ranges import RANGES
from server.config_task import task_checks

ServerMode = Literal["fedasync", "fedbuff", "sync", "ca2fl", "federaser"]
"""``server.mode``."""


MODES: tuple[str, ...] = choices(ServerMode)
OPTIMIZER_KINDS: tuple[str, ...] = choices(OptimizerKind)

if not TYPE_CHECKING:  # what omegaconf sees: a str carrying its Literal (module docstring)
    ServerMode, WeightFnName, OptimizerKind = (
        Annotated[str, t] for t in (ServerMode, WeightFnName, OptimizerKind)
    )


@dataclass
class StalenessConfig:
    """Staleness weight s(tau) (FedAsync, Xie et al. 2019)."""

    fn: WeightFnName = "polynomial"
    """constant, polynomial ((tau+1)^-a), hinge, or exponential (exp(-a tau))."""
    a: float = 0.5
    """Exponent / slope of the weight function."""
    b: float = 4.0
    """Hinge: staleness up to which the weight stays 1."""

    def __post_init__(self) -> None:
        """Checked when built: ranges and the weight function's name."""
        check_ranges(self, "server.staleness.", RANGES)
        check(
            self.fn in WEIGHT_FUNCTIONS,
            f"server.staleness.fn must be one of {tuple(WEIGHT_FUNCTIONS)}, got {self.fn!r}",
        )


@dataclass
class OptimizerConfig:
    """Server optimiser applied to FedBuff's averaged delta (FedAdam et al.)."""

    kind: OptimizerKind = "sgd"
    """sgd, momentum or adam."""
    lr: float = 1.0
    """Server learning rate."""
    momentum: float = 0.9
    """Momentum (kind=momentum)."""

    def __post_init__(self) -> None:
        """Checked when built: ranges and the kind."""
        check_ranges(self, "server.optimizer.", RANGES)
        check(
            self.kind in OPTIMIZER_KINDS,
            f"server.optimizer.kind must be sgd, momentum or adam, got {self.kind!r}",
        )


@dataclass
class ServerDPConfig:
    """Central (server-side) DP: noise on every release of the global model (fedasync/privacy.py)."""

    noise_multiplier: float | None = None
    """Gaussian noise std in units of server.clip_norm, added to each fold (fedasync) or flush
    (fedbuff, sync); None: off. Needs server.clip_norm."""
    epsilon_budget: float | None = None
    """A silo whose central epsilon would pass this is no longer folded in, nor sent work."""
    ledger: str | None = None
    """SQLite file of every release per silo (kept across runs); None: <run>/privacy/central.sqlite."""

    def __post_init__(self) -> None:
        """Checked when built: ranges (what needs server.clip_norm is ServerConfig's)."""
        check_ranges(self, "server.dp.", RANGES)


@dataclass
class ServerConfig:
    """The asynchronous server loop."""

    mode: ServerMode = "fedasync"
    """fedasync (fold every update at once), fedbuff (buffer K updates), sync (FedAvg rounds),
    ca2fl (buffer K updates, calibrated by each silo's cached latest one), federaser (the erasure
    benchmarks' baseline: FedAvg rounds that halt while a silo erases, the erasure being FedEraser's
    rebuild without it); server/strategies/."""
    alpha: float = 0.3
    """FedAsync mixing rate: x <- x + alpha * s(tau) * delta (0.3: steadier than the paper's 0.6
    when silos are non-IID, see docs/measured.md)."""
    buffer_size: int = 3
    """FedBuff and CA2FL: updates per aggregation (K)."""
    sample_weighting: bool = True
    """Weight updates by their sample counts (FedBuff and sync)."""
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    max_staleness: int | None = 100
    """Updates staler than this are rejected (None: no bound)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    clip_norm: float | None = None
    """Server-side clipping: scale every accepted update to at most this L2 norm (None: off)."""
    dp: ServerDPConfig = field(default_factory=ServerDPConfig)
    eval_every: int = 5
    """Evaluate the global model on the held-out test set every N versions."""
    checkpoint_every: int = 20
    """Write a checkpoint every N versions (0 disables)."""
    keep_models: int = 5
    """Model snapshots kept, the newest (<run>/models/, weights only, one at each checkpoint),
    for ``fedasync export RUN_DIR --version N``; 0: none (the checkpoint's version and the
    best evaluated one stay exportable)."""
    evaluate_silos: bool = True
    """At the end, ask every silo to evaluate the final model on its own data."""
    wait_for_nodes_s: float = 120.0
    """How long to wait for all silos to connect at start."""
    reply_timeout_s: float = 600.0
    """Wall seconds after which an unanswered message is abandoned and its silo re-sent work;
    also every message's Flower TTL (the SuperLink drops it, a SuperNode never starts it, after
    this long)."""

    def __post_init__(self) -> None:
        """Checked when built: ranges, the mode, and the server keys that must agree (its
        sub-sections have checked themselves)."""
        check_ranges(self, "server.", RANGES)
        check(self.mode in MODES, f"server.mode must be one of {MODES}, got {self.mode!r}")
        if self.dp.noise_multiplier is not None:
            check(
                self.clip_norm is not None,
                "server.dp.noise_multiplier needs server.clip_norm: the noise is in units of "
                "the clipping norm, which bounds each silo's influence",
            )
            ca2fl = (
                "a silo's cached update reaches every later step: per-step noise cannot bound it"
            )
            check(self.mode != "ca2fl", f"server.dp does not go with server.mode=ca2fl: {ca2fl}")
            check(
                self.mode == "fedasync" or not self.sample_weighting,
                "server.dp with fedbuff/sync needs server.sample_weighting=false: the sample "
                "counts silos report are their data too, and weighting by them is not noised",
            )


@dataclass
class SilosConfig:
    """How many silos (how fast each computes on the virtual clock: ``lab.speed``)."""

    count: int = 6
    """Number of silos (one SuperNode each)."""

    def __post_init__(self) -> None:
        """Checked when built: ranges."""
        check_ranges(self, "silos.", RANGES)


@dataclass
class RunConfig(RunKeys):
    """The run as a whole.

    The common run keys (runkit.keys.RunKeys) and its length (the sync baseline beside it:
    ``lab.compare_sync``)."""

    name: str = "demo"
    """Output folder name under out_dir."""
    seed: int = 0
    """Seed of everything random: partitions, speeds, initial model, local sampling."""
    budget_s: float = 600.0
    """Virtual seconds the run lasts (simulation) or wall seconds (deployment)."""
    max_versions: int | None = None
    """Stop after this many global versions (None: only the time budget)."""
    resume: bool = False
    """Continue from <out_dir>/<name>/checkpoint.pt."""

    def __post_init__(self) -> None:
        """Checked when built: the common keys, then ranges."""
        super().__post_init__()
        check_ranges(self, "run.", RANGES)


@dataclass
class EngineConfig:
    """Flower simulation engine (Ray): where it runs and with what resources."""

    ray_address: str | None = None
    """Attach to this running Ray cluster (its head's ``host:port``, or ``auto`` for the one
    ``ray start`` last started on this machine) instead of starting a private local Ray; the
    cluster's CPUs decide how many ClientApp actors run, and it is left running afterwards.
    None: a private Ray, started and stopped by each run."""
    num_cpus: int | None = None
    """CPUs given to a private Ray (None: all of this machine's); unset with ray_address."""
    client_gpus: float = 0.0
    """GPUs per ClientApp actor (fractions share a GPU)."""

    def __post_init__(self) -> None:
        """Checked when built: ranges, and the engine keys that must agree."""
        check_ranges(self, "engine.", RANGES)
        check(
            self.ray_address is None or self.num_cpus is None,
            "engine.num_cpus cannot be set with engine.ray_address: a running cluster's CPUs "
            "are fixed by `ray start --num-cpus` on its nodes",
        )
        check(
            self.ray_address is None or "://" not in self.ray_address,
            "engine.ray_address must be host:port or auto (Ray Client ray:// is not supported)",
        )


@dataclass
class FedAsyncConfig:
    """Everything a run needs."""

    run: RunConfig = field(default_factory=RunConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    silos: SilosConfig = field(default_factory=SilosConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    erasures: list[ErasureRequestConfig] = field(default_factory=list)
    unlearning: UnlearningConfig = field(default_factory=UnlearningConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    lab: LabConfig = field(default_factory=LabConfig)

    def __post_init__(self) -> None:
        """Checked when built (each section has checked itself): the client and data sections'
        ranges, the silos ``erasures`` and ``lab`` name, the data's names, and the keys of
        different sections that must agree. What needs files (the data, a checkpoint to resume)
        is checked by simulations.config.preflight."""
        from medical_data.registry import BENCHMARKS, PARTITIONS

        for rkey, key, value in numeric_values(self):
            if rkey.startswith(("client.", "data.", "task.", "erasures[")):
                rng = RANGES.get(rkey)
                check(rng is None or value in rng, f"{key} must be {rng}, got {value!r}")
        d, n = self.data, self.silos.count
        check(
            self.client.precision in PRECISIONS,
            f"client.precision must be one of {PRECISIONS}, got {self.client.precision!r}",
        )
        for ok, why in task_checks(self):  # (server/config_task.py)
            check(ok, why)
        check(
            d.benchmark in BENCHMARKS,
            f"data.benchmark must be one of {tuple(BENCHMARKS)}, got {d.benchmark!r}",
        )
        spec = BENCHMARKS[d.benchmark]
        check(
            d.partition in PARTITIONS,
            f"data.partition must be one of {PARTITIONS}, got {d.partition!r}",
        )
        check(
            not (d.partition == "natural" and spec.natural_split.startswith("none")),
            f"data.partition=natural: {d.benchmark} has no natural split; use dirichlet or iid",
        )
        check(
            spec.offline or d.data_dir is not None,
            f"data.data_dir must name the file or folder you downloaded for {d.benchmark}",
        )
        if d.network is not None:
            from medical_data.networks import NETWORKS

            check(
                d.network in NETWORKS, f"data.network must be one of {NETWORKS}, got {d.network!r}"
            )
        check(
            d.max_samples is None or d.max_samples >= 2 * n,
            f"data.max_samples={d.max_samples} is too small for silos.count={n} (at least {2 * n})",
        )
        for i, e in enumerate(self.erasures):
            check(e.silo < n, f"erasures[{i}].silo={e.silo} is not a silo (0..{n - 1})")
        for ok, why in self.lab.silo_checks(n):
            check(ok, why)
        soft, most = self.lab.soft_staleness, self.server.max_staleness
        check(
            most is None or soft is None or soft <= most,
            f"lab.soft_staleness={soft} must be <= server.max_staleness={most}",
        )
        b = self.lab.backdoor
        check(
            not b.enabled or not spec.offline or b.target_label < spec.num_classes,
            f"lab.backdoor.target_label={b.target_label} is not a class of {d.benchmark} "
            f"(0..{spec.num_classes - 1})",
        )


def validate(cfg: FedAsyncConfig) -> FedAsyncConfig:
    """Check ``cfg`` again, every section then the whole, and return it; raise ConfigError
    naming the key. A config is checked when it is built (each ``__post_init__``), so this
    only repeats those checks, for a caller that wants them said.

    Every numeric key against its range (RANGES), every name against what exists (modes,
    weight functions, benchmarks, partitions, networks), and the keys that must agree. What
    needs files (the data, a checkpoint to resume) is checked by simulations.config.preflight.
    """
    return recheck(cfg)


def from_container(data: dict[str, Any]) -> FedAsyncConfig:
    """Build a config from a plain dict (e.g. JSON sent by the launcher), checked as it is
    built; ``data`` is left as it was."""
    return configload.build(FedAsyncConfig, *migrated(data))


def build(*layers: Any, source: str) -> FedAsyncConfig:
    """The config that the schema's defaults, overlaid with ``layers`` in turn (plain dicts or
    omegaconf containers), describe, checked as it is built; ``layers`` are left as they were.

    The one way ``fedasync simulate`` (simulations.config.load_config: YAML file, then
    ``key=value`` overrides) and the Flower app (server.run_config: the run config) build a
    config, so both take the same values and refuse the same ones in the same words. Raises
    ConfigError naming the key: omegaconf's (unknown key, wrong type), with ``source`` (where
    the values came from) appended, or a section's own check; every message is bounded. Keys
    under an earlier name are read as today's (server/config_migrate.py).
    """
    return configload.build(FedAsyncConfig, *migrated(*layers), source=source)
