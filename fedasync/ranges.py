"""Allowed values of numeric config keys, and a walk over a config's numeric values.

Paper: none. Shared by every component's config (the federated run, the trainers), so that
each declares a ``Range`` per numeric key and reports a value outside it the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, is_dataclass
from typing import Any


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
