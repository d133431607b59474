"""What the erasure service needs to know about the federation, as a small Protocol.

The training server implements ``Catalog`` (which silos exist, which sample ids each
holds, the current model version, who is online); ``StaticCatalog`` is a fixed in-memory
one for tests and for running the service on its own.
"""

from __future__ import annotations

import threading
from collections.abc import Set
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@runtime_checkable
class Catalog(Protocol):
    """The federation as the erasure service reads it, from its gRPC worker threads."""

    def silo_ids(self) -> set[int]:
        """Indices of the silos that exist."""

    def sample_ids(self, silo: int) -> Set[str]:
        """Sample ids held by ``silo`` (one of ``silo_ids()``): a set, or what answers ``in``
        and ``<=`` like one (``protocol.ids.DigestSet``: a deployment's coordinator)."""

    def model_version(self) -> int:
        """The global model's current version (kept on a request at submit)."""

    def is_online(self, silo: int) -> bool:
        """Whether ``silo`` is up now; an offline silo's request waits queued until it returns."""


@dataclass
class StaticCatalog:
    """A fixed federation: ``samples[silo]`` are its sample ids; ``offline`` silos are down."""

    samples: dict[int, set[str]]
    version: int = 0
    offline: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def silo_ids(self) -> set[int]:
        """The silos of ``samples``."""
        return set(self.samples)

    def sample_ids(self, silo: int) -> set[str]:
        """A copy of ``samples[silo]`` (empty for an unknown silo)."""
        return set(self.samples.get(silo, ()))

    def model_version(self) -> int:
        """``version``, read under the lock."""
        with self._lock:
            return self.version

    def is_online(self, silo: int) -> bool:
        """False for the silos in ``offline``."""
        return silo not in self.offline
