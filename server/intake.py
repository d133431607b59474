"""Intake of one reply: decode, validate and turn it into a core ``Update`` or a rejection.

Everything a silo sends is untrusted. A reply is rejected (with a reason that is logged and
counted, and without touching the global model) when it is a client error, malformed, claims
an unknown silo or another node's silo, replays an earlier job, claims a base version from the
future or other than the one it was sent, has the wrong tensor names, shapes or dtypes,
contains NaN/Inf, is staler than the bound, or has a norm far beyond the others'.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord, Message

from clients import protocol as P
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
from fedasync.tensors import global_norm

_NPY_MAGIC = b"\x93NUMPY"


def decode_arrays(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """Tensors of an ArrayRecord, decoded strictly and fast; ValueError when malformed.

    Flower stores each array as an .npy file and decodes it with ``np.load``, whose header
    parser (``ast.literal_eval``) costs more than the data itself for small networks. The
    dtype and shape travel in the Array's own fields, so only the header's length and
    ``fortran_order`` are read here; the payload must be exactly dtype x shape bytes, object
    arrays are refused, and every tensor is a private copy.
    """
    out: dict[str, torch.Tensor] = {}
    for name in record.keys():
        arr = record[name]
        if arr.stype != "numpy.ndarray":
            raise ValueError(f"{name!r}: unsupported serialisation {arr.stype!r}")
        dtype = np.dtype(arr.dtype)
        if dtype.hasobject:
            raise ValueError(f"{name!r}: object arrays are refused")
        shape = tuple(int(d) for d in arr.shape)
        data = arr.data
        if data[:6] != _NPY_MAGIC or len(data) < 10:
            raise ValueError(f"{name!r}: not an .npy payload")
        if data[6] == 1:
            start = 10 + struct.unpack("<H", data[8:10])[0]
        else:
            start = 12 + struct.unpack("<I", data[8:12])[0]
        count = math.prod(shape)
        if len(data) - start != count * dtype.itemsize:
            raise ValueError(f"{name!r}: {len(data) - start} bytes for {shape} {dtype}")
        fortran = b"'fortran_order': True" in data[10:start]
        flat = np.frombuffer(data, dtype=dtype, count=count, offset=start)
        out[name] = torch.from_numpy(flat.reshape(shape, order="F" if fortran else "C").copy())
    return out


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


@dataclass
class Accepted:
    update: Update
    staleness: int
    decision: BoundDecision
    norm: float


def take_reply(
    reply: Message,
    job: Job,
    *,
    version: int,
    reference: Params,
    roster: dict[int, int],
    bound: StalenessBound,
    norms: NormOutlierDetector,
) -> Accepted | Rejection:
    """Validate ``reply`` to ``job`` against the current ``version`` and parameters ``reference``.

    ``roster`` maps silo id -> node id. The norm detector only learns from accepted updates.
    """
    if reply.has_error():
        reason = reply.error.reason if reply.error is not None else "unknown error"
        return Rejection(RejectReason.CLIENT_ERROR, str(reason).strip().splitlines()[-1][:300])
    try:
        metrics = reply.content[P.METRICS]
        claimed_silo = int(metrics[P.SILO])
        claimed_job = int(metrics[P.JOB_ID])
        claimed_base = int(metrics[P.BASE_VERSION])
        num_samples = int(metrics[P.NUM_SAMPLES])
        record = reply.content[P.ARRAYS]
    except (KeyError, TypeError, ValueError) as e:
        return Rejection(RejectReason.MALFORMED, f"missing or bad field: {e}")
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
    try:
        tensors = decode_arrays(record)
    except Exception as e:  # noqa: BLE001 - any decoding failure is a malformed reply
        return Rejection(RejectReason.MALFORMED, f"arrays do not decode: {e}")
    bad = check_tensors(tensors, reference, check_finite=False)
    if bad is not None:
        return bad
    tau = staleness(version, job.base_version)
    decision = bound.check(tau)
    if decision.action == "reject":
        return Rejection(RejectReason.TOO_STALE, decision.reason)
    # one pass over the update: the norm is non-finite iff some entry is (or it overflowed)
    norm = global_norm(tensors)
    if not math.isfinite(norm):
        bad = check_tensors(tensors, reference)
        return bad or Rejection(RejectReason.NORM_OUTLIER, f"update norm {norm} overflows")
    outlier = norms.check(norm)
    if outlier is not None:
        return outlier
    norms.observe(norm)
    train_metrics = {k: float(v) for k, v in metrics.items() if k.startswith("train_")}  # type: ignore[arg-type]
    update = Update(
        silo=str(job.silo),
        base_version=job.base_version,
        tensors=tensors,
        num_samples=num_samples,
        kind="delta",
        metrics=train_metrics,
    )
    return Accepted(update, tau, decision, norm)
