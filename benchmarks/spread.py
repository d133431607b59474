"""Figures over seeds: the mean and the spread (half the range) the benchmarks print."""

from __future__ import annotations

import math
import statistics


def mean_spread(xs: list[float | None]) -> tuple[float, float] | None:
    """(mean, half-range) of the values that are neither None nor NaN; None when none is."""
    v = [x for x in xs if x is not None and not math.isnan(x)]
    if not v:
        return None
    return statistics.fmean(v), (max(v) - min(v)) / 2


def fmt(ms: tuple[float, float] | None, spec: str = ".2f") -> str:
    """``mean ± spread`` (``-`` for none)."""
    return "-" if ms is None else f"{ms[0]:{spec}} ± {ms[1]:{spec}}"
