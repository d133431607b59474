"""Versions, staleness, and versioned snapshots of parameters.

Papers: staleness τ = t − τ_base as in FedAsync (Xie et al. 2019, arXiv:1903.03934) and
FedBuff (Nguyen et al. 2022). :class:`VersionedSnapshots` keeps the old models DC-ASGD
(Zheng et al. 2017) needs for ``w_base``, and doubles as PipeDream-2BW weight stashing and
as the store of past policies for importance ratios in async RL.

Departure: the papers assume every base model is available; here the store is bounded
(``max_versions``), so callers must handle ``get`` returning ``None`` for evicted versions
(e.g. by skipping delay compensation or rejecting the update as too stale).

:class:`TimedHistory` stamps each version with the (continuous) time it took effect, so
``as_of(t)`` answers "which version was current at time t". It doubles as a delayed
observation: a firm that sees a competitor's price ``delta`` late reads
``as_of(now - delta)``, and ``staleness_at`` counts the changes it has not seen yet (the
continuous-time pricing market, after Calvano et al., AER 2020). Its store is bounded by a
time window (``retain``) instead of a count.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import Any, Generic, TypeVar

import torch

from fedasync.tensors import to_cpu
from fedasync.types import Params

V = TypeVar("V")


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


class TimedHistory(Generic[V]):
    """Values stamped with the time they took effect, numbered by version 0, 1, 2, ... in
    recording order; ``as_of(t)`` is the value in effect at time ``t`` (O(log n), bisect).

    ``retain`` bounds memory by time: a query is expected at ``t >= latest_time - retain``,
    so every entry older than the one in effect at ``latest_time - retain`` is dropped (that
    one is kept). ``None`` keeps everything. An ``as_of`` that needs a dropped entry raises
    ``LookupError``; a query further back whose answer is still held is answered.
    """

    def __init__(self, retain: float | None = None) -> None:
        if retain is not None and not retain >= 0:
            raise ValueError(f"retain must be >= 0 or None, got {retain}")
        self.retain = retain
        self._times: list[float] = []
        self._values: list[V] = []
        self._start = 0  # entries before this index are dropped (compacted lazily)
        self._base = 0  # version of physical index 0 (entries compacted away so far)
        self._first_time: float | None = None  # time of the first record ever

    def record(self, t: float, value: V) -> int:
        """Record ``value`` as in effect from time ``t`` on; returns its version.

        Raises:
            ValueError: ``t`` is not finite, or earlier than the last record's time.
        """
        t = float(t)
        if not math.isfinite(t):
            raise ValueError(f"record time must be finite, got {t}")
        if len(self) and t < self._times[-1]:
            raise ValueError(
                f"record at t={t} is earlier than the last record's t={self._times[-1]}"
            )
        if self._first_time is None:
            self._first_time = t
        self._times.append(t)
        self._values.append(value)
        version = self._base + len(self._times) - 1
        if self.retain is not None:
            keep = bisect_right(self._times, t - self.retain, lo=self._start) - 1
            if keep > self._start:
                self._start = keep
                if self._start >= 32 and 2 * self._start > len(self._times):
                    del self._times[: self._start]
                    del self._values[: self._start]
                    self._base += self._start
                    self._start = 0
        return version

    def as_of(self, t: float) -> tuple[int, V]:
        """(version, value) of the latest record with time <= ``t`` (several at one time:
        the last recorded).

        Raises:
            LookupError: no record at or before ``t``, or its entry was dropped by retention.
        """
        if math.isnan(t):
            raise ValueError("as_of time must not be NaN")
        i = bisect_right(self._times, t, lo=self._start) - 1
        if i >= self._start:
            return self._base + i, self._values[i]
        if self._first_time is None:
            raise LookupError(f"no record at or before t={t}: the history is empty")
        if t < self._first_time:
            raise LookupError(
                f"no record at or before t={t} (the first is at t={self._first_time})"
            )
        raise LookupError(
            f"the record in effect at t={t} was dropped by retention (retain={self.retain}; "
            f"held from t={self._times[self._start]}, latest at t={self._times[-1]})"
        )

    def latest(self) -> tuple[int, float, V]:
        """(version, time, value) of the last record.

        Raises:
            LookupError: nothing recorded yet.
        """
        if not self._times:
            raise LookupError("the history is empty")
        return self._base + len(self._times) - 1, self._times[-1], self._values[-1]

    def staleness_at(self, t: float) -> int:
        """How many versions the latest is ahead of the one in effect at ``t``
        (:func:`staleness`); raises ``LookupError`` as :meth:`as_of` does."""
        return staleness(self.latest()[0], self.as_of(t)[0])

    def __len__(self) -> int:
        return len(self._times) - self._start

    def state_dict(self) -> dict[str, Any]:
        """The entries still retained, their versions' base and the first record's time."""
        return {
            "retain": self.retain,
            "times": self._times[self._start :],
            "values": self._values[self._start :],
            "base": self._base + self._start,
            "first_time": self._first_time,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` gave (the same ``retain``)."""
        if state["retain"] != self.retain:
            raise ValueError(f"state retains {state['retain']}, this history {self.retain}")
        self._times = [float(t) for t in state["times"]]
        self._values = list(state["values"])
        self._start, self._base = 0, int(state["base"])
        self._first_time = state["first_time"]
