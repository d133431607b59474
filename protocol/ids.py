"""Salted digests of a silo's sample ids: how the coordinator checks erasure requests against
ids it never holds.

At the roster query the coordinator sends a fresh random salt (per run, never stored); each
silo answers with ``HMAC-SHA256(salt, id)`` cut to ``DIGEST_BYTES`` for every sample it trains
on, once. The erasure service then checks a request's ids by digesting them with the same salt
(``DigestSet``): an unknown id is refused at once, even while the silo is offline, and a
request that covers every sample becomes a whole-silo erasure, as with ids in the clear.

What it protects: the coordinator (its memory, logs, checkpoints, the erasure store of other
requests) never holds a silo's list of ids; digests of another run cannot be matched with this
one's. What it does not: the coordinator knows the salt, so it can test an id it guesses.
Ids that must stay secret should be opaque (a datalist entry's ``id``, e.g. a UUID).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Iterator, Sequence, Set

import numpy as np

from fedasync import seeds

DIGEST_BYTES = 16
"""128 bits: collisions among a silo's ids are out of reach (birthday bound ~2^64 ids)."""
MAX_IDS = 2_000_000
"""The most digests one silo may report (32 MB at 16 bytes each)."""


def new_salt() -> str:
    """A fresh random salt (32 hex characters) for one run's roster query."""
    return secrets.token_hex(16)


def digest(salt: str, sample_id: str) -> bytes:
    """``HMAC-SHA256(salt, sample_id)``, the first ``DIGEST_BYTES`` bytes."""
    mac = hmac.new(salt.encode(), str(sample_id).encode(), hashlib.sha256)
    return mac.digest()[:DIGEST_BYTES]


def digest_all(salt: str, sample_ids: Iterable[str]) -> bytes:
    """The digests of ``sample_ids``, concatenated in order (what a silo reports)."""
    return b"".join(digest(salt, s) for s in sample_ids)


def split(blob: bytes) -> list[bytes]:
    """The digests a report concatenates; ValueError when its length is not a multiple of
    ``DIGEST_BYTES`` or it holds more than ``MAX_IDS``."""
    if len(blob) % DIGEST_BYTES:
        raise ValueError(f"id digests are {len(blob)} bytes, not a multiple of {DIGEST_BYTES}")
    n = len(blob) // DIGEST_BYTES
    if n > MAX_IDS:
        raise ValueError(f"{n} id digests (at most {MAX_IDS})")
    return [blob[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES] for i in range(n)]


class DigestSet(Set[str]):
    """The sample ids of one silo as the coordinator knows them: ``id in s`` digests ``id``
    with the run's salt; ``s <= ids`` says whether ``ids`` cover every sample. Iterating it
    is refused (the ids are not there to list)."""

    def __init__(self, salt: str, digests: Iterable[bytes]):
        """The silo's reported ``digests`` under ``salt``."""
        self.salt = salt
        self.digests = frozenset(digests)

    def __contains__(self, sample_id: object) -> bool:
        """Whether the silo reported ``sample_id`` (a string)."""
        return isinstance(sample_id, str) and digest(self.salt, sample_id) in self.digests

    def __len__(self) -> int:
        """How many distinct ids the silo reported."""
        return len(self.digests)

    def __iter__(self) -> Iterator[str]:
        """Not possible: the coordinator holds digests, not ids."""
        raise TypeError("a silo's sample ids are known here only as digests: they cannot be listed")

    def __le__(self, other: object) -> bool:
        """Whether every id of the silo is among ``other`` (an iterable of ids)."""
        if not isinstance(other, Iterable):
            return NotImplemented
        return self.digests <= {digest(self.salt, str(s)) for s in other}


def fraction_ids(ids: Sequence[str], seed: int, silo: int, fraction: float) -> list[str]:
    """The seeded share ``fraction`` of silo ``silo``'s sample ``ids`` (at least one), sorted:
    what a scheduled sample-level erasure (``erasures[].fraction``) erases and what its
    retraining reference (``lab.exclude_samples``) never trains on."""
    rng = seeds.rng(seed, "erasure.fraction", silo)
    k = max(1, int(round(fraction * len(ids))))
    return sorted(str(x) for x in rng.choice(np.asarray(ids), size=k, replace=False))
