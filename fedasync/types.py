"""Shared data types of the stale-update correction core.

An *update* is what a worker (a silo, an RL actor, a pipeline stage) sends back: a dict of
named tensors plus the version it started from. Terms follow docs/architecture.md: the **base
version** is the server version the worker started from, and **staleness** τ = version − base
version (see :func:`fedasync.versions.staleness`).

Papers: the update/base-version pairing follows FedAsync (Xie et al. 2019,
arXiv:1903.03934) and FedBuff (Nguyen et al. 2022). Departure: an update may carry either a
delta or a full model (``kind``); FedAsync mixes models, FedBuff sums deltas, and the core
supports both where the algorithm allows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

Params = dict[str, torch.Tensor]
"""A model (or delta, or gradient) as a dict of named tensors, e.g. a ``state_dict()``."""

UpdateKind = Literal["delta", "model"]


@dataclass
class Update:
    """One worker's contribution to the global model."""

    silo: str
    """Who sent it (a hospital, an actor, a pipeline stage)."""
    base_version: int
    """Server version the worker started from (τ is measured against it)."""
    tensors: Params
    """``kind="delta"``: local_model − base_model; ``kind="model"``: the full local model."""
    num_samples: int = 1
    """Number of training samples behind this update (for sample weighting)."""
    kind: UpdateKind = "delta"
    """Whether ``tensors`` is a delta or a full model."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Scalar training metrics reported by the worker (loss, accuracy, seconds, ...)."""
