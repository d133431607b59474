"""Versions, staleness, and versioned snapshots of parameters.

Papers: staleness τ = t − τ_base as in FedAsync (Xie et al. 2019, arXiv:1903.03934) and
FedBuff (Nguyen et al. 2022). :class:`VersionedSnapshots` keeps the old models DC-ASGD
(Zheng et al. 2017) needs for ``w_base``, and doubles as PipeDream-2BW weight stashing and
as the store of past policies for importance ratios in async RL.

Departure: the papers assume every base model is available; here the store is bounded
(``max_versions``), so callers must handle ``get`` returning ``None`` for evicted versions
(e.g. by skipping delay compensation or rejecting the update as too stale).
"""

from __future__ import annotations

from typing import Any

import torch

from fedasync.tensors import to_cpu
from fedasync.types import Params


class FutureVersionError(ValueError):
    """An update claims a base version newer than the server's current version."""


def staleness(version: int, base_version: int) -> int:
    """Staleness τ = ``version − base_version`` (number of updates applied since the base).

    This is THE single definition used everywhere.

    Raises:
        ValueError: ``base_version < 0``.
        FutureVersionError: ``base_version > version``.
    """
    if base_version < 0:
        raise ValueError(f"base_version must be >= 0, got {base_version}")
    if base_version > version:
        raise FutureVersionError(f"base_version {base_version} is newer than version {version}")
    return version - base_version


class VersionedSnapshots:
    """Bounded store of detached copies of ``Params``, keyed by version.

    Holds at most ``max_versions`` snapshots; ``put`` evicts the oldest (smallest version)
    beyond that. Copies live on the CPU unless ``device`` names another (a pipeline stage
    stashes its weight versions where it computes).
    """

    def __init__(self, max_versions: int, device: str | torch.device | None = None) -> None:
        if max_versions < 1:
            raise ValueError(f"max_versions must be >= 1, got {max_versions}")
        self.max_versions = max_versions
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._store: dict[int, Params] = {}

    def _copy(self, params: Params) -> Params:
        if self.device.type == "cpu":
            return to_cpu(params)
        return {k: v.detach().to(self.device, copy=True) for k, v in params.items()}

    def put(self, version: int, params: Params) -> None:
        """Store a detached clone of ``params`` under ``version`` (replacing any)."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self._store[version] = self._copy(params)
        while len(self._store) > self.max_versions:
            del self._store[min(self._store)]

    def get(self, version: int) -> Params | None:
        """The snapshot for ``version`` (not a copy: do not mutate), or ``None`` if absent."""
        return self._store.get(version)

    def __contains__(self, version: object) -> bool:
        return version in self._store

    def __len__(self) -> int:
        return len(self._store)

    def versions(self) -> list[int]:
        """Stored versions, ascending."""
        return sorted(self._store)

    @property
    def oldest(self) -> int | None:
        """Smallest stored version, or ``None`` when empty."""
        return min(self._store) if self._store else None

    @property
    def latest(self) -> int | None:
        """Largest stored version, or ``None`` when empty."""
        return max(self._store) if self._store else None

    def state_dict(self) -> dict[str, Any]:
        """``max_versions`` and the snapshots by ``str(version)`` (the tensors, not copies)."""
        return {
            "max_versions": self.max_versions,
            "snapshots": {str(v): dict(p) for v, p in sorted(self._store.items())},
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; snapshots are copied to this store's device."""
        self.max_versions = int(d["max_versions"])
        self._store = {int(v): self._copy(p) for v, p in d["snapshots"].items()}
