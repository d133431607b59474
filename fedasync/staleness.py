"""Staleness weight functions and staleness bounds.

Paper: FedAsync (Xie et al. 2019, arXiv:1903.03934), section "staleness functions"
s(t − τ), with τ the staleness:

- constant:    s(τ) = 1
- polynomial:  s(τ) = (τ + 1)^(−a)
- hinge:       s(τ) = 1 if τ ≤ b else 1 / (a(τ − b) + 1)
- exponential: s(τ) = exp(−a τ)   (not in FedAsync; common in later async FL work)

Departure: FedAsync only down-weights; :class:`StalenessBound` adds a hard cut-off
(``max_staleness``, as in FedBuff's bounded-staleness analysis, Nguyen et al. 2022) and an
optional soft band that multiplies the weight by a fixed factor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from fedasync.errors import ConfigError

WeightFn = Callable[[int], float]


def _check_tau(tau: int) -> None:
    if tau < 0:
        raise ValueError(f"staleness must be >= 0, got {tau}")


def constant(tau: int) -> float:
    """s(τ) = 1."""
    _check_tau(tau)
    return 1.0


def polynomial(tau: int, a: float) -> float:
    """s(τ) = (τ + 1)^(−a)."""
    _check_tau(tau)
    return float((tau + 1) ** (-a))


def hinge(tau: int, a: float, b: float) -> float:
    """s(τ) = 1 if τ ≤ b else 1 / (a(τ − b) + 1)."""
    _check_tau(tau)
    return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)


def exponential(tau: int, a: float) -> float:
    """s(τ) = exp(−a τ)."""
    _check_tau(tau)
    return math.exp(-a * tau)


WeightFnName = Literal["constant", "polynomial", "hinge", "exponential"]
"""The weight functions' names: the type of a config's choice of one (``server.staleness.fn``,
``learner.weight_fn``). It is the source; WEIGHT_FUNCTIONS is keyed by it (mypy checks every
key is one of these) and checked at import to hold every one, in this order."""

WEIGHT_FUNCTIONS: dict[WeightFnName, Callable[..., float]] = {
    "constant": constant,
    "polynomial": polynomial,
    "hinge": hinge,
    "exponential": exponential,
}
"""Weight functions by name; each takes ``tau`` then its own parameters."""

if tuple(WEIGHT_FUNCTIONS) != get_args(WeightFnName):  # not an assert: kept under python -O
    raise AssertionError(
        f"WEIGHT_FUNCTIONS {tuple(WEIGHT_FUNCTIONS)} != WeightFnName {get_args(WeightFnName)}"
    )


def weights_of(name: str, taus: torch.Tensor, a: float = 0.5, b: float = 4) -> torch.Tensor:
    """The weight function ``name`` over a tensor of staleness values at once (float, same
    shape): the same numbers as :func:`make_weight_fn` element by element, without a Python
    loop. Raises ValueError on a negative τ, ConfigError on an unknown name."""
    if taus.numel() and bool((taus < 0).any()):
        raise ValueError(f"staleness must be >= 0, got {int(taus.min())}")
    t = taus.to(torch.float64)
    if name == "constant":
        out = torch.ones_like(t)
    elif name == "polynomial":
        out = (t + 1.0) ** (-a)
    elif name == "hinge":
        out = torch.where(t <= b, torch.ones_like(t), 1.0 / (a * (t - b) + 1.0))
    elif name == "exponential":
        out = torch.exp(-a * t)
    else:
        make_weight_fn(name)  # raises the named ConfigError
        raise AssertionError(name)  # pragma: no cover
    return out.to(torch.get_default_dtype())


def make_weight_fn(name: str, a: float = 0.5, b: float = 4) -> WeightFn:
    """Bind a weight function's parameters: returns ``tau -> s(tau)``.

    ``a`` is used by polynomial/hinge/exponential, ``b`` by hinge only.
    """
    if name == "constant":
        return constant
    if name == "polynomial":
        return lambda tau: polynomial(tau, a)
    if name == "hinge":
        return lambda tau: hinge(tau, a, b)
    if name == "exponential":
        return lambda tau: exponential(tau, a)
    raise ConfigError(
        f"unknown staleness weight function {name!r} (server.staleness.fn); valid: "
        f"{sorted(WEIGHT_FUNCTIONS)}"
    )


@dataclass(frozen=True)
class BoundDecision:
    """What to do with an update of a given staleness."""

    action: Literal["accept", "downweight", "reject"]
    factor: float
    """Multiplier on the update's weight: 1.0 accept, ``soft_factor`` downweight, 0.0 reject."""
    reason: str
    """Human-readable explanation, logged with the decision."""


@dataclass
class StalenessBound:
    """Accept / down-weight / reject an update by its staleness τ.

    τ > ``max_staleness`` → reject; ``soft_staleness`` < τ ≤ ``max_staleness`` → downweight
    by ``soft_factor``; otherwise accept. ``None`` disables a threshold.
    """

    max_staleness: int | None = None
    """Reject updates staler than this (``None``: never reject)."""
    soft_staleness: int | None = None
    """Down-weight updates staler than this (``None``: never down-weight)."""
    soft_factor: float = 0.5
    """Factor in (0, 1] applied to down-weighted updates."""

    def __post_init__(self) -> None:
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(
                f"max_staleness (server.max_staleness) must be >= 0, got {self.max_staleness}"
            )
        if self.soft_staleness is not None and self.soft_staleness < 0:
            raise ConfigError(
                f"soft_staleness (lab.soft_staleness) must be >= 0, got {self.soft_staleness}"
            )
        if (
            self.max_staleness is not None
            and self.soft_staleness is not None
            and self.soft_staleness > self.max_staleness
        ):
            raise ConfigError(
                f"soft_staleness {self.soft_staleness} > max_staleness {self.max_staleness}"
            )
        if not 0.0 < self.soft_factor <= 1.0:
            raise ConfigError(
                f"soft_factor (lab.soft_factor) must be in (0, 1], got {self.soft_factor}"
            )

    def check(self, tau: int) -> BoundDecision:
        """Decide for staleness ``tau`` (≥ 0)."""
        _check_tau(tau)
        if self.max_staleness is not None and tau > self.max_staleness:
            return BoundDecision(
                "reject", 0.0, f"staleness {tau} > max_staleness {self.max_staleness}"
            )
        if self.soft_staleness is not None and tau > self.soft_staleness:
            return BoundDecision(
                "downweight",
                self.soft_factor,
                f"staleness {tau} > soft_staleness {self.soft_staleness}",
            )
        return BoundDecision("accept", 1.0, f"staleness {tau} within bounds")

    def factors(self, taus: torch.Tensor) -> torch.Tensor:
        """:meth:`check`'s factor for a tensor of staleness values at once (float, same shape):
        0 where rejected, ``soft_factor`` where down-weighted, 1 elsewhere; a batch's mask is
        ``factors(taus) > 0``."""
        if taus.numel() and bool((taus < 0).any()):
            raise ValueError(f"staleness must be >= 0, got {int(taus.min())}")
        out = torch.ones(taus.shape, dtype=torch.get_default_dtype())
        if self.soft_staleness is not None:
            out = torch.where(taus > self.soft_staleness, torch.tensor(self.soft_factor), out)
        if self.max_staleness is not None:
            out = torch.where(taus > self.max_staleness, torch.tensor(0.0), out)
        return out
