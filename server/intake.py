"""Intake of one reply: decode, validate and turn it into a core ``Update`` or a rejection.

Everything a silo sends is untrusted. A reply is rejected (with a reason that is logged and
counted, and without touching the global model) when it is a client error, malformed, claims
an unknown silo or another node's silo, replays an earlier job, claims a base version from the
future or other than the one it was sent, has the wrong tensor names, shapes or dtypes,
contains NaN/Inf, is staler than the bound, or has a norm far beyond the others'.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from flwr.app import Message

from fedasync import (
    BoundDecision,
    FutureVersionError,
    NormOutlierDetector,
    Params,
    Rejection,
    RejectReason,
    StalenessBound,
    Update,
    check_tensors,
    staleness,
)
from fedasync.flat import FlatParams, as_flat
from fedasync.flat import same as same_layout
from fedasync.tensors import global_norm
from protocol.messages import TrainRefusal, TrainReply, read_train_reply
from protocol.reading import ErrorReply, Malformed
from server.config import ServerConfig
from server.config_lab import LabConfig


class JobKind(StrEnum):
    """What a job in flight carries out on its silo."""

    TRAIN = "train"
    """Regular local training."""
    UNLEARN = "unlearn"
    """An erasure running on the silo."""
    CALIBRATE = "calibrate"
    """FedEraser's calibration training (the halting baseline's rebuild)."""


@dataclass
class Job:
    """A train message in flight."""

    msg_id: str
    silo: int
    node_id: int
    job_id: int
    base_version: int
    dispatched_at: float
    finishes_at: float
    wall_sent: float
    fault: str = ""
    kind: JobKind = JobKind.TRAIN
    erasure: Any = None
    """For unlearn jobs: the server.unlearning.Erasure it carries out."""
    work: tuple[float, float] | None = None
    """Virtual clock, a job whose length its silo decides (an erasure that stops by itself):
    the least and the most work it can take. Scheduled to finish after the least; its reply's
    reported work moves it to its real finish (``Dispatcher.settle``)."""


@dataclass
class Accepted:
    """A reply that passed intake: its update, staleness, the bound's decision, its L2 norm."""

    update: Update
    staleness: int
    decision: BoundDecision
    norm: float


def read_reply(reply: Message) -> TrainReply | TrainRefusal | Rejection:
    """The update or refusal ``reply`` holds, read once (protocol/messages.py); a
    ``client_error`` rejection for an error reply (the ClientApp raised, the node went
    offline, the message expired), ``malformed`` for anything the protocol refuses."""
    try:
        return read_train_reply(reply)
    except ErrorReply as e:
        return Rejection(RejectReason.CLIENT_ERROR, e.last_line)
    except Malformed as e:
        return Rejection(RejectReason.MALFORMED, str(e))


def take_reply(
    reply: Message,
    job: Job,
    *,
    version: int,
    reference: Params,
    roster: Mapping[int, int],
    bound: StalenessBound,
    norms: NormOutlierDetector,
) -> Accepted | Rejection:
    """``read_reply`` then ``check_reply`` (a refusal is not an update: malformed here)."""
    got = read_reply(reply)
    if isinstance(got, Rejection):
        return got
    if isinstance(got, TrainRefusal):
        return Rejection(RejectReason.MALFORMED, "a refusal, not an update")
    return check_reply(
        got, job, version=version, reference=reference, roster=roster, bound=bound, norms=norms
    )


def check_reply(
    reply: TrainReply,
    job: Job,
    *,
    version: int,
    reference: Params,
    roster: Mapping[int, int],
    bound: StalenessBound,
    norms: NormOutlierDetector,
) -> Accepted | Rejection:
    """Validate the update ``reply`` to ``job`` against the current ``version`` and parameters
    ``reference``. ``roster`` maps silo id -> node id. The norm detector only learns from
    accepted updates."""
    claimed_silo, claimed_job, claimed_base = reply.silo, reply.job_id, reply.base_version
    num_samples = reply.num_samples
    if claimed_silo not in roster:
        return Rejection(RejectReason.UNKNOWN_SILO, f"silo {claimed_silo} is not in the roster")
    if roster[claimed_silo] != job.node_id or claimed_silo != job.silo:
        return Rejection(
            RejectReason.UNKNOWN_SILO,
            f"node of silo {job.silo} claims to be silo {claimed_silo}",
        )
    if claimed_job != job.job_id:
        return Rejection(
            RejectReason.DUPLICATE,
            f"reply to job {job.job_id} carries job {claimed_job} (replayed)",
        )
    try:
        staleness(version, claimed_base)
    except FutureVersionError:
        return Rejection(
            RejectReason.FUTURE_VERSION,
            f"base version {claimed_base} is ahead of the server's {version}",
        )
    except ValueError as e:
        return Rejection(RejectReason.MALFORMED, str(e))
    if claimed_base != job.base_version:
        return Rejection(
            RejectReason.MALFORMED,
            f"base version {claimed_base} is not the {job.base_version} the job was sent",
        )
    if num_samples < 1:
        return Rejection(RejectReason.MALFORMED, f"num-samples {num_samples} < 1")
    tensors = reply.delta
    if not same_layout(tensors, reference):  # (same layout: same names, shapes and dtypes)
        bad = check_tensors(tensors, reference, check_finite=False)
        if bad is not None:
            return bad
    tau = staleness(version, job.base_version)
    decision = bound.check(tau)
    if decision.action == "reject":
        return Rejection(RejectReason.TOO_STALE, decision.reason)
    # one pass over the update (per buffer of a decoded FlatParams): the norm is non-finite
    # iff some entry is (or it overflowed)
    norm = global_norm(tensors)
    if not math.isfinite(norm):
        bad = check_tensors(tensors, reference)
        return bad or Rejection(RejectReason.NORM_OUTLIER, f"update norm {norm} overflows")
    outlier = norms.check(norm)
    if outlier is not None:
        return outlier
    norms.observe(norm)
    if isinstance(reference, FlatParams):  # e.g. bf16 from a silo, or not packed: the
        tensors = as_flat(tensors, like=reference)  # corrections run on the server's layout
    update = Update(
        silo=str(job.silo),
        base_version=job.base_version,
        tensors=tensors,
        num_samples=num_samples,
        kind="delta",
        metrics={k: v for k, v in reply.metrics.items() if k.startswith("train_")},
    )
    return Accepted(update, tau, decision, norm)


NORM_OUTLIER_FACTOR = 10.0
"""An update whose norm exceeds this multiple of the median accepted norm is rejected. A
constant, not a setting: a guard against a broken or hostile update, far from any honest
update's norm, that no run has tuned."""


class Intake:
    """The server's intake: the staleness bound and the norm detectors ``take_reply`` uses.

    FedEraser's calibration replies have a norm detector of their own (their norms are of
    shorter training, and they must not teach the regular detector). ``state_dict`` holds
    both detectors (the bound has no state).
    """

    def __init__(self, s: ServerConfig, lab: LabConfig):
        self.bound = StalenessBound(s.max_staleness, lab.soft_staleness, lab.soft_factor)
        self.norms = NormOutlierDetector(factor=NORM_OUTLIER_FACTOR)
        self.calibration_norms = NormOutlierDetector(factor=NORM_OUTLIER_FACTOR)

    def check(
        self,
        reply: TrainReply,
        job: Job,
        *,
        version: int,
        reference: Params,
        roster: Mapping[int, int],
    ) -> Accepted | Rejection:
        """``check_reply`` with this intake's bound and the detector for ``job``'s kind."""
        norms = self.calibration_norms if job.kind is JobKind.CALIBRATE else self.norms
        return check_reply(
            reply,
            job,
            version=version,
            reference=reference,
            roster=roster,
            bound=self.bound,
            norms=norms,
        )

    def state_dict(self) -> dict[str, Any]:
        """Both norm detectors' state."""
        return {
            "norms": self.norms.state_dict(),
            "calibration_norms": self.calibration_norms.state_dict(),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.norms.load_state_dict(d["norms"])
        self.calibration_norms.load_state_dict(d["calibration_norms"])
