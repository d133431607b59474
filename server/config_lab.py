"""The config's ``lab`` section: the benchmarks' and the tests' instruments, apart from the
settings a user decides.

A backdoor planted in one silo's data (``lab.backdoor``), the erasure's ablations and the
halting FedEraser baseline's settings (``lab.erasure``), faults injected into silos
(``lab.faults``), silos or shares of their samples left out (``lab.exclude``,
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
    CalibrationTarget,
    PreBoundary,
    Protect,
    RadiusScaling,
    RemovalPart,
)
from server.config_ranges import RANGES

TriggerPattern = Literal["solid", "checker", "blend"]
"""``lab.backdoor.trigger_pattern``: medical_data.backdoor.PATTERNS (tests/test_config_types.py
checks the two agree; importing it here would load MONAI into every config reader)."""
FaultKind = Literal[
    "crash", "nan", "wrong_shape", "replay", "huge_norm", "future_version", "unknown_silo"
]
"""``lab.faults[].kind``."""

TRIGGER_PATTERNS: tuple[str, ...] = choices(TriggerPattern)
FAULT_KINDS: tuple[str, ...] = choices(FaultKind)

if not TYPE_CHECKING:  # what omegaconf sees: a str carrying its Literal (server/config.py)
    TriggerPattern, FaultKind = (Annotated[str, t] for t in (TriggerPattern, FaultKind))


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
    benchmark's watch between a boundary and its check (``watch_every``); and the halting
    FedEraser baseline's two settings (``server.mode=federaser``)."""

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
    ``unlearning.service=true``: each node watches its silo's requests there and stops the job
    between two local steps (``fedasync node --erasure-service``); without the service the node
    finishes the job before it pulls the erasure's message, so the erasure waits for it."""
    watch_every: int = 0
    """Between the boundary and the verification, verify the erased model every this many
    versions (an ``erasure_watch`` event with the verification metrics and the reversion
    ratio): the resurfacing of erased influence over time. 0: only at the two ends."""
    server_removal_part: RemovalPart = "unique"
    """With ``server_removal``: which part of the silo's recorded contributions is subtracted.
    ``total``: all of it (FedEraser's first-order removal). ``unique``: only what lies outside
    the span of the other silos' recent accepted updates (``unlearning.sketch_rank``), the
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
    signature_unique: bool = False
    """At the boundary, remove from the erased data's signature the span of the other silos'
    recent accepted updates (``unlearning.sketch_rank``), keeping only directions unique to the
    erased data (SFU-style, Li et al. 2023); how much it removed is in the ``calibrating`` event."""
    pre_boundary: PreBoundary = "project"
    """Other silos' work based before the erasure boundary: project (calibrate it, when
    ``calibration`` is on) or drop it (whether or not it is on)."""
    radius_scaling: RadiusScaling = "linear"
    """How a sample-level erasure's size (PGA radius, relabel steps) follows its share of the
    silo's samples: linear (max(share, radius_floor)), sqrt (max(sqrt(share), radius_floor)) or
    none (the full size for any erasure)."""
    radius_floor: float = 0.01
    """The smallest share of the full size a sample-level erasure gets."""
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


@dataclass
class LabConfig:
    """The benchmarks' and the tests' instruments, never product settings (a hospital's node
    refuses a backdoor, a fault or an emulated speed; server/config_lab.py's docstring)."""

    backdoor: BackdoorConfig = field(default_factory=BackdoorConfig)
    erasure: ErasureLab = field(default_factory=ErasureLab)
    faults: list[FaultConfig] = field(default_factory=list)
    """Injected faults (robustness runs): each silo misbehaves as its entry says."""
    exclude: list[int] = field(default_factory=list)
    """Silos that never train (retraining from scratch without their data)."""
    exclude_samples: list[SampleShare] = field(default_factory=list)
    """Seeded shares of silos' samples that are never trained on: retraining from scratch
    without the samples a sample-level erasure of the same share erases (the same seeded
    choice as ``erasures[].fraction``, server/unlearning/lifecycle.py ``_fraction_ids``)."""
    emulate_speed: bool = False
    """Wall clock (deployment on one machine): each silo waits after training so that its
    message takes 1/speed as long as its training did, making the speed profile real."""

    def __post_init__(self) -> None:
        """Checked when built: ranges, the fault kinds, and that no silo's share is listed
        twice (which silos exist: FedAsyncConfig)."""
        for rkey, key, value in numeric_values(self, "lab."):
            if not rkey.startswith(("lab.backdoor.", "lab.erasure.")):  # (checked there)
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
