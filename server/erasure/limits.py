"""Bounds on everything a caller of the erasure service can send, defined once.

Every field of every request has a limit, and so has the whole message; a call over a
limit is refused (INVALID_ARGUMENT, or RESOURCE_EXHAUSTED for the message size and open
streams), never cut silently. Error messages quote caller input through ``quoted``, so a
huge value can never make the reply itself too big (gRPC status details travel as
metadata, a few KiB at most).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """The erasure service's limits. Defaults fit a silo of tens of thousands of samples."""

    max_message_bytes: int = 4 * 1024 * 1024
    """Largest request message (gRPC ``max_receive_message_length``)."""
    max_sample_ids: int = 65_536
    """Most sample ids in one Submit."""
    max_sample_id_chars: int = 256
    """Longest sample id."""
    max_reason_chars: int = 1024
    """Longest free-text reason."""
    max_key_chars: int = 128
    """Longest idempotency key."""
    max_request_id_chars: int = 128
    """Longest request id in Get and Watch (ids are 32 hex characters)."""
    max_states: int = 16
    """Most states in one List filter."""
    max_refusals: int = 1000
    """Most refusal rows in one ListRefusals answer."""
    max_certificate_bytes: int = 4 * 1024 * 1024
    """Largest Certificate answer (its JSON and HTML together, UTF-8): RESOURCE_EXHAUSTED
    beyond. A certificate lists at most ``max_sample_ids`` digests (2.3 MB of JSON) and is
    otherwise bounded (``certificate.Bounds``), so only an oversized store reaches it."""
    streams_per_principal: int = 2
    """Open streams (Watch, health Watch, reflection) per principal; an unauthenticated
    caller counts per peer host."""
    streams_total: int = 16
    """Open streams in all. Each holds one worker thread while open."""
    unary_workers: int = 8
    """Worker threads kept for unary calls and health checks beyond ``streams_total``."""

    @property
    def workers(self) -> int:
        """The thread pool's size: every stream may be open and unary calls still run."""
        return self.streams_total + self.unary_workers


QUOTE_CHARS = 40
"""Most characters of one caller value shown in an error message."""


def quoted(value: str, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length said when longer."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def named(values: Sequence[str], limit: int = 5) -> str:
    """Up to ``limit`` values, each ``quoted``, then how many more there are."""
    shown = ", ".join(quoted(s) for s in values[:limit])
    return shown + (f" (+{len(values) - limit} more)" if len(values) > limit else "")


@dataclass(frozen=True)
class Bounds:
    """The most a certificate holds of each thing (beyond: cut, and the count said)."""

    text_chars: int = 512
    """Longest text (a reason, an audit detail, a failure reason)."""
    digests: int = Limits.max_sample_ids
    """Most sample digests listed (as many as the service accepts in a request)."""
    audit_rows: int = 200
    """Most audit rows (the first and the last half of them)."""
    refusals: int = 100
    """Most refused calls naming the request (the newest)."""
    metrics: int = 64
    """Most metrics of one audit row."""
    points: int = 256
    """Most checks between the boundary and verification (``erasure_watch``), and most
    cancelled jobs."""
