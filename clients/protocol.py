"""The wire contract between the ServerApp and the ClientApp: message types and record keys.

Defined once here and imported by both sides, so a key is never spelled twice.

Messages (Flower routes them by type, ``@app.train()`` etc.):
- ``query``: the server asks a SuperNode which silo it is; reply metrics: silo, num-samples.
- ``train``: arrays = the global model at ``base-version``; reply arrays = the local *delta*
  (local model - global model) and metrics (silo, base-version, job-id, num-samples, losses).
- ``evaluate``: arrays = a model; reply metrics = loss and score on the silo's own data.
"""

from __future__ import annotations

import json
from typing import Any

QUERY = "query"
TRAIN = "train"
EVALUATE = "evaluate"
UNLEARN = "train.unlearn"
"""Erase data on the silo (its own message type, routed by ``@app.train("unlearn")``)."""

ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"

REFERENCE = "reference"
"""Unlearn: the reference model of projected gradient ascent (arrays)."""
SIGNATURE = "signature"
"""Unlearn reply: the forget data's gradient signature basis, shape (d, k) (arrays)."""

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

# metric keys (silo -> server)
SILO = "silo"
NUM_SAMPLES = "num-samples"
TRAIN_SECONDS = "train_seconds"
"""Train reply: wall seconds of the local training itself (the ``train_`` prefix carries it into
the server's update events; the deployment benchmark subtracts it from the round trip)."""


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)


def loads(text: str) -> Any:
    return json.loads(text)
