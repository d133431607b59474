"""The config's ``lab`` section: the benchmarks' and the tests' instruments, apart from the
settings a user decides.

A backdoor planted in one silo's data (``lab.backdoor``), the erasure's ablations, settled
sizes and the halting FedEraser baseline's settings (``lab.erasure``), the server's correction
ablations (``lab.corrections``, ``lab.soft_staleness``), the emulated speeds' numbers
(``lab.speed``), the time-to-target measure (``lab.target_accuracy``), faults injected into
silos (``lab.faults``), silos or shares of their samples left out (``lab.exclude``,
``lab.exclude_samples``: retraining from scratch, the reference an erasure is verified
against) and the speed profile emulated by waiting on the wall clock (``lab.emulate_speed``).
Each measures fedasync; none is a product setting. They reach the silos of a simulation and
of a deployment of a benchmark's partitions on one machine (the Flower app's run config
declares them, ``lab.*``, for those); a hospital's node, on its own data, refuses a message
that asks for a backdoor, a fault or an emulated speed (clients/lab.py).

Part of the one reference of every ``fedasync simulate`` key (server/config.py, whose module
docstring says how sections are written); every numeric key's range is in
server/config_ranges.py. ``FedAsyncConfig`` checks what needs the whole config (which silos
exist, the data's classes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Literal

from fedasync.ranges import check, check_ranges, choices, numeric_values
from fedasync.unlearning import SHARE_RULES
from server.config_erasure import (
    CALIBRATION_TARGETS,
    PRE_BOUNDARIES,
    PROTECTS,
    REMOVAL_PARTS,
    SIGNATURE_DTYPES,
    CalibrationTarget,
    PreBoundary,
    Protect,
    RadiusScaling,
    RemovalPart,
    SignatureDtype,
)
from server.config_ranges import RANGES

TriggerPattern = Literal["solid", "checker", "blend"]
"""``lab.backdoor.trigger_pattern``: medical_data.backdoor.PATTERNS (tests/test_config_types.py
checks the two agree; importing it here would load MONAI into every config reader)."""
SpeedProfile = Literal["uniform", "stragglers", "lognormal"]
"""``lab.speed.profile``."""
FaultKind = Literal[
    "crash", "nan", "wrong_shape", "replay", "huge_norm", "future_version", "unknown_silo"
]
"""``lab.faults[].kind``."""

SPEED_PROFILES: tuple[str, ...] = choices(SpeedProfile)
TRIGGER_PATTERNS: tuple[str, ...] = choices(TriggerPattern)
FAULT_KINDS: tuple[str, ...] = choices(FaultKind)

if not TYPE_CHECKING:  # what omegaconf sees: a str carrying its Literal (server/config.py)
    TriggerPattern, FaultKind, SpeedProfile = (
        Annotated[str, t] for t in (TriggerPattern, FaultKind, SpeedProfile)
    )


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
    trigger_pattern: TriggerPattern = "solid"
    """solid (the patch at the image's maximum), checker (a checkerboard of its maximum and
    minimum: not ordinary anatomy, so the backdoor is learnt where a bright corner is not) or
    blend (a faint checkerboard of ``trigger_size`` cells over the whole image: in every random
    crop a 3D network trains on, where a corner patch is in few)."""
    relearn_silo: int | None = None
    """Relearning attack: this silo also trains on the backdoored silo's poisoned samples..."""
    relearn_after_s: float = 0.0
    """...from this virtual second on (to test that an erasure stays in force)."""
    relearn_samples: int | None = None
    """The relearning silo trains on only this many of the poisoned samples (a seeded choice;
    None: all of them): how much leftover exposure brings an erased backdoor back."""
    watch: bool = False
    """Every evaluation also verifies the backdoored silo's data on the global model (``asr``,
    ``forget_accuracy``, ``mia_auc`` in each ``eval`` event, prefixed ``bd_``): the backdoor
    over time, in every run (the retraining reference and never-erased runs too)."""

    def __post_init__(self) -> None:
        """Checked when built: ranges and the pattern (which silos and labels exist,
        FedAsyncConfig)."""
        check_ranges(self, "lab.backdoor.", RANGES)
        check(
            self.trigger_pattern in TRIGGER_PATTERNS,
            f"lab.backdoor.trigger_pattern must be one of {TRIGGER_PATTERNS}, "
            f"got {self.trigger_pattern!r}",
        )


@dataclass
class FaultConfig:
    """One injected fault, for robustness runs (an entry of ``lab.faults``: FedAsyncConfig
    checks its silo, naming its index)."""

    kind: FaultKind = "crash"
    """crash, nan, wrong_shape, replay, huge_norm, future_version or unknown_silo."""
    silo: int = 0
    """Which silo misbehaves."""
    at_version: int = 0
    """It misbehaves on its first job dispatched at or after this version."""
    down_s: float = 30.0
    """crash: virtual seconds the silo stays down before it comes back."""


@dataclass
class SampleShare:
    """An entry of ``lab.exclude_samples``: a seeded share of one silo's samples."""

    silo: int = 0
    fraction: float = 0.1


@dataclass
class ErasureLab:
    """The erasure's ablations, kept so the benchmarks can run each arm again: the defaults are
    the settled choices (docs/measured.md says what each was measured against); the resurfacing
    benchmark's watch between a boundary and its check (``watch_every``); the erasure's settled
    sizes that the tests and benchmarks shrink to run faster or vary to measure (the removal's
    bound, the membership test's cadence, the signature, the sketch, the verification window);
    and the halting FedEraser baseline's two settings (``server.mode=federaser``)."""

    server_removal: bool = True
    """Subtract the silo's recorded contributions from the global model first (FedEraser-style)."""
    calibration: bool = True
    """Project later updates out of the erased data's gradient signature (invariance)."""
    calibration_strength: float = 1.0
    """How much of an update's component in the signature subspace is removed (1: all)."""
    cancel_inflight: bool = True
    """An erasure request cancels its silo's training job in flight, whose reply is discarded
    when it comes (server/cancel.py): the erasure starts at once rather than after that job.
    false: it waits for the job's reply (and folds it) first. In a deployment only with
    the erasure service on (``unlearning.address``): each node watches its silo's requests there and stops the job
    between two local steps (``fedasync node --erasure-service``); without the service the node
    finishes the job before it pulls the erasure's message, so the erasure waits for it."""
    watch_every: int = 0
    """Between the boundary and the verification, verify the erased model every this many
    versions (an ``erasure_watch`` event with the verification metrics and the reversion
    ratio): the resurfacing of erased influence over time. 0: only at the two ends."""
    server_removal_part: RemovalPart = "unique"
    """With ``server_removal``: which part of the silo's recorded contributions is subtracted.
    ``total``: all of it (FedEraser's first-order removal). ``unique``: only what lies outside
    the span of the other silos' recent accepted updates (``lab.erasure.sketch_rank``), the
    directions their training does not act on and so cannot have washed out since (what
    persists of the silo's work); the rest stays (docs/erasure.md)."""
    server_removal_scale: float = 1.0
    """With ``server_removal``: the share of those contributions subtracted (1: all of them;
    the full removal over-erases, see docs/measured.md, so a smaller share can be tried)."""
    calibration_target: CalibrationTarget = "applied"
    """What the invariance calibration projects: ``reply``, each accepted update as it arrives,
    before delay compensation, error feedback and the server optimiser; or ``applied``, the
    change each fold makes to the model, after all of them, with the server's carried state
    (FedBuff's buffer, the optimiser's first moment, error-feedback residuals) projected at the
    boundary, the erased silo's buffered deltas and residual dropped, and no delay compensation
    across the boundary (its w_now − w_base would hold the erasure itself). Default applied
    (with protect=jump): on benchmarks/unlearning_resurfacing.py it removed more of the
    uncalibrated arm's resurfacing than reply did, without over-erasing (docs/measured.md)."""
    protect: Protect = "jump"
    """With ``calibration_target=applied``, what a change to the model may not do: ``subspace``,
    move within the erased data's gradient signature (two-sided projection); ``jump``, move
    back along the erasure's own jump (one-sided: only the component toward the pre-erasure
    model is removed, PCGrad/FedOSD style); ``both``; ``gradient``, lower the erased data's
    loss (one-sided: only the component along minus its mean loss gradient at the erased
    model, which the erasing silo sends, is removed); ``onesided``, jump and gradient together
    (both one-sided, projected onto their intersection). With ``calibration_target=reply`` it
    is not used: each reply is projected out of the signature."""
    silo_part_bounded: bool = False
    """Hold the erasing silo's own part (its ascent, applied at the boundary) to the bound the
    server's removal is held to (``server_removal_max_drop`` below the held-out score
    before the request): the largest share within it at the boundary, the rest in steps as the
    removal's rest (``removed_more`` events with ``part: silo``). false: the whole part at the
    boundary, bounded only by norm (``bound_delta``)."""
    signature_unique: bool = False
    """At the boundary, remove from the erased data's signature the span of the other silos'
    recent accepted updates (``lab.erasure.sketch_rank``), keeping only directions unique to the
    erased data (SFU-style, Li et al. 2023); how much it removed is in the ``calibrating`` event."""
    pre_boundary: PreBoundary = "project"
    """Other silos' work based before the erasure boundary: project (calibrate it, when
    ``calibration`` is on) or drop it (whether or not it is on)."""
    radius: float = 2.0
    """PGA: L2 radius of the ball around the reference model (a whole silo's erasure; a
    sample-level one gets it scaled by ``radius_scaling``). A settled size, like the others
    here: with ``unlearning.stop=membership`` (the default) the silo stops by its test well
    inside the ball, which only bounds an ascent that runs away; the tests shrink it to see the
    bound hold."""
    radius_scaling: RadiusScaling = "linear"
    """How a sample-level erasure's size (PGA radius, relabel steps) follows its share of the
    silo's samples: linear (max(share, radius_floor)), sqrt (max(sqrt(share), radius_floor)) or
    none (the full size for any erasure)."""
    radius_floor: float = 0.01
    """The smallest share of the full size a sample-level erasure gets."""
    server_removal_max_drop: float = 0.02
    """With ``server_removal``: the most the server's held-out score may fall by the removal.
    A removal that costs more is halved until it costs no more (at most four times; then it
    is withheld for now); the rest is applied in steps while the request is in progress, each
    once the score is back to its level before the request and within this bound
    (server/removal.py). 1: no bound. Only with a test set at
    the coordinator: a federated evaluation answers nothing mid-run, and the removal is then
    applied whole. A removal that costs the model more than its noise removes more than the
    silo's data explains (measured: nuclei's over-erased seeds lost 9 to 29 points of Dice
    to the whole removal, docs/measured.md)."""
    stop_every: int = 5
    """``unlearning.stop=membership``: erasure steps between two readings of the silo's
    membership test."""
    signature_rank: int = 4
    """Rank of the gradient signature the erasing silo sends."""
    signature_batches: int = 4
    """Forget-set batches whose loss gradients span that signature (each costs about a step)."""
    signature_dtype: SignatureDtype = "float32"
    """Precision the signature crosses the wire in: float32, or float16 (half the bytes; the
    server re-orthonormalises it)."""
    sketch_rank: int = 16
    """``server_removal_part=unique`` and ``signature_unique``: rows of the streaming sketch of
    the accepted updates' span, by silo (`fedasync.unlearning.SpanSketch`): the others' span
    has at most this many directions. Memory and checkpoints: this many float32 copies of the
    model, whatever the run's length; each accepted update costs its norm and one fused
    addition into one row."""
    relearn_versions: int = 20
    """Versions after the boundary at which the erasure is verified (the relearning check)."""
    federaser_interval: int = 2
    """FedEraser (``server.mode=federaser``, the halting baseline): retain every this-many-th
    round's update norms (one calibration round each)."""
    federaser_steps_ratio: float = 0.5
    """FedEraser: calibration training's local steps as a share of client.local_steps."""

    def __post_init__(self) -> None:
        """Checked when built: ranges and the choices."""
        check_ranges(self, "lab.erasure.", RANGES)
        check(
            self.server_removal_part in REMOVAL_PARTS,
            f"lab.erasure.server_removal_part must be one of {REMOVAL_PARTS}",
        )
        check(
            self.radius_scaling in SHARE_RULES,
            f"lab.erasure.radius_scaling must be one of {SHARE_RULES}, got {self.radius_scaling!r}",
        )
        check(
            self.pre_boundary in PRE_BOUNDARIES, "lab.erasure.pre_boundary must be project or drop"
        )
        check(
            self.calibration_target in CALIBRATION_TARGETS,
            "lab.erasure.calibration_target must be reply or applied",
        )
        check(
            self.protect in PROTECTS,
            "lab.erasure.protect must be subspace, jump, both, gradient or onesided",
        )
        check(
            self.signature_dtype in SIGNATURE_DTYPES,
            "lab.erasure.signature_dtype must be float32 or float16",
        )


@dataclass
class CorrectionsLab:
    """The server's corrections of an update, ablations the benchmarks measure (each off by
    default: docs/measured.md)."""

    delay_compensation: float = 0.0
    """DC-ASGD lambda (Zheng et al. 2017); 0 disables."""
    error_feedback_topk: float = 1.0
    """Fraction of entries of each update folded in (top-k over the whole update); the rest is
    kept per silo as an error-feedback residual and added to its next update. 1.0 disables."""
    residual_budget_mb: float | None = 2048.0
    """Memory the error-feedback residuals may hold (MiB; None: unbounded, one model per
    silo: 10,000 silos of DenseNet121 would need 280 GB). Past it the least recently used
    residuals are merged into one shared residual that rides with the next update
    (fedasync.corrections.ErrorFeedback): the mass is kept, only its sender changes."""

    def __post_init__(self) -> None:
        """Checked when built: ranges."""
        check_ranges(self, "lab.corrections.", RANGES)


@dataclass
class SpeedLab:
    """The virtual clock's emulated heterogeneity: its profile, the numbers behind it and each
    job's duration (simulation; with ``lab.emulate_speed`` also on one machine's wall clock).
    The defaults are the demo's; the benchmarks set their own."""

    profile: SpeedProfile = "stragglers"
    """uniform (all speed 1), stragglers (a fraction ``straggler_fraction`` is
    ``straggler_slowdown`` times slower), lognormal (speeds drawn from a log-normal with sigma
    ``sigma``). An instrument, not a setting (was ``lab.speed.profile``): how fast simulated
    silos are is the benchmark's assumption, as the numbers below are; a deployed silo is as
    fast as its machine (the profile only reaches it through ``lab.emulate_speed``)."""
    straggler_fraction: float = 0.2
    """Fraction of silos that are stragglers (rounded, at least one when > 0)."""
    straggler_slowdown: float = 10.0
    """How many times slower a straggler is."""
    sigma: float = 0.5
    """Log-normal sigma of speeds (``profile=lognormal``)."""
    step_time_s: float = 1.0
    """Virtual seconds one local step takes on a speed-1 silo."""
    latency_s: float = 0.5
    """Virtual seconds of communication per message (both ways together)."""
    jitter: float = 0.1
    """Relative jitter of each job's duration (seeded per silo and job)."""

    def __post_init__(self) -> None:
        """Checked when built: ranges and the profile."""
        check_ranges(self, "lab.speed.", RANGES)
        check(
            self.profile in SPEED_PROFILES,
            f"lab.speed.profile must be one of {SPEED_PROFILES}, got {self.profile!r}",
        )


@dataclass
class LabConfig:
    """The benchmarks' and the tests' instruments, never product settings (a hospital's node
    refuses a backdoor, a fault or an emulated speed; server/config_lab.py's docstring)."""

    backdoor: BackdoorConfig = field(default_factory=BackdoorConfig)
    erasure: ErasureLab = field(default_factory=ErasureLab)
    corrections: CorrectionsLab = field(default_factory=CorrectionsLab)
    speed: SpeedLab = field(default_factory=SpeedLab)
    soft_staleness: int | None = None
    """Updates staler than this (but within ``server.max_staleness``) are down-weighted by
    ``soft_factor`` (an ablation beside the staleness weight function)."""
    soft_factor: float = 0.5
    """Down-weighting factor beyond ``soft_staleness``."""
    compare_sync: bool = False
    """After the run, also run the sync FedAvg baseline on the same data, clock and silos
    (``make demo`` asks for it; a run on its own runs once; simulation only). An instrument,
    not a setting (was ``lab.compare_sync``): it measures fedasync against FedAvg, as
    ``target_accuracy`` does, and changes nothing of the run itself."""
    target_accuracy: float | None = None
    """Score for ``time_to_target_s`` (the time-to-target measure of the benchmarks); None: 95%
    of the sync baseline's best (or of this run's own without the baseline)."""
    faults: list[FaultConfig] = field(default_factory=list)
    """Injected faults (robustness runs): each silo misbehaves as its entry says."""
    exclude: list[int] = field(default_factory=list)
    """Silos that never train (retraining from scratch without their data)."""
    exclude_samples: list[SampleShare] = field(default_factory=list)
    """Seeded shares of silos' samples that are never trained on: retraining from scratch
    without the samples a sample-level erasure of the same share erases (the same seeded
    choice as ``erasures[].fraction``, server/unlearning/lifecycle.py ``_fraction_ids``)."""
    offline_retry_s: float = 10.0
    """Seconds before a silo the SuperLink reports offline is sent work again (wall seconds in
    a deployment, virtual ones in a simulation). An instrument, not a setting: the deployment
    and erasure-requeue tests shorten or lengthen it to see the retry happen; 10 s is far below
    a restarted node's reconnect time and far above the SuperLink's refusal round trip."""
    emulate_speed: bool = False
    """Wall clock (deployment on one machine): each silo waits after training so that its
    message takes 1/speed as long as its training did, making the speed profile real."""

    def __post_init__(self) -> None:
        """Checked when built: ranges, the fault kinds, and that no silo's share is listed
        twice (which silos exist: FedAsyncConfig)."""
        for rkey, key, value in numeric_values(self, "lab."):
            if not rkey.startswith(
                ("lab.backdoor.", "lab.erasure.", "lab.corrections.", "lab.speed.")
            ):
                rng = RANGES.get(rkey)
                check(rng is None or value in rng, f"{key} must be {rng}, got {value!r}")
        for i, f in enumerate(self.faults):
            check(
                f.kind in FAULT_KINDS,
                f"lab.faults[{i}].kind must be one of {FAULT_KINDS}, got {f.kind!r}",
            )
        seen: set[int] = set()
        for i, share in enumerate(self.exclude_samples):
            at = f"lab.exclude_samples[{i}]"
            check(
                0.0 < share.fraction < 1.0,
                f"{at}.fraction={share.fraction} must be in (0, 1) (a whole silo: lab.exclude)",
            )
            check(share.silo not in seen, f"{at}: silo {share.silo} is listed twice")
            seen.add(share.silo)

    def excluded_share(self, silo: int) -> float | None:
        """The share of ``silo``'s samples it never trains on (``exclude_samples``), or None."""
        return next((x.fraction for x in self.exclude_samples if x.silo == silo), None)

    def silo_checks(self, n: int) -> list[tuple[bool, str]]:
        """``(ok, why)`` for every silo the section names, against the ``n`` silos there are."""

        def bad(key: str, silo: int) -> str:
            return f"{key}={silo} is not a silo (0..{n - 1})"

        b = self.backdoor
        out = [(s < n, bad(f"lab.exclude[{i}]", s)) for i, s in enumerate(self.exclude)]
        out += [
            (0 <= x.silo < n, bad(f"lab.exclude_samples[{i}].silo", x.silo))
            for i, x in enumerate(self.exclude_samples)
        ]
        out += [
            (f.silo < n, bad(f"lab.faults[{i}].silo", f.silo)) for i, f in enumerate(self.faults)
        ]
        out += [(not b.enabled or b.silo < n, bad("lab.backdoor.silo", b.silo))]
        out += [
            (
                b.relearn_silo is None or b.relearn_silo < n,
                bad("lab.backdoor.relearn_silo", b.relearn_silo or 0),
            )
        ]
        return out
