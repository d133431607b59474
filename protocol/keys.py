"""The wire contract between the ServerApp and the ClientApp: message types and record keys.

Defined once here and imported by both sides, so a key is never spelled twice.

Messages (Flower routes them by type, ``@app.train()`` etc.):
- ``query``: the server asks a SuperNode which silo it is (config: a salt for the id digests);
  reply metrics: silo, num-samples, class-counts; reply config: the salted id digests.
- ``train``: arrays = the global model at ``base-version``; reply arrays = the local *delta*
  (local model - global model) and metrics (silo, base-version, job-id, num-samples, losses).
- ``evaluate``: arrays = a model; reply metrics = loss and score on the silo's own data.
- ``train.unlearn``: arrays = the model to erase from; reply = the erasure delta, the forget
  data's gradient signature (and, optionally, its mean loss gradient) and metrics.

The dataclass of each message (built and validated in one place) is in ``protocol.messages``.
"""

from __future__ import annotations

import json
from typing import Any, cast

from flwr.app import ArrayRecord, RecordDict

QUERY = "query"
TRAIN = "train"
EVALUATE = "evaluate"
UNLEARN = "train.unlearn"
"""Erase data on the silo (its own message type, routed by ``@app.train("unlearn")``)."""

ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"

SIGNATURE_NAMES = "signature-names"
"""Unlearn reply config: the names of the tensors the signature basis spans, in order."""
REFERENCE = "reference"
"""Unlearn: the reference model of projected gradient ascent (arrays)."""
SIGNATURE = "signature"
"""Unlearn reply: the forget data's gradient signature basis, shape (d, k) (arrays)."""
FORGET_GRADIENT = "forget-gradient"
"""Unlearn reply, optional: the forget data's mean loss gradient at the erased model, shape (d,)
over the signature's tensors, as the one array ``gradient`` (arrays; absent in older replies)."""

# config keys (server -> silo)
JOB_ID = "job-id"
BASE_VERSION = "base-version"
SEED = "seed"
SETUP = "setup-json"
"""JSON: {"client": ClientConfig, "data": DataConfig, "backdoor": BackdoorConfig,
"num_silos": int, "seed": int}."""
FAULT = "fault"
"""Injected fault for robustness runs ('' = none)."""
EXCLUDE = "exclude-ids"
"""Sample ids this silo must no longer train on (erased samples), list[str]."""
FORGET = "forget-ids"
"""Unlearn: the sample ids to erase; empty = the whole silo."""
UNLEARN_JSON = "unlearn-json"
"""Unlearn: the UnlearningConfig as JSON."""
RELEARN = "relearn"
"""Relearning attack (verification runs): also train on the backdoored silo's poisoned data."""
LOCAL_STEPS = "local-steps"
"""Train: local steps for this message only (FedEraser's shorter calibration training)."""
KEEP_REPLY = "keep-reply"
"""Keep a copy of this reply in the node state (only needed to inject a replay)."""

ID_SALT = "id-salt"
"""Query: the run's salt for the silo's sample id digests (``protocol.ids``); absent: none."""

# metric keys (silo -> server)
SILO = "silo"
NUM_SAMPLES = "num-samples"
CLASS_COUNTS = "class-counts"
"""Query reply metric, list[int]: per class, the silo's samples with that label (segmentation:
that contain it)."""
ID_DIGESTS = "id-digests"
"""Query reply config, bytes: the salted digests of the silo's sample ids, concatenated."""
# node config (SuperNode)
DATALIST = "datalist"
"""Node config: the path of the silo's own data, a Decathlon-format datalist
(``medical_data.datalist``); absent: the silo is partition ``partition-id`` of the benchmark."""
# privacy (DP-SGD on the silos; the ledger is clients/privacy.py)
PRIVACY_DB = "privacy-db"
"""Node config (SuperNode): the path of this silo's ledger file."""
PRIVACY_DIR = "privacy-dir"
"""Train config (server -> silo): the folder for ledgers when the node config names none."""
DP_EPSILON = "dp-epsilon"
"""Train reply metric: the silo's accumulated epsilon (at ``protocol.config.DP_DELTA``) after this job."""
DP_DELTA = "dp-delta"
"""Train reply metric: the delta that epsilon is for."""
REFUSAL = "refusal"
"""Train reply config: why the silo refuses work (a ``Refusal`` value); the reply has no arrays."""
REFUSAL_DETAIL = "refusal-detail"
"""Train reply config: a one-line explanation of the refusal."""

TRAIN_SECONDS = "train_seconds"
"""Train reply: wall seconds of the local training itself (the ``train_`` prefix carries it into
the server's update events; the deployment benchmark subtracts it from the round trip)."""


def dumps(obj: Any) -> str:
    """JSON with sorted keys (so equal objects make equal text, e.g. a cache key)."""
    return json.dumps(obj, sort_keys=True)


def loads(text: str) -> Any:
    """The object JSON ``text`` holds."""
    return json.loads(text)


# Flower types a record as the union of its three kinds, and a record's value as the union of
# every kind of value (lists and arrays too); the contract above fixes which one each key holds.
# These read a key with its contract's type and behave exactly as the plain expression would.


def array_record(content: RecordDict, key: str) -> ArrayRecord:
    """``content[key]``, an ArrayRecord by the contract (not checked here: a peer that put
    another record there fails in ``wire.decode``, as it would without this)."""
    return cast(ArrayRecord, content[key])


def as_int(value: object) -> int:
    """``int(value)`` for a scalar record value; anything else raises int()'s own TypeError."""
    if isinstance(value, int | float | str | bytes):
        return int(value)
    raise TypeError(
        "int() argument must be a string, a bytes-like object or a real number, "
        f"not '{type(value).__name__}'"
    )


def as_float(value: object) -> float:
    """``float(value)`` for a scalar record value; anything else raises float()'s own TypeError."""
    if isinstance(value, int | float | str | bytes):
        return float(value)
    raise TypeError(
        f"float() argument must be a string or a real number, not '{type(value).__name__}'"
    )
