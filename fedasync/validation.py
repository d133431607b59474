"""Checks of an incoming update that need only its tensors (no network, no metadata store).

Papers: none for the structural checks. The norm-outlier rule (reject a delta whose L2 norm
exceeds ``factor`` × the median of recently accepted norms) is a simple robust filter in the
spirit of norm bounding against faulty/poisoned updates (Sun et al. 2019, "Can you really
backdoor federated learning?"); departure: we reject instead of clipping, and use a rolling
median rather than a fixed bound.

The :class:`RejectReason` enum is the shared vocabulary for every rejection (including ones
decided elsewhere, e.g. ``TOO_STALE`` by :class:`fedasync.staleness.StalenessBound`).
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from fedasync.types import Params


class RejectReason(enum.StrEnum):
    """Why an update was rejected; a ``str`` (``str(r)`` and JSON give the value, e.g. "too_stale")."""

    NON_FINITE = "non_finite"
    UNEXPECTED_TENSOR = "unexpected_tensor"
    MISSING_TENSOR = "missing_tensor"
    SHAPE_MISMATCH = "shape_mismatch"
    DTYPE_MISMATCH = "dtype_mismatch"
    FUTURE_VERSION = "future_version"
    TOO_STALE = "too_stale"
    UNKNOWN_SILO = "unknown_silo"
    DUPLICATE = "duplicate"
    NORM_OUTLIER = "norm_outlier"
    CLIENT_ERROR = "client_error"
    MALFORMED = "malformed"
    ERASED = "erased"
    """Work computed on data that is being, or has been, erased."""
    CROSSED_BOUNDARY = "crossed_boundary"
    """Work based on a version before an erasure boundary, under the drop rule."""


@dataclass(frozen=True)
class Rejection:
    """Why an update was rejected; ``detail`` is a human-readable, loggable sentence."""

    reason: RejectReason
    detail: str


def check_tensors(
    tensors: Params, reference: Params, *, check_finite: bool = True
) -> Rejection | None:
    """Structural check of ``tensors`` against ``reference`` (e.g. the global params).

    In order: every value is a tensor (MALFORMED); no name absent from the reference
    (UNEXPECTED_TENSOR, first in ``tensors``' order); no reference name missing
    (MISSING_TENSOR, first in ``reference``' order); then per reference name: equal shape
    (SHAPE_MISMATCH); floating where the reference is floating and non-floating where it is
    not (DTYPE_MISMATCH; float precision may differ, e.g. bf16 vs fp32); all finite
    (NON_FINITE; skipped with ``check_finite=False`` for callers that learn it from a norm
    they compute anyway). Returns ``None`` when the update passes.
    """
    if not isinstance(tensors, dict):
        return Rejection(
            RejectReason.MALFORMED, f"expected a dict of tensors, got {type(tensors).__name__}"
        )
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            return Rejection(
                RejectReason.MALFORMED, f"{name!r} is a {type(t).__name__}, not a tensor"
            )
    for name in tensors:
        if name not in reference:
            return Rejection(RejectReason.UNEXPECTED_TENSOR, f"unexpected tensor {name!r}")
    for name in reference:
        if name not in tensors:
            return Rejection(RejectReason.MISSING_TENSOR, f"missing tensor {name!r}")
    for name, ref in reference.items():
        t = tensors[name]
        if t.shape != ref.shape:
            return Rejection(
                RejectReason.SHAPE_MISMATCH,
                f"{name!r} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}",
            )
        if t.is_floating_point() != ref.is_floating_point():
            return Rejection(
                RejectReason.DTYPE_MISMATCH, f"{name!r} has dtype {t.dtype}, expected {ref.dtype}"
            )
        if check_finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return Rejection(RejectReason.NON_FINITE, f"{name!r} holds NaN or inf")
    return None


class NormOutlierDetector:
    """Reject update norms far above the median of recently accepted ones.

    ``check(norm)`` rejects when norm > ``factor`` × median(last ``window`` observed norms),
    once at least ``min_history`` norms were observed; a non-finite norm is always rejected.
    Call ``observe(norm)`` for each update you accept. Norms are L2 (e.g.
    :func:`fedasync.tensors.global_norm` of a delta), in parameter units.
    """

    def __init__(self, factor: float = 10.0, window: int = 50, min_history: int = 3) -> None:
        if factor <= 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if min_history < 1:
            raise ValueError(f"min_history must be >= 1, got {min_history}")
        self.factor = factor
        self.window = window
        self.min_history = min_history
        self._history: deque[float] = deque(maxlen=window)

    @property
    def history(self) -> list[float]:
        """Observed norms, oldest first (at most ``window``)."""
        return list(self._history)

    def threshold(self) -> float | None:
        """Current rejection threshold, or ``None`` while the history is too short."""
        if len(self._history) < self.min_history:
            return None
        return self.factor * statistics.median(self._history)

    def check(self, norm: float) -> Rejection | None:
        """``None`` to accept, or a NON_FINITE / NORM_OUTLIER rejection."""
        if not math.isfinite(norm):
            return Rejection(RejectReason.NON_FINITE, f"update norm is {norm}")
        limit = self.threshold()
        if limit is not None and norm > limit:
            median = limit / self.factor
            return Rejection(
                RejectReason.NORM_OUTLIER,
                f"norm {norm:.6g} > {self.factor:g} x median {median:.6g} of last "
                f"{len(self._history)} accepted",
            )
        return None

    def observe(self, norm: float) -> None:
        """Record the norm of an accepted update."""
        if not math.isfinite(norm):
            raise ValueError(f"cannot observe a non-finite norm {norm}")
        self._history.append(float(norm))

    def state_dict(self) -> dict[str, Any]:
        """Config and the norm history."""
        return {
            "factor": self.factor,
            "window": self.window,
            "min_history": self.min_history,
            "history": list(self._history),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the history bounded by the restored ``window``)."""
        self.factor = float(d["factor"])
        self.window = int(d["window"])
        self.min_history = int(d["min_history"])
        self._history = deque((float(x) for x in d["history"]), maxlen=self.window)
