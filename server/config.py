"""Typed configuration of a fedasync run, validated once where the app starts.

Every key is documented by the docstring under its field; README.md lists them all.
Experiments are YAML files (simulations/configs/) plus ``key=value`` overrides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clients.config import ClientConfig, DataConfig

MODES = ("fedasync", "fedbuff", "sync")
SPEED_PROFILES = ("uniform", "stragglers", "lognormal")
FAULT_KINDS = (
    "crash",
    "nan",
    "wrong_shape",
    "replay",
    "huge_norm",
    "future_version",
    "unknown_silo",
)


@dataclass
class StalenessConfig:
    """Staleness weight s(tau) (FedAsync, Xie et al. 2019)."""

    fn: str = "polynomial"
    """constant, polynomial ((tau+1)^-a), hinge, or exponential (exp(-a tau))."""
    a: float = 0.5
    """Exponent / slope of the weight function."""
    b: float = 4.0
    """Hinge: staleness up to which the weight stays 1."""


@dataclass
class OptimizerConfig:
    """Server optimiser applied to FedBuff's averaged delta (FedAdam et al.)."""

    kind: str = "sgd"
    """sgd, momentum or adam."""
    lr: float = 1.0
    """Server learning rate."""
    momentum: float = 0.9
    """Momentum (kind=momentum)."""


@dataclass
class CorrectionsConfig:
    """Corrections applied to an update given the current parameters."""

    delay_compensation: float = 0.0
    """DC-ASGD lambda (Zheng et al. 2017); 0 disables."""
    error_feedback_topk: float = 1.0
    """Fraction of entries of each update folded in (top-k); the rest is kept per silo as an
    error-feedback residual and added to its next update. 1.0 disables."""


@dataclass
class ServerDPConfig:
    """Central (server-side) DP: noise on every release of the global model (fedasync/privacy.py)."""

    noise_multiplier: float | None = None
    """Gaussian noise std in units of server.clip_norm, added to each fold (fedasync) or flush
    (fedbuff, sync); None: off. Needs server.clip_norm."""
    delta: float = 1e-5
    """The delta each silo's central epsilon is reported at."""
    epsilon_budget: float | None = None
    """A silo whose central epsilon would pass this is no longer folded in, nor sent work."""
    ledger: str | None = None
    """SQLite file of every release per silo (kept across runs); None: <run>/privacy/central.sqlite."""


@dataclass
class ServerConfig:
    """The asynchronous server loop."""

    mode: str = "fedasync"
    """fedasync (fold every update at once), fedbuff (buffer K updates), sync (FedAvg rounds)."""
    alpha: float = 0.3
    """FedAsync mixing rate: x <- x + alpha * s(tau) * delta (0.3: steadier than the paper's 0.6
    when silos are non-IID, see README)."""
    buffer_size: int = 3
    """FedBuff: updates per aggregation (K)."""
    sample_weighting: bool = True
    """Weight updates by their sample counts (FedBuff and sync)."""
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    max_staleness: int | None = 100
    """Updates staler than this are rejected (None: no bound)."""
    soft_staleness: int | None = None
    """Updates staler than this (but within max_staleness) are down-weighted by soft_factor."""
    soft_factor: float = 0.5
    """Down-weighting factor beyond soft_staleness."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    corrections: CorrectionsConfig = field(default_factory=CorrectionsConfig)
    norm_outlier_factor: float = 10.0
    """Reject an update whose norm exceeds this multiple of the median accepted norm."""
    clip_norm: float | None = None
    """Server-side clipping: scale every accepted update to at most this L2 norm (None: off)."""
    dp: ServerDPConfig = field(default_factory=ServerDPConfig)
    eval_every: int = 5
    """Evaluate the global model on the held-out test set every N versions."""
    checkpoint_every: int = 20
    """Write a checkpoint every N versions (0 disables)."""
    evaluate_silos: bool = True
    """At the end, ask every silo to evaluate the final model on its own data."""
    wait_for_nodes_s: float = 120.0
    """How long to wait for all silos to connect at start."""
    reply_timeout_s: float = 600.0
    """Wall seconds after which an unanswered message is abandoned and its silo re-sent work;
    also every message's Flower TTL (the SuperLink drops it, a SuperNode never starts it, after
    this long)."""
    poll_interval_s: float = 0.2
    """Wall clock (deployment): seconds between polls for replies; each poll is a request to the
    SuperLink. The virtual clock (simulation) polls every 5 ms."""
    offline_retry_s: float = 10.0
    """Wall seconds before a silo the SuperLink reports offline is sent work again."""


@dataclass
class SilosConfig:
    """How many silos and how fast each computes (virtual clock)."""

    count: int = 6
    """Number of silos (one SuperNode each)."""
    speed_profile: str = "stragglers"
    """uniform (all speed 1), stragglers (a fraction `straggler_fraction` is `straggler_slowdown`
    times slower), lognormal (speeds drawn from a log-normal with sigma `sigma`)."""
    straggler_fraction: float = 0.2
    """Fraction of silos that are stragglers (rounded, at least one when > 0)."""
    straggler_slowdown: float = 10.0
    """How many times slower a straggler is."""
    sigma: float = 0.5
    """Log-normal sigma of speeds (speed_profile=lognormal)."""
    step_time_s: float = 1.0
    """Virtual seconds one local step takes on a speed-1 silo."""
    latency_s: float = 0.5
    """Virtual seconds of communication per message (both ways together)."""
    jitter: float = 0.1
    """Relative jitter of each job's duration (seeded per silo and job)."""
    emulate_speed: bool = False
    """Wall clock (deployment on one machine): each silo waits after training so that its
    message takes 1/speed as long as its training did, making the speed profile real."""
    exclude: list[int] = field(default_factory=list)
    """Silos that never train (retraining from scratch without their data)."""


@dataclass
class RunConfig:
    """The run as a whole."""

    name: str = "demo"
    """Output folder name under out_dir."""
    seed: int = 0
    """Seed of everything random: partitions, speeds, initial model, local sampling."""
    budget_s: float = 600.0
    """Virtual seconds the run lasts (simulation) or wall seconds (deployment)."""
    max_versions: int | None = None
    """Stop after this many global versions (None: only the time budget)."""
    out_dir: str = "runs"
    """Where run folders are written."""
    resume: bool = False
    """Continue from <out_dir>/<name>/checkpoint.pt."""
    compare_sync: bool = True
    """After the run, also run the sync FedAvg baseline on the same data, clock and silos."""
    target_accuracy: float | None = None
    """Accuracy for time_to_target_s; None: 95% of the sync baseline's best (or of this run's)."""
    progress: bool = True
    """Show a progress bar."""


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
    client_cpus: int = 1
    """CPUs per ClientApp actor (an integer)."""
    client_gpus: float = 0.0
    """GPUs per ClientApp actor (fractions share a GPU)."""


@dataclass
class FaultConfig:
    """One injected fault, for robustness runs."""

    kind: str = "crash"
    """crash, nan, wrong_shape, replay, huge_norm, future_version or unknown_silo."""
    silo: int = 0
    """Which silo misbehaves."""
    at_version: int = 0
    """It misbehaves on its first job dispatched at or after this version."""
    down_s: float = 30.0
    """crash: virtual seconds the silo stays down before it comes back."""


@dataclass
class ErasureRequestConfig:
    """An erasure scheduled in a simulation (live ones come through the erasure service)."""

    silo: int = 0
    """Whose data is erased."""
    at_s: float = 0.0
    """Virtual second at which it is submitted."""
    fraction: float = 1.0
    """1.0: the whole silo; less: a seeded fraction of its samples (a sample-level erasure)."""


@dataclass
class BackdoorConfig:
    """Verification runs: one silo's training data carries a trigger patch with a target label."""

    enabled: bool = False
    """Poison the silo's data (classification: relabel; segmentation: the whole mask)."""
    silo: int = 0
    """Which silo's data carries the trigger."""
    fraction: float = 0.5
    """Fraction of that silo's samples that get the trigger and the target label."""
    target_label: int = 0
    """The label the trigger maps to."""
    trigger_size: int = 3
    """Side of the square trigger patch in pixels (a 3x3 patch is not learnt on nuclei)."""
    relearn_silo: int | None = None
    """Relearning attack: this silo also trains on the backdoored silo's poisoned samples..."""
    relearn_after_s: float = 0.0
    """...from this virtual second on (to test that an erasure stays in force)."""


@dataclass
class UnlearningConfig:
    """Asynchronous erasure with invariance calibration (AFU-IC style; see README)."""

    method: str = "pga"
    """Silo-side erasure: pga (projected gradient ascent, Halimi et al. 2022) or relabel."""
    steps: int = 5
    """Local erasure steps."""
    lr: float = 0.01
    """Local erasure learning rate."""
    radius: float = 2.0
    """PGA: L2 radius of the ball around the reference model."""
    server_removal: bool = False
    """Subtract the silo's recorded contributions from the global model first (FedEraser-style)."""
    calibration: bool = True
    """Project later updates out of the erased data's gradient signature (invariance)."""
    calibration_strength: float = 1.0
    """How much of an update's component in the signature subspace is removed (1: all)."""
    signature_rank: int = 4
    """Rank of the gradient signature the erasing silo sends."""
    signature_batches: int = 4
    """Forget-set batches whose loss gradients span that signature (each costs about a step)."""
    signature_dtype: str = "float32"
    """Precision the signature crosses the wire in: float32, or float16 (half the bytes; the
    server re-orthonormalises it)."""
    pre_boundary: str = "project"
    """Other silos' work based before the erasure boundary: project (calibrate) or drop."""
    relearn_versions: int = 20
    """Versions after the boundary at which the erasure is verified (the relearning check)."""
    max_attempts: int = 3
    """Times an erasure may be lost by its silo going down mid-erasure (a crash, an error
    reply, no reply within server.reply_timeout_s) before it is failed; being reported offline
    does not count (it is retried every server.offline_retry_s)."""
    halt: bool = False
    """Halt the federation while a silo erases (the synchronous-unlearning baseline)."""
    federaser: bool = False
    """Halting baseline (with halt, server.mode=sync): instead of the silo's own erasure, rebuild
    the model without it by FedEraser's calibration rounds (Liu et al. 2021)."""
    federaser_interval: int = 2
    """FedEraser: retain every this-many-th round's update norms (one calibration round each)."""
    federaser_steps_ratio: float = 0.5
    """FedEraser: calibration training's local steps as a share of client.local_steps."""
    service: bool = False
    """Run the erasure gRPC service during the run (live requests)."""
    address: str = "127.0.0.1:50151"
    """Where the erasure service listens (port 0: any free port)."""
    credentials: str | None = None
    """Credentials file (fedasync erase credentials); None: generated in the run folder."""
    tls_certfile: str | None = None
    """PEM certificate the erasure service serves TLS with (None: insecure, for simulation on
    one machine); ``fedasync deploy local`` gives it the SuperLink's."""
    tls_keyfile: str | None = None
    """Its private key (PEM)."""


@dataclass
class FedAsyncConfig:
    """Everything a run needs."""

    run: RunConfig = field(default_factory=RunConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    silos: SilosConfig = field(default_factory=SilosConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    faults: list[FaultConfig] = field(default_factory=list)
    erasures: list[ErasureRequestConfig] = field(default_factory=list)
    unlearning: UnlearningConfig = field(default_factory=UnlearningConfig)
    backdoor: BackdoorConfig = field(default_factory=BackdoorConfig)


def validate(cfg: FedAsyncConfig) -> FedAsyncConfig:
    """Check values that types alone cannot; raise ValueError naming the key."""
    checks: list[tuple[bool, str]] = [
        (cfg.server.mode in MODES, f"server.mode must be one of {MODES}, got {cfg.server.mode!r}"),
        (
            cfg.silos.speed_profile in SPEED_PROFILES,
            f"silos.speed_profile must be one of {SPEED_PROFILES}",
        ),
        (cfg.silos.count >= 1, "silos.count must be >= 1"),
        (cfg.server.buffer_size >= 1, "server.buffer_size must be >= 1"),
        (0.0 < cfg.server.alpha <= 1.0, "server.alpha must be in (0, 1]"),
        (cfg.server.eval_every >= 1, "server.eval_every must be >= 1"),
        (cfg.server.checkpoint_every >= 0, "server.checkpoint_every must be >= 0"),
        (cfg.run.budget_s > 0, "run.budget_s must be > 0"),
        (cfg.server.reply_timeout_s > 0, "server.reply_timeout_s must be > 0"),
        (cfg.server.poll_interval_s > 0, "server.poll_interval_s must be > 0"),
        (cfg.server.offline_retry_s >= 0, "server.offline_retry_s must be >= 0"),
        (cfg.silos.step_time_s > 0, "silos.step_time_s must be > 0"),
        (0.0 <= cfg.silos.jitter < 1.0, "silos.jitter must be in [0, 1)"),
        (cfg.silos.straggler_slowdown >= 1.0, "silos.straggler_slowdown must be >= 1"),
        (cfg.client.local_steps >= 1, "client.local_steps must be >= 1"),
        (cfg.client.batch_size >= 1, "client.batch_size must be >= 1"),
        (cfg.engine.client_cpus >= 1, "engine.client_cpus must be an integer >= 1"),
        (
            cfg.engine.ray_address is None or cfg.engine.num_cpus is None,
            "engine.num_cpus cannot be set with engine.ray_address: a running cluster's CPUs "
            "are fixed by `ray start --num-cpus` on its nodes",
        ),
        (
            cfg.engine.ray_address is None or "://" not in cfg.engine.ray_address,
            "engine.ray_address must be host:port or auto (Ray Client ray:// is not supported)",
        ),
        (
            0.0 < cfg.server.corrections.error_feedback_topk <= 1.0,
            "server.corrections.error_feedback_topk must be in (0, 1]",
        ),
        (
            cfg.server.optimizer.kind in ("sgd", "momentum", "adam"),
            "server.optimizer.kind must be sgd, momentum or adam",
        ),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)
    if cfg.unlearning.method not in ("pga", "relabel"):
        raise ValueError("unlearning.method must be pga or relabel")
    if cfg.unlearning.pre_boundary not in ("project", "drop"):
        raise ValueError("unlearning.pre_boundary must be project or drop")
    u = cfg.unlearning
    if u.max_attempts < 1:
        raise ValueError("unlearning.max_attempts must be >= 1")
    if u.steps < 0 or u.signature_batches < 1 or u.signature_rank < 1:
        raise ValueError(
            "unlearning.steps must be >= 0, unlearning.signature_batches and "
            "unlearning.signature_rank >= 1"
        )
    if (u.tls_certfile is None) != (u.tls_keyfile is None):
        raise ValueError("unlearning.tls_certfile and unlearning.tls_keyfile go together")
    if u.signature_dtype not in ("float32", "float16"):
        raise ValueError("unlearning.signature_dtype must be float32 or float16")
    if u.federaser and not (u.halt and cfg.server.mode == "sync"):
        raise ValueError("unlearning.federaser needs unlearning.halt=true and server.mode=sync")
    if u.federaser_interval < 1 or not 0.0 < u.federaser_steps_ratio <= 1.0:
        raise ValueError(
            "unlearning.federaser_interval must be >= 1, federaser_steps_ratio in (0, 1]"
        )
    if not 0.0 <= u.calibration_strength <= 1.0 or u.radius < 0:
        raise ValueError("unlearning.calibration_strength must be in [0, 1], radius >= 0")
    for i, e in enumerate(cfg.erasures):
        if not 0 <= e.silo < cfg.silos.count:
            raise ValueError(
                f"erasures[{i}].silo={e.silo} is not a silo (0..{cfg.silos.count - 1})"
            )
        if not 0.0 < e.fraction <= 1.0:
            raise ValueError(f"erasures[{i}].fraction must be in (0, 1]")
    if cfg.server.clip_norm is not None and not cfg.server.clip_norm > 0:
        raise ValueError("server.clip_norm must be > 0 (or null)")
    dp = cfg.server.dp
    if dp.noise_multiplier is not None:
        if not dp.noise_multiplier > 0:
            raise ValueError("server.dp.noise_multiplier must be > 0 (or null: no central DP)")
        if cfg.server.clip_norm is None:
            raise ValueError(
                "server.dp.noise_multiplier needs server.clip_norm: the noise is in units of "
                "the clipping norm, which bounds each silo's influence"
            )
        if cfg.server.mode != "fedasync" and cfg.server.sample_weighting:
            raise ValueError(
                "server.dp with fedbuff/sync needs server.sample_weighting=false: the sample "
                "counts silos report are their data too, and weighting by them is not noised"
            )
        if not 0.0 < dp.delta < 1.0:
            raise ValueError("server.dp.delta must be in (0, 1)")
        if dp.epsilon_budget is not None and not dp.epsilon_budget > 0:
            raise ValueError("server.dp.epsilon_budget must be > 0 (or null)")
    if cfg.backdoor.trigger_size < 1:
        raise ValueError("backdoor.trigger_size must be >= 1")
    if cfg.backdoor.enabled and not 0 <= cfg.backdoor.silo < cfg.silos.count:
        raise ValueError(f"backdoor.silo={cfg.backdoor.silo} is not a silo")
    for i, f in enumerate(cfg.faults):
        if f.kind not in FAULT_KINDS:
            raise ValueError(f"faults[{i}].kind must be one of {FAULT_KINDS}, got {f.kind!r}")
        if not 0 <= f.silo < cfg.silos.count:
            raise ValueError(f"faults[{i}].silo={f.silo} is not a silo (0..{cfg.silos.count - 1})")
    return cfg


def from_container(data: dict[str, Any]) -> FedAsyncConfig:
    """Build and validate a config from a plain dict (e.g. JSON sent by the launcher)."""
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(FedAsyncConfig)
    merged = OmegaConf.merge(schema, OmegaConf.create(data))
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, FedAsyncConfig)
    return validate(cfg)
