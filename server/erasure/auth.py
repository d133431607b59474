"""Credentials and authorisation for erasure requests.

Each silo holds one bearer token and may erase only its own data; the admin token may act
on any silo. The server keeps only SHA-256 hashes of the tokens (``credentials.json``,
mode 0600), so a leaked server file does not leak a usable token. Tokens travel in gRPC
metadata as ``authorization: Bearer <token>``; use TLS outside a single machine.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ADMIN = "admin"


@dataclass(frozen=True)
class Principal:
    """Who is calling: ``name`` is ``"admin"`` or ``"silo-<i>"`` (the audit log's requester)."""

    name: str
    role: str  # "admin" | "silo"
    silo: int | None = None

    @property
    def is_admin(self) -> bool:
        """True for the admin, who may act on any silo."""
        return self.role == ADMIN


def hash_token(token: str) -> str:
    """Hex SHA-256 of ``token``: the form ``credentials.json`` keeps."""
    return hashlib.sha256(token.encode()).hexdigest()


def write_private(path: Path, data: object) -> None:
    """Write ``data`` as JSON to ``path`` with mode 0600, atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def new_token() -> str:
    """A random bearer token (256 bits, URL-safe) that does not start with '-': a command
    line (``fedasync erase --token ...``) would read such a token as an option."""
    while True:
        token = secrets.token_urlsafe(32)
        if not token.startswith("-"):
            return token


def generate_credentials(num_silos: int, path: Path) -> dict[str, str]:
    """Make one token per silo plus an admin token; write their hashes to ``path`` (0600).

    Returns the plaintext tokens ``{"admin": ..., "silo-0": ..., ...}``: hand each silo its
    own and keep none on the server.
    """
    if num_silos < 0:
        raise ValueError("num_silos must be >= 0")
    tokens = {ADMIN: new_token()}
    entries: dict[str, dict[str, object]] = {hash_token(tokens[ADMIN]): {"role": ADMIN}}
    for i in range(num_silos):
        tokens[f"silo-{i}"] = new_token()
        entries[hash_token(tokens[f"silo-{i}"])] = {"role": "silo", "silo": i}
    write_private(Path(path), entries)
    return tokens


class Authorizer:
    """Maps a bearer token to a ``Principal`` and decides who may erase what."""

    def __init__(self, entries: dict[str, dict[str, object]]) -> None:
        self._entries: list[tuple[bytes, Principal]] = []
        for digest, info in entries.items():
            role = info.get("role")
            if role == ADMIN:
                principal = Principal(ADMIN, ADMIN)
            elif role == "silo" and isinstance(info.get("silo"), int):
                silo = int(info["silo"])  # type: ignore[call-overload]
                principal = Principal(f"silo-{silo}", "silo", silo)
            else:
                raise ValueError(f"bad credential entry: {info!r}")
            self._entries.append((bytes.fromhex(digest), principal))

    @classmethod
    def from_file(cls, path: Path | str) -> Authorizer:
        """Load the hashed entries :func:`generate_credentials` wrote to ``path``."""
        return cls(json.loads(Path(path).read_text()))

    @classmethod
    def from_tokens(cls, tokens: Iterable[tuple[str, Principal]]) -> Authorizer:
        """Build from plaintext ``(token, principal)`` pairs (tests, embedded use)."""
        entries: dict[str, dict[str, object]] = {}
        for token, p in tokens:
            entries[hash_token(token)] = (
                {"role": ADMIN} if p.is_admin else {"role": "silo", "silo": p.silo}
            )
        return cls(entries)

    def principal(self, token: str | None) -> Principal | None:
        """The principal holding ``token``, or None. Compares hashes in constant time and
        always scans every entry, so timing says nothing about which entry matched."""
        if not token:
            return None
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for stored, principal in self._entries:
            if hmac.compare_digest(stored, digest):
                found = principal
        return found

    @staticmethod
    def may_erase(principal: Principal, silo: int) -> bool:
        """Admin: any silo. A silo: only its own."""
        return principal.is_admin or (principal.role == "silo" and principal.silo == silo)

    @staticmethod
    def may_see(principal: Principal, silo: int) -> bool:
        """Who may read requests about ``silo``: the same rule as ``may_erase``."""
        return Authorizer.may_erase(principal, silo)


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` metadata entry, or None."""
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        text = value.decode() if isinstance(value, bytes) else value
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None
