"""The ``train.unlearn`` exchange: erase a forget set on a silo, reply with the erased delta.

The request carries the model to erase from (and optionally the reference model of projected
gradient ascent), the sample ids to forget (none: the whole silo) and a ``SiloErasure`` config.
The reply carries the erasure delta (relative to the model sent), the forget data's gradient
signature basis ``(d, k)`` with the names of the tensors it spans, optionally the forget data's
mean loss gradient ``(d,)`` over the same tensors (``lab.erasure.protect=gradient/onesided``
reads it; a reply without it, as older silos send, still parses), and the silo's metrics.
Errors as in ``protocol.messages`` (``ErrorReply``, ``Malformed``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from protocol import keys as P
from protocol import wire
from protocol.config import Setup, SiloErasure, parse_setup
from protocol.reading import (
    ErrorReply,
    Malformed,
    Params,
    arrays,
    check_setup,
    fields,
    no_reserved,
    record,
    scalars,
    strings,
    text,
)

_IDS = (P.SILO, P.BASE_VERSION, P.JOB_ID, P.NUM_SAMPLES)


@dataclass(frozen=True, eq=False)
class UnlearnRequest:
    """``train.unlearn``: erase ``forget`` (sample ids; empty = the whole silo) from
    ``params`` (the global model at ``base_version``) as ``erasure`` says."""

    setup_json: str
    job_id: int
    base_version: int
    seed: int
    params: Params
    erasure: SiloErasure
    forget: tuple[str, ...] = ()
    reference: Params | None = None
    """PGA's reference model (the centre of its ball); None: ``params``."""

    @property
    def setup(self) -> Setup:
        """The run's setup (parsed once per distinct JSON; shared, read-only)."""
        return parse_setup(self.setup_json)

    def to_message(self, dst_node_id: int, *, ttl: float | None = None) -> Message:
        """The unlearn message to node ``dst_node_id``."""
        config = ConfigRecord(
            {
                P.SETUP: self.setup_json,
                P.JOB_ID: self.job_id,
                P.BASE_VERSION: self.base_version,
                P.SEED: self.seed,
                P.FORGET: list(self.forget),
                P.UNLEARN_JSON: self.erasure.to_json(),
            }
        )
        content = RecordDict({P.ARRAYS: wire.encode(self.params), P.CONFIG: config})
        if self.reference is not None:
            content[P.REFERENCE] = wire.encode(self.reference)
        return Message(content, dst_node_id=dst_node_id, message_type=P.UNLEARN, ttl=ttl)

    @classmethod
    def from_message(cls, msg: Message) -> UnlearnRequest:
        """The request ``msg`` holds, its arrays decoded (Malformed otherwise)."""
        with fields():
            cfg = record(msg.content, P.CONFIG, ConfigRecord)
            setup = text(cfg, P.SETUP)
            job_id, base, seed = (P.as_int(cfg[k]) for k in (P.JOB_ID, P.BASE_VERSION, P.SEED))
            forget = strings(cfg, P.FORGET)
            erasure = SiloErasure.from_json(text(cfg, P.UNLEARN_JSON))
        check_setup(setup)
        params, _ = arrays(msg.content, P.ARRAYS)
        reference = arrays(msg.content, P.REFERENCE)[0] if P.REFERENCE in msg.content else None
        return cls(setup, job_id, base, seed, params, erasure, forget, reference)


@dataclass(frozen=True, eq=False)
class UnlearnReply:
    """The erasure's result: ``delta`` (erased model - model sent), the signature ``basis``
    (d, k) over the tensors ``names`` (in order), metrics (``metrics``: every one but the
    four keyed ones, e.g. ``signature_rank`` and the erasure's statistics), and optionally
    ``gradient`` (d,), the forget set's mean loss gradient over the same tensors."""

    silo: int
    job_id: int
    base_version: int
    num_samples: int
    """How many forget samples the silo erased."""
    delta: Params
    basis: torch.Tensor
    names: tuple[str, ...]
    metrics: dict[str, float] = field(default_factory=dict)
    gradient: torch.Tensor | None = None
    """The forget data's mean loss gradient at the erased model, ``(d,)`` (None: not sent)."""

    def __post_init__(self) -> None:
        """``metrics`` may not repeat a keyed metric."""
        no_reserved(self.metrics, _IDS)

    def report(self) -> dict[str, float]:
        """Every metric but silo, job and base version, as floats (num-samples first)."""
        return {P.NUM_SAMPLES: float(self.num_samples), **self.metrics}

    def to_message(self, reply_to: Message) -> Message:
        """The reply to ``reply_to`` (the basis and the gradient travel in the dtype they
        have; no gradient: no ``forget-gradient`` record, as older silos sent)."""
        metrics = MetricRecord(
            {
                P.SILO: self.silo,
                P.BASE_VERSION: self.base_version,
                P.JOB_ID: self.job_id,
                P.NUM_SAMPLES: self.num_samples,
                **self.metrics,
            }
        )
        content = RecordDict(
            {
                P.ARRAYS: wire.encode(self.delta),
                P.SIGNATURE: wire.encode({"basis": self.basis}),
                P.METRICS: metrics,
                P.CONFIG: ConfigRecord({P.SIGNATURE_NAMES: list(self.names)}),
            }
        )
        if self.gradient is not None:
            content[P.FORGET_GRADIENT] = wire.encode({"gradient": self.gradient})
        return Message(content, reply_to=reply_to)

    @classmethod
    def from_message(cls, msg: Message) -> UnlearnReply:
        """The reply ``msg`` holds (ErrorReply, Malformed otherwise; the basis must be a
        finite floating (d, k) matrix, the gradient, when there is one, a finite floating
        (d,) vector)."""
        ErrorReply.check(msg)
        with fields():
            m = record(msg.content, P.METRICS, MetricRecord)
            silo, base, job, n = (P.as_int(m[k]) for k in _IDS)
            metrics = scalars(m, _IDS)
            cfg = record(msg.content, P.CONFIG, ConfigRecord)
            if P.SIGNATURE_NAMES not in cfg:
                raise KeyError(P.SIGNATURE_NAMES)
            names = strings(cfg, P.SIGNATURE_NAMES)
        delta, _ = arrays(msg.content, P.ARRAYS)
        signature, _ = arrays(msg.content, P.SIGNATURE)
        if set(signature) != {"basis"}:
            raise Malformed("the signature arrays must hold exactly 'basis'")
        basis = signature["basis"]
        if basis.dim() != 2 or not basis.is_floating_point() or not bool(basis.isfinite().all()):
            raise Malformed("the gradient signature is not a finite (d, k) matrix")
        gradient = None
        if P.FORGET_GRADIENT in msg.content:
            got, _ = arrays(msg.content, P.FORGET_GRADIENT)
            if set(got) != {"gradient"}:
                raise Malformed("the forget-gradient arrays must hold exactly 'gradient'")
            gradient = got["gradient"]
            if (
                gradient.shape != (basis.shape[0],)
                or not gradient.is_floating_point()
                or not bool(gradient.isfinite().all())
            ):
                raise Malformed(
                    f"the forget gradient is not a finite ({basis.shape[0]},) vector, "
                    f"got shape {tuple(gradient.shape)}"
                )
        return cls(silo, job, base, n, delta, basis, names, metrics, gradient)


WORK_UNITS = "work_units"
"""Metric of an unlearn reply: the erasure's work in training steps (``SiloErasure.work_units``)."""


def reported_work(msg: Message) -> float | None:
    """The ``work_units`` an unlearn reply reports (None: an error reply, or none reported),
    read without decoding its tensors."""
    if msg.has_error() or P.METRICS not in msg.content:
        return None
    m = msg.content[P.METRICS]
    if not isinstance(m, MetricRecord) or WORK_UNITS not in m:
        return None
    v = m[WORK_UNITS]
    return float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else None
