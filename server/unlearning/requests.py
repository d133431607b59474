"""What the erasure parts share: one request in progress as the server tracks it
(``Erasure``) and what they are given of the server: its model (``ServedModel``), its silos'
jobs (``SiloJobs``) and the run's values (``ErasureRun``). The erasure part of a run
that cannot erase is no_erasure.py's ``NoErasure``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fedasync import Params
from fedasync.erasure_metrics import reversion_ratio

if TYPE_CHECKING:
    from fedasync.clock import Clock
    from fedasync.events import EventLog
    from server.config import FedAsyncConfig
    from server.corrections import Project
    from server.intake import Job

WENT_DOWN = "silo went down mid-erasure"
"""Audit detail of an erasing -> queued that counts against ``lifecycle.MAX_ATTEMPTS``."""
WENT_OFFLINE = "silo went offline mid-erasure"
"""Audit detail of an erasing -> queued that does not (the SuperLink reported it offline)."""


class ServedModel(Protocol):
    """The model an erasure changes: its newest version and weights, making new weights the
    newest version (a removal, a boundary, a step of a removal's rest), and a checkpoint of the
    run with it. The server loop is one; a test may pass another."""

    @property
    def version(self) -> int:
        """The newest model's version."""
        ...

    @property
    def params(self) -> Params:
        """The newest model's weights."""
        ...

    def apply_erasure(self, params: Params) -> None:
        """Make ``params`` the newest version; no model from before it is kept."""
        ...

    def checkpoint(self) -> None:
        """Write a checkpoint now."""
        ...


class SiloJobs(Protocol):
    """The silos' jobs as an erasure sees them: which silo is busy or down, and the sends and
    the cancel an erasure asks for. The server loop is one; a test may pass another."""

    @property
    def inflight(self) -> Mapping[str, Job]:
        """The jobs in flight, by message id."""
        ...

    def holding(self, silo: int) -> str | None:
        """Why ``silo`` may not be sent work now (None: it is idle)."""
        ...

    def is_down(self, silo: int) -> bool:
        """Whether ``silo`` waits out a failure."""
        ...

    def release(self, silo: int) -> None:
        """``silo`` may train again: sent work now, or at the strategy's next round."""
        ...

    def dispatch_unlearn(self, silo: int, start: Params, erasure: Any) -> bool:
        """Send ``silo`` an erasure; False when refused."""
        ...

    def cancel_for_erasure(self, silo: int, request_id: str) -> bool:
        """Cancel ``silo``'s training job in flight; True when it is idle now."""
        ...

    def dispatch_calibration(self, silo: int, start: Params, steps: int, erasure: Any) -> bool:
        """Send ``silo`` FedEraser calibration training; False when refused."""
        ...


def _no_ids(silo: int) -> list[str]:
    return []


def _none_accepted(t0: float, t1: float) -> int:
    return 0


def _no_threshold() -> float | None:
    return None


@dataclass(frozen=True)
class ErasureRun:
    """What the erasure coordinator is given of its run, as values: the config, the clock, the
    event log, the silos (``roster``, silo -> node id, and ``num_samples``: mappings the loop
    fills in place once the nodes are known), and what it reads of the server's parts:

    - ``score``: a model's score on the server's held-out set (the removal's bound);
    - ``sample_ids``: the sample ids a silo holds (empty where the server holds no silo data);
    - ``accepted_between``: the updates accepted in the clock interval ``(t0, t1]``;
    - ``norm_threshold``: the accepted-update norm outlier threshold now (None: not enough
      updates yet), one of an erasure delta's bounds;
    - ``at_boundary``: the calibration of what the server carries past an erasure boundary
      (the correction pipeline's; None: it carries nothing);

    and the strategy's erasure policy: ``halts`` (no silo trains while an erasure is carried
    out) and ``rebuilds`` (an erasure is FedEraser's rebuild without the silo)."""

    cfg: FedAsyncConfig
    clock: Clock
    events: EventLog
    roster: Mapping[int, int]
    num_samples: Mapping[int, int]
    score: Callable[[Params], float]
    sample_ids: Callable[[int], list[str]] = _no_ids
    accepted_between: Callable[[float, float], int] = _none_accepted
    norm_threshold: Callable[[], float | None] = _no_threshold
    at_boundary: Callable[[str, Project], int] | None = None
    halts: bool = False
    rebuilds: bool = False


@dataclass
class Erasure:
    """What the server tracks of one request in progress."""

    request_id: str
    silo: int
    sample_ids: list[str]  # empty = whole silo
    submitted_t: float
    started_t: float | None = None
    submitted_wall_ms: int | None = None
    """Set when ``submitted_t`` is unknown (submitted before a restart, on the virtual
    clock): the request's wall-clock submit time; ``row`` then reports wall-clock latency."""
    removal: Params | None = None
    """What the server adds to the model for it (minus the silo's recorded contributions'
    persisting part) until that is in force (`ErasureCoordinator._remove_now`); then None."""
    removed_version: int | None = None
    """The version at which the server's removal came into force (None: none, or not yet)."""
    removed_t: float | None = None
    """When it did (the server's clock)."""
    boundary: int | None = None
    applied_t: float | None = None
    metrics_at_boundary: dict[str, float] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)
    """unlearning.* values this erasure is sent instead of the config's (its scaled size)."""
    start_report: dict[str, Any] = field(default_factory=dict)
    """What the ``erasing`` event says of the erasure's scope and size."""
    around_boundary: tuple[Params, Params] | None = None
    """(w_pre, w_B): the model just before the erasure (before the server's removal, when
    there is one) and just after its boundary, for the reversion ratio at verification (not
    checkpointed: after a restart it is not reported)."""
    pre_erasure: Params | None = None
    """The model just before the server's removal, until the boundary (not checkpointed)."""

    def measure(self, params: Params, verify_fn: Any) -> dict[str, float]:
        """The verification metrics of ``params`` for this erasure (``verify_fn``), with how
        far it went back toward the pre-erasure model (``reversion_ratio``; not after a
        restart)."""
        metrics = verify_fn(params, self.silo, self.sample_ids)
        if self.around_boundary is not None:
            w_pre, w_b = self.around_boundary
            metrics["reversion_ratio"] = reversion_ratio(params, w_b, w_pre)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of an applied erasure (one calibrating)."""
        return {
            "silo": self.silo,
            "sample_ids": self.sample_ids,
            "boundary": self.boundary,
            "submitted_t": self.submitted_t,
            "submitted_wall_ms": self.submitted_wall_ms,
            "started_t": self.started_t,
            "applied_t": self.applied_t,
            "removed_version": self.removed_version,
            "removed_t": self.removed_t,
            "metrics": self.metrics_at_boundary,
        }

    @classmethod
    def from_state(cls, request_id: str, c: dict[str, Any]) -> Erasure:
        """The applied erasure ``request_id`` as ``state_dict`` returned it."""
        return cls(
            request_id,
            c["silo"],
            c["sample_ids"],
            c["submitted_t"],
            started_t=c["started_t"],
            submitted_wall_ms=c.get("submitted_wall_ms"),  # absent in older checkpoints
            boundary=c["boundary"],
            applied_t=c["applied_t"],
            removed_version=c.get("removed_version"),  # absent in older checkpoints
            removed_t=c.get("removed_t"),
            metrics_at_boundary=c["metrics"],
        )


def add_floats(a: Params, b: Params) -> Params:
    """``a + b`` on ``a``'s floating tensors. Unlike ``fedasync.tensors.add``, ``b`` may hold
    only the floating tensors (the ledger records nothing else)."""
    return {k: (a[k] + b[k]) if a[k].is_floating_point() else a[k] for k in a}
