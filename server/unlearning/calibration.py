"""The invariance calibration of training after an erasure (AFU-IC style; docs/erasure.md).

Owns: the erased data's merged gradient signature, each applied erasure's jump and forget
gradient (the one-sided directions), the latest erasure boundary, and the window of recent
accepted updates' span (a bounded sketch, `fedasync.unlearning.SpanSketch`, for
``lab.erasure.signature_unique`` and ``server_removal_part=unique``); all of it in its
``state_dict``. From the boundary B on every accepted update is calibrated: projected
out of the signature subspace, so that neither other silos' data nor stale work can pull the
model back along the erased data's directions (``calibrate``, on the update as it came;
``project``, on the change a fold makes to the model, ``calibration_target=applied``). Work
based before B is projected (rule ``project``) or dropped (rule ``drop``).

It does not know the request lifecycle: the erasure coordinator (lifecycle.py) hands it the
erasure's signature, jump and gradient when one is applied (``protect``), and tells it which
updates to refuse outright (``refuses``: a retired or erasing silo's). ``NoCalibration`` is
the calibration of a run that cannot erase: every update passes as it is.

Each projection returns the share of the change's norm that lay in the signature subspace
(the ``calibration_overlap`` the loop logs with an update; None: not projected).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fedasync import Params, Rejection, RejectReason
from fedasync.unlearning import (
    ErasureJump,
    ForgetGradient,
    GradientSignature,
    OneSided,
    SpanSketch,
    block_one_sided,
)
from server.config_lab import ErasureLab

if TYPE_CHECKING:
    from server.config import UnlearningConfig
    from server.corrections import Project
    from server.intake import Job
    from server.unlearning.requests import Erasure

log = logging.getLogger("fedasync.server")

PROTECTS: dict[str, frozenset[str]] = {
    "subspace": frozenset({"subspace"}),
    "jump": frozenset({"jump"}),
    "both": frozenset({"subspace", "jump"}),
    "gradient": frozenset({"gradient"}),
    "onesided": frozenset({"jump", "gradient"}),
}
"""What each ``lab.erasure.protect`` holds a change to (server.config.Protect's choices)."""

Calibrated = tuple[Params | Rejection, float | None]
"""A calibrated update (or why it is refused) and its overlap with the signature."""


class UpdateCalibration(Protocol):
    """What the server loop asks of the calibration (``Calibration`` or ``NoCalibration``)."""

    @property
    def projects_applied(self) -> bool:
        """Whether folds' changes to the model are projected (``project``)."""
        ...

    def calibrate(self, job: Job, tensors: Params, norm: float | None = None) -> Calibrated:
        """One accepted update calibrated (or refused), and its overlap (``norm``: its L2
        norm, when the intake measured it)."""
        ...

    def project(self, change: Params) -> Params:
        """``change`` to the model calibrated."""
        ...

    def project_measured(self, change: Params) -> tuple[Params, float | None]:
        """``change`` calibrated, and the share of it that lay in the signature subspace."""
        ...

    def compensates(self, job: Job) -> bool:
        """Whether delay compensation may use ``job``'s base weights."""
        ...


class NoCalibration:
    """The calibration of a run that cannot erase: every update passes as it is."""

    projects_applied = False

    def calibrate(self, job: Job, tensors: Params, norm: float | None = None) -> Calibrated:
        """``tensors`` unchanged, not measured."""
        return tensors, None

    def project(self, change: Params) -> Params:
        """``change`` unchanged."""
        return change

    def project_measured(self, change: Params) -> tuple[Params, float | None]:
        """``change`` unchanged, not measured."""
        return change, None

    def compensates(self, job: Job) -> bool:
        """Always: there is no erasure boundary to cross."""
        return True


def _refuses_none(job: Job) -> Rejection | None:
    return None


def carries_nothing(silo: str, project: Project) -> int:
    """A server that carries nothing past an erasure boundary: nothing dropped."""
    return 0


class Calibration:
    """The erased data's signature and directions, and the calibration of later updates."""

    def __init__(
        self,
        cfg: UnlearningConfig,
        *,
        lab: ErasureLab | None = None,
        refuses: Callable[[Job], Rejection | None] = _refuses_none,
        at_boundary: Callable[[str, Project], int] = carries_nothing,
        silos: int = 1,
    ):
        """``lab``: the erasure's ablation settings (``lab.erasure``; None: the defaults);
        ``silos``: how many silos the federation has (the sketch's groups); ``refuses``: the coordinator's refusal of an update before it is calibrated (its
        silo's data is under erasure); ``at_boundary``: what the server carries past an
        erasure of a silo (the pipeline's buffer, moment and residuals) calibrated by a
        projection, returning how many buffered updates of that silo it dropped."""
        self.cfg = cfg
        self.lab = lab = ErasureLab() if lab is None else lab
        self.refuses = refuses
        self.at_boundary = at_boundary
        self.signature: GradientSignature | None = None
        self.jumps: list[ErasureJump] = []
        """Each applied erasure's jump (``lab.erasure.protect`` jump, both or onesided)."""
        self.gradients: list[ForgetGradient] = []
        """Each applied erasure's mean forget gradient, as its silo sent it
        (``lab.erasure.protect`` gradient or onesided)."""
        spans = lab.signature_unique or (lab.server_removal and lab.server_removal_part == "unique")
        self.sketch: SpanSketch | None = SpanSketch(int(lab.sketch_rank), silos) if spans else None
        """``lab.erasure.signature_unique`` or ``server_removal_part=unique``: the span of the
        accepted updates as folded, by silo, in ``sketch_rank`` model-sized rows: what the
        other silos' data moves the model along. Checkpointed (``state_dict``), so a resumed
        server has the same sketch as before the restart."""
        self.boundary = -1
        """The version of the latest erasure boundary (-1: none yet)."""

    # -------------------------------------------------------------- updates
    def calibrate(self, job: Job, tensors: Params, norm: float | None = None) -> Calibrated:
        """Calibrate one accepted train update (or reject it) before it is folded; with the
        share of the update's norm that lay in the erased data's signature subspace before
        the projection (None: uncalibrated). ``norm``: the update's L2 norm, when the intake
        measured it. (The span sketch takes the update as folded, in the fold's own pass:
        server/unlearning/sinks.py.)"""
        refused = self.refuses(job)
        if refused is not None:
            return refused, None
        if job.base_version < self.boundary and self.lab.pre_boundary == "drop":
            return Rejection(  # with or without calibration: drop-all-stale is its own policy
                RejectReason.CROSSED_BOUNDARY,
                f"base version {job.base_version} precedes the erasure boundary {self.boundary}",
            ), None
        if self.signature is None or not self.lab.calibration:
            return tensors, None
        if self.lab.calibration_target == "applied":
            return tensors, None  # what the fold applies is projected instead (``project``)
        overlap = self.signature.overlap(tensors)
        return self.signature.project_out(tensors, strength=self.lab.calibration_strength), overlap

    @property
    def projects_applied(self) -> bool:
        """Whether folds' changes to the model are projected (``calibration_target=applied``,
        with a signature or an erasure jump to protect)."""
        if not self.lab.calibration or self.lab.calibration_target != "applied":
            return False
        return self._subspace is not None or bool(self._one_sided)

    @property
    def _protects(self) -> frozenset[str]:
        """What the calibration holds changes to: ``subspace``, ``jump``, ``gradient`` (by
        ``lab.erasure.protect``; a reply, ``calibration_target=reply``, is only ever projected
        out of the signature)."""
        if self.lab.calibration_target != "applied":
            return frozenset({"subspace"})
        return PROTECTS[self.lab.protect]

    @property
    def _subspace(self) -> GradientSignature | None:
        return self.signature if "subspace" in self._protects else None

    @property
    def _one_sided(self) -> list[OneSided]:
        """The one-sided directions the calibration holds changes to: the erasures' jumps and
        forget gradients, as ``_protects`` says."""
        protects = self._protects
        jumps = self.jumps if "jump" in protects else []
        grads = self.gradients if "gradient" in protects else []
        return [*jumps, *grads]

    def project(self, change: Params) -> Params:
        """``change`` calibrated (``project_measured``, without the overlap)."""
        return self.project_measured(change)[0]

    def project_measured(self, change: Params) -> tuple[Params, float | None]:
        """``change`` (to the model, or a direction the server carries) calibrated by
        ``lab.erasure.protect``: projected out of the erased data's signature, and/or without
        its component moving back along each erasure's jump or lowering its forget loss
        (one-sided; with several directions the nearest change that goes against none,
        `fedasync.unlearning.block_one_sided`); with the share of it that lay in the
        signature (None: no signature is protected)."""
        sig, overlap = self._subspace, None
        if sig is not None:
            overlap = sig.overlap(change)
            change = sig.project_out(change, strength=self.lab.calibration_strength)
        return block_one_sided(change, self._one_sided), overlap

    def compensates(self, job: Job) -> bool:
        """Whether delay compensation may use ``job``'s base weights: not across an erasure
        boundary when the applied change is calibrated (w_now − w_base would hold the erasure
        itself, and compensating would pull the model back toward the pre-erasure one)."""
        applied = self.lab.calibration and self.lab.calibration_target == "applied"
        return not (applied and job.base_version < self.boundary)

    # -------------------------------------------------------------- an erasure applied
    def protect(
        self,
        erasure: Erasure,
        old: Params,
        new: Params,
        sig: GradientSignature | None,
        gradient: ForgetGradient | None,
    ) -> dict[str, float]:
        """An erasure moves the model from ``old`` to ``new``: hold later changes to what
        ``lab.erasure.protect`` says (its signature merged in, its jump, its forget gradient)
        and calibrate what the server carries past it. Returns what the calibrating event
        says of what is protected (``signature_unique``'s share removed; whether a forget
        gradient came)."""
        protects = self._protects
        kept: dict[str, float] = {}
        if sig is not None and self.lab.signature_unique:
            sig, kept = self._unique(erasure, sig)
        if sig is not None:
            self.signature = sig if self.signature is None else self.signature.merge(sig)
        jump = ErasureJump.between(old, new) if "jump" in protects else None
        if jump is not None:
            self.jumps.append(jump)
        if "gradient" in protects:
            kept["forget_gradient"] = float(gradient is not None)
            if gradient is not None:
                self.gradients.append(gradient)
            else:
                log.warning(
                    "erasure %s: lab.erasure.protect=%s but silo %d sent no forget gradient "
                    "(an older silo, or FedEraser): it is not protected against",
                    erasure.request_id,
                    self.lab.protect,
                    erasure.silo,
                )
        if self.projects_applied:  # what the server carries past the boundary, calibrated
            dropped = self.at_boundary(str(erasure.silo), self.project)
            log.info(
                "erasure %s: %d buffered update(s) of silo %d dropped; the buffer, the server "
                "optimiser's moment and error-feedback residuals projected",
                erasure.request_id,
                dropped,
                erasure.silo,
            )
        return kept

    def removed(self, erasure: Erasure, old: Params, new: Params) -> None:
        """The server's removal moved the model from ``old`` to ``new`` ahead of the silo's
        reply: from now on later changes may not move back along it (``protect`` jump, both
        or onesided) and what the server carries past it is calibrated. The signature and the
        forget gradient come with the silo's reply (``protect``)."""
        jump = ErasureJump.between(old, new) if "jump" in self._protects else None
        if jump is not None:  # (None: the removal moved nothing)
            self.jumps.append(jump)
        if self.projects_applied:
            dropped = self.at_boundary(str(erasure.silo), self.project)
            log.info(
                "erasure %s: the server's removal in force; %d buffered update(s) of silo %d "
                "dropped, what the server carries projected",
                erasure.request_id,
                dropped,
                erasure.silo,
            )

    def _unique(
        self, erasure: Erasure, sig: GradientSignature
    ) -> tuple[GradientSignature | None, dict[str, float]]:
        """``lab.erasure.signature_unique``: ``sig`` without the span of the other silos'
        recent accepted updates (the sketch's rows no update of the erasing silo went into;
        `GradientSignature.without`; None: nothing of it is unique), and what that did:
        ``signature_shared``, the share of the signature in that span
        (`GradientSignature.share_in`), the ranks before and after, and the span's rank."""
        sketch = self.sketch
        if sketch is None or not sketch.covers(sig.names):
            return sig, {"signature_shared": 0.0, "unique_span_rank": 0.0}
        span = sketch.span(sig.names, without=erasure.silo)
        shared = sig.share_in(span)
        unique = sig.without(span)
        report = {
            "signature_shared": shared,
            "signature_rank_sent": float(sig.rank),
            "signature_rank_unique": float(0 if unique is None else unique.rank),
            "unique_span_rank": float(span.rank),
        }
        log.info(
            "erasure %s: %.1f%% of its signature lies in the rank-%d span of other silos' "
            "recent updates; rank %d -> %d",
            erasure.request_id,
            100 * shared,
            span.rank,
            sig.rank,
            0 if unique is None else unique.rank,
        )
        return unique, report

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The signature, the one-sided directions, the boundary and the sketch."""
        return {
            "jumps": [j.state_dict() for j in self.jumps],
            "gradients": [g.state_dict() for g in self.gradients],
            "sketch": None if self.sketch is None else self.sketch.state_dict(),
            "signature": None if self.signature is None else self.signature.state_dict(),
            "boundary": self.boundary,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.jumps = [ErasureJump.from_state(j) for j in d.get("jumps", [])]
        self.gradients = [ForgetGradient.from_state(g) for g in d.get("gradients", [])]
        if self.sketch is not None and d.get("sketch") is not None:
            self.sketch.load_state_dict(d["sketch"])  # (absent: the sketch starts empty)
        if d["signature"] is not None:
            self.signature = GradientSignature(basis=torch.zeros(0, 0), names=[])
            self.signature.load_state_dict(d["signature"])
        self.boundary = int(d["boundary"])
