"""Allowed values of numeric config keys, and a walk over a config's numeric values.

Paper: none. Shared by every component's config (the federated run, the trainers), so that
each declares a ``Range`` per numeric key and reports a value outside it the same way; also
the checks every config section runs in its ``__post_init__`` (``check``, ``check_ranges``,
``choices``) and ``recheck``, which runs them all again.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Literal, TypeVar, get_args, get_origin

from fedasync.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Range:
    """The values a numeric key allows: finite, between ``lo`` and ``hi`` (None: no bound),
    each bound closed or open."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, x: object) -> bool:
        if not isinstance(x, int | float) or isinstance(x, bool) or not math.isfinite(x):
            return False
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return False
        return self.hi is None or (x < self.hi if self.hi_open else x <= self.hi)

    def __str__(self) -> str:
        if self.lo is not None and self.hi is not None:
            return (
                f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                f"{')' if self.hi_open else ']'}"
            )
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return "a finite number"


POSITIVE = Range(0, lo_open=True)
NON_NEGATIVE = Range(0)
AT_LEAST_ONE = Range(1)
UNIT = Range(0, 1)
"""[0, 1]: fractions and probabilities."""
UNIT_OPEN_LOW = Range(0, 1, lo_open=True)
"""(0, 1]: a share that must not be zero."""
UNIT_OPEN = Range(0, 1, lo_open=True, hi_open=True)
"""(0, 1): a significance level."""
UNBOUNDED = Range()
"""Any finite number (declared, so that no numeric key is left unchecked by accident)."""


def numeric_values(cfg: Any, prefix: str = "") -> list[tuple[str, str, Any]]:
    """``(range key, key as the user writes it, value)`` of every numeric value in ``cfg``
    (a config dataclass), lists included; bools and None are not numeric."""
    out: list[tuple[str, str, Any]] = []
    for f in fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            rkey, shown = (key, key) if i is None else (f"{key}[]", f"{key}[{i}]")
            if is_dataclass(item):
                out += [
                    (r.replace(shown, rkey, 1), s, v)
                    for r, s, v in numeric_values(item, f"{shown}.")
                ]
            elif isinstance(item, int | float) and not isinstance(item, bool):
                out.append((rkey, shown, item))
    return out


def check(ok: bool, msg: str) -> None:
    """Raise ConfigError(``msg``) unless ``ok``: ``msg`` names the key."""
    if not ok:
        raise ConfigError(msg)


def check_ranges(section: Any, prefix: str, ranges: Mapping[str, Range]) -> None:
    """The numeric keys of the config section ``section`` itself (not of its sub-sections),
    named ``prefix`` + field, against ``ranges``; ConfigError naming the first outside."""
    depth = prefix.count(".")
    for rkey, key, value in numeric_values(section, prefix):
        if rkey.count(".") == depth:
            rng = ranges.get(rkey)
            check(rng is None or value in rng, f"{key} must be {rng}, got {value!r}")


def choices(tp: Any) -> tuple[Any, ...]:
    """The values the choice type ``tp`` allows: its Literal's, also when ``tp`` is the
    ``Annotated[str, Literal[...]]`` omegaconf is shown (empty: ``tp`` is no choice)."""
    for t in (tp, *getattr(tp, "__metadata__", ())):
        if get_origin(t) is Literal:
            return get_args(t)
    return ()


def _parts(cfg: Any) -> Iterator[Any]:
    """``cfg`` and every config dataclass in it, innermost first (the order they are built)."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        for item in value if isinstance(value, list) else [value]:
            if is_dataclass(item):
                yield from _parts(item)
    yield cfg


def recheck(cfg: T) -> T:
    """Run the checks of ``cfg``'s every section, then of the whole, again, and return it
    (they ran when it was built; this is for a caller that wants them said)."""
    for part in _parts(cfg):
        post_init = getattr(part, "__post_init__", None)
        if post_init is not None:
            post_init()
    return cfg
