"""What the erasure service needs to know about the federation, as a small Protocol.

The training server implements ``Catalog`` (which silos exist, which sample ids each
holds, the current model version, who is online); ``StaticCatalog`` is a fixed in-memory
one for tests and for running the service on its own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@runtime_checkable
class Catalog(Protocol):
    def silo_ids(self) -> set[int]: ...

    def sample_ids(self, silo: int) -> set[str]: ...

    def model_version(self) -> int: ...

    def is_online(self, silo: int) -> bool: ...


@dataclass
class StaticCatalog:
    """A fixed federation: ``samples[silo]`` are its sample ids; ``offline`` silos are down."""

    samples: dict[int, set[str]]
    version: int = 0
    offline: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def silo_ids(self) -> set[int]:
        return set(self.samples)

    def sample_ids(self, silo: int) -> set[str]:
        return set(self.samples.get(silo, ()))

    def model_version(self) -> int:
        with self._lock:
            return self.version

    def is_online(self, silo: int) -> bool:
        return silo not in self.offline
