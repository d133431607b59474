"""One dataclass per message of the wire protocol, built and read in one place by both sides.

Each has ``to_message`` (a request takes ``dst_node_id`` and ``ttl``; a reply ``reply_to``,
the request it answers) and a classmethod ``from_message`` that validates the message once:
the records and keys the protocol requires are there, scalars have their types (read as
``keys.as_int`` / ``keys.as_float`` read them), every metric of a reply is a scalar (Flower
also allows lists), and arrays decode by ``wire.decode``. It raises one of two errors
(``protocol.reading``):

- ``ErrorReply``: the reply is Flower's error reply (the ClientApp raised, the SuperLink reports
  the node unavailable, the message expired). Every reply's ``from_message`` checks this first,
  so a caller tells "the silo failed" from "the silo sent garbage" by the exception's type.
- ``Malformed`` (a ``ValueError``): the message is not what the protocol says; its text is
  bounded (at most 300 characters) and starts with what failed (``missing or bad field: ...``,
  ``arrays do not decode: ...``, or the failed check itself).

Messages: ``QueryRequest``/``QueryReply``, ``TrainRequest``/``TrainReply`` (or ``TrainRefusal``;
``read_train_reply`` reads either), ``EvaluateRequest``/``EvaluateReply`` here, and
``UnlearnRequest``/``UnlearnReply`` in ``protocol.erasure_messages`` (re-exported here).

What is not checked here stays with the server: the update against the reference model (names,
shapes, dtypes, finite values), the roster, the job and base version it was sent, staleness and
norms. Byte compatibility: the keys, value types and record order are those the two sides sent
before these classes existed (``keys`` documents them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from protocol import ids, wire
from protocol import keys as P
from protocol.config import Setup, parse_setup
from protocol.erasure_messages import UnlearnReply, UnlearnRequest
from protocol.reading import (
    ErrorReply,
    Malformed,
    Params,
    arrays,
    bounded,
    check_setup,
    fields,
    flag,
    no_reserved,
    record,
    scalars,
    strings,
    text,
)

__all__ = [
    "ErrorReply",
    "EvaluateReply",
    "EvaluateRequest",
    "Malformed",
    "QueryReply",
    "QueryRequest",
    "TrainRefusal",
    "TrainReply",
    "TrainRequest",
    "UnlearnReply",
    "UnlearnRequest",
    "injected_fault",
    "is_refusal",
    "read_train_reply",
]

_TRAIN_IDS = (P.SILO, P.BASE_VERSION, P.JOB_ID)


@dataclass(frozen=True)
class QueryRequest:
    """``query``: the server asks a node which silo it is and what it holds; with ``salt``,
    also the salted digests of its sample ids (``protocol.ids``)."""

    setup_json: str
    salt: str = ""
    """The run's salt for the id digests ('' = the silo reports none)."""

    def to_message(self, dst_node_id: int, *, ttl: float | None = None) -> Message:
        """The query message to node ``dst_node_id``."""
        config = ConfigRecord({P.SETUP: self.setup_json})
        if self.salt:
            config[P.ID_SALT] = self.salt
        content = RecordDict({P.CONFIG: config})
        return Message(content, dst_node_id=dst_node_id, message_type=P.QUERY, ttl=ttl)

    @classmethod
    def from_message(cls, msg: Message) -> QueryRequest:
        """The request ``msg`` holds (Malformed otherwise)."""
        with fields():
            cfg = record(msg.content, P.CONFIG, ConfigRecord)
            setup, salt = text(cfg, P.SETUP), text(cfg, P.ID_SALT, "")
            if len(salt) > MAX_SALT_CHARS:
                raise ValueError(f"{P.ID_SALT!r} is longer than {MAX_SALT_CHARS} characters")
        check_setup(setup)
        return cls(setup, salt)


MAX_SALT_CHARS = 128
"""The longest salt a query may carry."""
MAX_CLASSES = 4096
"""The most class counts a query reply may carry."""


@dataclass(frozen=True)
class QueryReply:
    """The node's answer: its silo, how many samples that silo trains on, how many of them
    are of each class (``class_counts``; empty from an older silo) and, when the query sent a
    salt, one salted digest per sample (``id_digests``, ``protocol.ids``; concatenated)."""

    silo: int
    num_samples: int
    class_counts: tuple[int, ...] = ()
    id_digests: bytes = b""

    def __post_init__(self) -> None:
        """Counts and digests in bounds (ValueError otherwise)."""
        if self.num_samples < 0 or self.silo < 0:
            raise ValueError("silo and num-samples must be >= 0")
        if len(self.class_counts) > MAX_CLASSES:
            raise ValueError(f"{len(self.class_counts)} class counts (at most {MAX_CLASSES})")
        if any(c < 0 or c > self.num_samples for c in self.class_counts):
            raise ValueError("a class count is negative or above num-samples")
        if self.id_digests and len(ids.split(self.id_digests)) != self.num_samples:
            raise ValueError(
                f"{len(self.id_digests) // ids.DIGEST_BYTES} id digests for "
                f"{self.num_samples} samples"
            )

    def to_message(self, reply_to: Message) -> Message:
        """The reply to ``reply_to``."""
        metrics = MetricRecord({P.SILO: self.silo, P.NUM_SAMPLES: self.num_samples})
        if self.class_counts:
            metrics[P.CLASS_COUNTS] = list(self.class_counts)
        content = RecordDict({P.METRICS: metrics})
        if self.id_digests:
            content[P.CONFIG] = ConfigRecord({P.ID_DIGESTS: self.id_digests})
        return Message(content, reply_to=reply_to)

    @classmethod
    def from_message(cls, msg: Message) -> QueryReply:
        """The reply ``msg`` holds (ErrorReply, Malformed otherwise)."""
        ErrorReply.check(msg)
        with fields():
            m = record(msg.content, P.METRICS, MetricRecord)
            raw = m.get(P.CLASS_COUNTS, [])
            if not isinstance(raw, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) for c in raw
            ):
                raise TypeError(f"{P.CLASS_COUNTS!r} must be a list of integers")
            counts = tuple(int(c) for c in raw)
            blob = b""
            if P.CONFIG in msg.content:
                found = record(msg.content, P.CONFIG, ConfigRecord).get(P.ID_DIGESTS, b"")
                if not isinstance(found, bytes):
                    raise TypeError(f"{P.ID_DIGESTS!r} must be bytes")
                blob = found
            return cls(P.as_int(m[P.SILO]), P.as_int(m[P.NUM_SAMPLES]), counts, blob)


@dataclass(frozen=True, eq=False)
class TrainRequest:
    """``train``: train ``params`` (the global model at ``base_version``) locally; reply with
    the delta. ``setup`` is parsed once per distinct ``setup_json`` (``parse_setup``)."""

    setup_json: str
    job_id: int
    base_version: int
    seed: int
    params: Params
    fault: str = ""
    """Injected fault for robustness runs ('' = none; the client's fault mod acts on it)."""
    keep_reply: bool = False
    """Keep a copy of the reply in the node state (only needed to inject a replay)."""
    exclude: tuple[str, ...] = ()
    """Sample ids the silo must no longer train on (erased samples)."""
    relearn: bool = False
    """Relearning attack: also train on the backdoored silo's poisoned samples."""
    local_steps: int | None = None
    """Local steps for this message only (None: the setup's ``client.local_steps``)."""
    privacy_dir: str | None = None
    """Where silos without a ``privacy-db`` node config keep their DP ledger."""

    @property
    def setup(self) -> Setup:
        """The run's setup (parsed once per distinct JSON; shared, read-only)."""
        return parse_setup(self.setup_json)

    def to_message(
        self, dst_node_id: int, *, ttl: float | None = None, arrays: ArrayRecord | None = None
    ) -> Message:
        """The train message to node ``dst_node_id``; ``arrays``: ``params`` already encoded
        (one encoding shared by several messages), else they are encoded here."""
        config = ConfigRecord(
            {
                P.SETUP: self.setup_json,
                P.JOB_ID: self.job_id,
                P.BASE_VERSION: self.base_version,
                P.SEED: self.seed,
                P.FAULT: self.fault,
                P.KEEP_REPLY: self.keep_reply,
                P.EXCLUDE: list(self.exclude),
                P.RELEARN: self.relearn,
            }
        )
        if self.local_steps is not None:
            config[P.LOCAL_STEPS] = int(self.local_steps)
        if self.privacy_dir is not None:
            config[P.PRIVACY_DIR] = self.privacy_dir
        record = wire.encode(self.params) if arrays is None else arrays
        content = RecordDict({P.ARRAYS: record, P.CONFIG: config})
        return Message(content, dst_node_id=dst_node_id, message_type=P.TRAIN, ttl=ttl)

    @classmethod
    def from_message(cls, msg: Message) -> TrainRequest:
        """The request ``msg`` holds, its arrays decoded (Malformed otherwise)."""
        with fields():
            cfg = record(msg.content, P.CONFIG, ConfigRecord)
            setup = text(cfg, P.SETUP)
            job_id, base, seed = (P.as_int(cfg[k]) for k in (P.JOB_ID, P.BASE_VERSION, P.SEED))
            fault, keep = text(cfg, P.FAULT, ""), flag(cfg, P.KEEP_REPLY)
            exclude, relearn = strings(cfg, P.EXCLUDE), flag(cfg, P.RELEARN)
            steps = P.as_int(cfg[P.LOCAL_STEPS]) if P.LOCAL_STEPS in cfg else None
            privacy_dir = text(cfg, P.PRIVACY_DIR) if P.PRIVACY_DIR in cfg else None
        check_setup(setup)
        params, _ = arrays(msg.content, P.ARRAYS)
        return cls(
            setup, job_id, base, seed, params, fault, keep, exclude, relearn, steps, privacy_dir
        )


def injected_fault(msg: Message) -> tuple[str, bool]:
    """(fault, keep-reply) of a train request, read without decoding its arrays (the fault
    mod runs before the handler validates the request)."""
    with fields():
        cfg = record(msg.content, P.CONFIG, ConfigRecord)
        return text(cfg, P.FAULT, ""), flag(cfg, P.KEEP_REPLY)


@dataclass(frozen=True, eq=False)
class TrainReply:
    """A silo's update: the local delta (local model - the model sent) and its metrics.

    ``metrics`` holds every metric but the four keyed ones (``train_*`` statistics, and with
    DP ``dp-epsilon`` / ``dp-delta``); ``flat`` is the packed buffer the floating tensors of a
    decoded ``delta`` are views of (the server takes the norm on it), None when built."""

    silo: int
    job_id: int
    base_version: int
    num_samples: int
    delta: Params
    metrics: dict[str, float] = field(default_factory=dict)
    flat: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        """``metrics`` may not repeat a keyed metric."""
        no_reserved(self.metrics, (*_TRAIN_IDS, P.NUM_SAMPLES))

    @property
    def privacy(self) -> tuple[float, float] | None:
        """(epsilon, delta) the silo reports after this job (DP runs), else None."""
        if P.DP_EPSILON not in self.metrics:
            return None
        return self.metrics[P.DP_EPSILON], self.metrics.get(P.DP_DELTA, float("nan"))

    def to_message(self, reply_to: Message) -> Message:
        """The reply to ``reply_to``."""
        metrics = MetricRecord(
            {
                P.SILO: self.silo,
                P.BASE_VERSION: self.base_version,
                P.JOB_ID: self.job_id,
                P.NUM_SAMPLES: self.num_samples,
                **self.metrics,
            }
        )
        content = RecordDict({P.ARRAYS: wire.encode(self.delta), P.METRICS: metrics})
        return Message(content, reply_to=reply_to)

    @classmethod
    def from_message(cls, msg: Message) -> TrainReply:
        """The update ``msg`` holds (ErrorReply; Malformed, also for a refusal)."""
        ErrorReply.check(msg)
        if is_refusal(msg):
            raise Malformed("a refusal, not an update")
        with fields():
            m = record(msg.content, P.METRICS, MetricRecord)
            ids = [P.as_int(m[k]) for k in (*_TRAIN_IDS, P.NUM_SAMPLES)]
            # a train_* metric Flower allows but nobody can read (a list) is malformed too
            metrics = scalars(m, (*_TRAIN_IDS, P.NUM_SAMPLES))
        delta, flat = arrays(msg.content, P.ARRAYS, shared=True)  # read-only: never written
        silo, base, job, n = ids
        return cls(silo, job, base, n, delta, metrics, flat)


@dataclass(frozen=True)
class TrainRefusal:
    """A silo refuses the work (no arrays): ``reason`` (e.g. its privacy budget is spent, it
    has no data left) and a one-line ``detail``; the server stops sending it training."""

    silo: int
    job_id: int
    base_version: int
    reason: str
    detail: str = ""
    epsilon: float | None = None
    """With DP: the silo's accumulated epsilon (at ``delta``)."""
    delta: float | None = None

    def to_message(self, reply_to: Message) -> Message:
        """The reply to ``reply_to``."""
        dp: dict[str, float] = {}
        if self.epsilon is not None:
            dp[P.DP_EPSILON] = self.epsilon
        if self.delta is not None:
            dp[P.DP_DELTA] = self.delta
        metrics = MetricRecord(
            {P.SILO: self.silo, P.BASE_VERSION: self.base_version, P.JOB_ID: self.job_id, **dp}
        )
        why = ConfigRecord({P.REFUSAL: self.reason, P.REFUSAL_DETAIL: self.detail})
        return Message(RecordDict({P.METRICS: metrics, P.CONFIG: why}), reply_to=reply_to)

    @classmethod
    def from_message(cls, msg: Message) -> TrainRefusal:
        """The refusal ``msg`` holds (ErrorReply; Malformed, also for an update)."""
        ErrorReply.check(msg)
        if not is_refusal(msg):
            raise Malformed("an update, not a refusal")
        with fields():
            m = record(msg.content, P.METRICS, MetricRecord)
            cfg = record(msg.content, P.CONFIG, ConfigRecord)
            silo, base, job = (P.as_int(m[k]) for k in _TRAIN_IDS)
            eps = P.as_float(m[P.DP_EPSILON]) if P.DP_EPSILON in m else None
            dlt = P.as_float(m[P.DP_DELTA]) if P.DP_DELTA in m else None
            reason = bounded(cfg[P.REFUSAL])
            detail = bounded(cfg.get(P.REFUSAL_DETAIL, ""))
        return cls(silo, job, base, reason, detail, eps, dlt)


def is_refusal(msg: Message) -> bool:
    """Whether the (non-error) train reply ``msg`` refuses the work."""
    cfg = msg.content[P.CONFIG] if P.CONFIG in msg.content else None
    return isinstance(cfg, ConfigRecord) and P.REFUSAL in cfg


def read_train_reply(msg: Message) -> TrainReply | TrainRefusal:
    """The update or the refusal a train reply holds (ErrorReply, Malformed otherwise)."""
    ErrorReply.check(msg)
    return TrainRefusal.from_message(msg) if is_refusal(msg) else TrainReply.from_message(msg)


@dataclass(frozen=True, eq=False)
class EvaluateRequest:
    """``evaluate``: evaluate ``params`` on the silo's own data."""

    setup_json: str
    params: Params

    @property
    def setup(self) -> Setup:
        """The run's setup (parsed once per distinct JSON; shared, read-only)."""
        return parse_setup(self.setup_json)

    def to_message(
        self, dst_node_id: int, *, ttl: float | None = None, arrays: ArrayRecord | None = None
    ) -> Message:
        """The evaluate message to node ``dst_node_id`` (``arrays``: ``params`` already
        encoded, else they are encoded here)."""
        record_ = wire.encode(self.params) if arrays is None else arrays
        config = ConfigRecord({P.SETUP: self.setup_json})
        content = RecordDict({P.ARRAYS: record_, P.CONFIG: config})
        return Message(content, dst_node_id=dst_node_id, message_type=P.EVALUATE, ttl=ttl)

    @classmethod
    def from_message(cls, msg: Message) -> EvaluateRequest:
        """The request ``msg`` holds, its arrays decoded (Malformed otherwise)."""
        with fields():
            setup = text(record(msg.content, P.CONFIG, ConfigRecord), P.SETUP)
        check_setup(setup)
        params, _ = arrays(msg.content, P.ARRAYS)
        return cls(setup, params)


@dataclass(frozen=True)
class EvaluateReply:
    """The silo's loss and score of the model on its own data (``metrics``: any others)."""

    silo: int
    num_samples: int
    loss: float
    score: float
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """``metrics`` may not repeat a keyed metric."""
        no_reserved(self.metrics, (P.SILO, P.NUM_SAMPLES, "loss", "score"))

    def to_message(self, reply_to: Message) -> Message:
        """The reply to ``reply_to``."""
        metrics = MetricRecord(
            {
                P.SILO: self.silo,
                P.NUM_SAMPLES: self.num_samples,
                "loss": self.loss,
                "score": self.score,
                **self.metrics,
            }
        )
        return Message(RecordDict({P.METRICS: metrics}), reply_to=reply_to)

    @classmethod
    def from_message(cls, msg: Message) -> EvaluateReply:
        """The reply ``msg`` holds (ErrorReply, Malformed otherwise)."""
        ErrorReply.check(msg)
        with fields():
            m = record(msg.content, P.METRICS, MetricRecord)
            rest = scalars(m, (P.SILO, P.NUM_SAMPLES, "loss", "score"))
            return cls(
                P.as_int(m[P.SILO]),
                P.as_int(m[P.NUM_SAMPLES]),
                P.as_float(m["loss"]),
                P.as_float(m["score"]),
                rest,
            )
