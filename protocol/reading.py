"""Reading a message strictly: the two errors every ``from_message`` raises, and the readers.

- ``ErrorReply``: the reply is Flower's error reply (the ClientApp raised, the SuperLink reports
  the node unavailable, the message expired).
- ``Malformed`` (a ``ValueError``): the message is not what the protocol says. Its text is
  bounded (at most ``LIMIT`` characters, never unbounded input) and starts with what failed:
  ``missing or bad field: ...``, ``arrays do not decode: ...``, or the failed check itself.

The readers below raise ``KeyError`` / ``TypeError`` / ``ValueError`` as the plain expressions
would; inside ``with fields():`` those become ``Malformed``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TypeVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode

from protocol import keys as P
from protocol import wire
from protocol.config import parse_setup

Params = dict[str, torch.Tensor]
"""A model's (or an update's) named tensors."""
LIMIT = 300
"""The longest text an error of this module carries."""
_R = TypeVar("_R", ArrayRecord, ConfigRecord, MetricRecord)


def bounded(text: object, limit: int = LIMIT) -> str:
    """``str(text)``, cut to at most ``limit`` characters."""
    s = str(text)
    return s if len(s) <= limit else s[: limit - 3] + "..."


class Malformed(ValueError):
    """A message that is not what the protocol says (its text is bounded)."""

    def __init__(self, detail: str):
        """``detail`` is cut to ``LIMIT`` characters."""
        super().__init__(bounded(detail))


class ErrorReply(Exception):
    """A reply that is Flower's error reply: ``code`` (``flwr.common.constant.ErrorCode``) and
    the first and last lines of its reason, each at most ``LIMIT`` characters (a traceback's
    last line names the exception)."""

    def __init__(self, code: int, reason: str | None):
        """From the Error's code and (possibly unbounded, multi-line) reason."""
        text = "unknown error" if reason is None else str(reason)
        self.code = int(code)
        self.first_line = (text.splitlines() or [""])[0][:LIMIT]
        lines = text.strip().splitlines()
        self.last_line = (lines[-1] if lines else "")[:LIMIT]
        super().__init__(f"error reply (code {self.code}): {self.last_line}")

    @property
    def offline(self) -> bool:
        """The SuperLink reported the node unavailable (its heartbeats stopped)."""
        return self.code == ErrorCode.NODE_UNAVAILABLE

    @classmethod
    def check(cls, reply: Message) -> None:
        """Raise the ErrorReply ``reply`` is, if it is one."""
        if reply.has_error():
            raise cls(reply.error.code, reply.error.reason)


@contextmanager
def fields() -> Iterator[None]:
    """Turn a missing key or a value of the wrong type read inside into ``Malformed``."""
    try:
        yield
    except Malformed:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise Malformed(f"missing or bad field: {str(e)[:200]}") from e


def record(content: RecordDict, key: str, kind: type[_R]) -> _R:
    """``content[key]``, which must be a ``kind`` record (KeyError, TypeError)."""
    rec = content[key]
    if not isinstance(rec, kind):
        raise TypeError(f"{key!r} is not a {kind.__name__}")
    return rec


def arrays(
    content: RecordDict, key: str, *, shared: bool = False
) -> tuple[Params, torch.Tensor | None]:
    """``wire.decode_with_flat(content[key], shared=shared)``; Malformed when absent or not
    decodable."""
    with fields():
        rec = record(content, key, ArrayRecord)
    try:
        return wire.decode_with_flat(rec, shared=shared)
    except Exception as e:  # noqa: BLE001 - any decoding failure is a malformed message
        what = "arrays" if key == P.ARRAYS else f"{key} arrays"
        raise Malformed(f"{what} do not decode: {e}") from e


def text(rec: ConfigRecord, key: str, default: str | None = None) -> str:
    """A string value (``default`` when given and the key is absent)."""
    if default is not None and key not in rec:
        return default
    v = rec[key]
    if not isinstance(v, str):
        raise TypeError(f"{key!r} must be a string, not {type(v).__name__}")
    return v


def flag(rec: ConfigRecord, key: str) -> bool:
    """A boolean value (absent: False; an integer counts as its truth value)."""
    v = rec.get(key, False)
    if not isinstance(v, bool | int):
        raise TypeError(f"{key!r} must be a boolean, not {type(v).__name__}")
    return bool(v)


def strings(rec: ConfigRecord, key: str) -> tuple[str, ...]:
    """A list value as strings (absent: empty)."""
    v = rec.get(key, [])
    if not isinstance(v, list):
        raise TypeError(f"{key!r} must be a list, not {type(v).__name__}")
    return tuple(str(x) for x in v)


def scalars(metrics: MetricRecord, skip: tuple[str, ...]) -> dict[str, float]:
    """Every metric but ``skip`` as a float (a list-valued one is a TypeError)."""
    return {k: P.as_float(v) for k, v in metrics.items() if k not in skip}


def check_setup(setup_json: str) -> None:
    """Malformed unless ``setup_json`` is a valid ``Setup`` (parsed once, then cached)."""
    try:
        parse_setup(setup_json)
    except ValueError as e:
        raise Malformed(str(e)) from e


def no_reserved(metrics: Mapping[str, float], reserved: tuple[str, ...]) -> None:
    """ValueError when ``metrics`` repeats a key the message keeps in a field of its own."""
    clash = sorted(set(metrics) & set(reserved))
    if clash:
        raise ValueError(f"metrics may not use the reserved keys {clash}")
