"""Erasure records as the store returns them: requests, audit rows, change-feed events and
refused calls.

Plain frozen dataclasses (not database rows), so the service, the training server and the
tests share one vocabulary; times are milliseconds since the epoch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from server.erasure.states import State


def now_ms() -> int:
    """Milliseconds since the epoch (the wall clock every record's time is on)."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class Request:
    """One erasure request as stored. ``sample_ids`` is empty when ``whole_silo``."""

    id: str
    silo: int
    sample_ids: tuple[str, ...]
    whole_silo: bool
    state: State
    failure_reason: str
    requester: str
    reason: str
    idempotency_key: str | None
    created_at_ms: int
    updated_at_ms: int
    model_version_at_submit: int
    boundary_version: int
    """Version at which the erasure was applied; -1 while unknown."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class AuditRow:
    """One line of the audit log: a submit, a state change, or a note (``action``) that
    changes no state (``from_state == to_state``), e.g. resumed after a restart."""

    seq: int
    time_ms: int
    request_id: str
    requester: str
    actor: str
    action: str
    from_state: State | None
    to_state: State
    model_version: int
    detail: str
    metrics: dict[str, float] = field(default_factory=dict)
    facts: dict[str, str] = field(default_factory=dict)
    """Named strings recorded with the row (the model's SHA-256 before and after, the
    calibration in force; ``ErasureStore.transition``'s ``facts``)."""


@dataclass(frozen=True)
class Event:
    """A change-feed entry (what ``Watch`` streams): request ``request_id`` entered ``state``."""

    seq: int
    request_id: str
    silo: int
    state: State
    model_version: int
    time_ms: int
    detail: str
    actor: str
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Refusal:
    """One refused call to the erasure service (texts already cut to a bounded length)."""

    time_ms: int
    who: str
    """Principal name, or ``"unauthenticated"``."""
    peer: str
    method: str
    code: str
    """gRPC status code name."""
    reason: str


@dataclass(frozen=True)
class RefusalCount:
    """How many calls ``who`` made to ``method`` that were refused with ``code``."""

    who: str
    method: str
    code: str
    count: int
    last_ms: int


class RequestNotFound(KeyError):
    """No request with that id."""
