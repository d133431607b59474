"""The logit pricing market of Calvano et al. (AER 2020, "Artificial Intelligence,
Algorithmic Pricing, and Collusion"), its Bertrand–Nash and monopoly benchmarks, and the
collusion index Δ = (π̄ − π_N) / (π_M − π_N).

Demand (multinomial logit with an outside good), for firm ``i`` of ``n``::

    q_i = exp((a − p_i) / mu) / (Σ_j exp((a − p_j) / mu) + exp(a0 / mu))

All firms share quality ``a`` and marginal cost ``c``, so both benchmarks are symmetric and
each reduces to one increasing scalar equation in the markup ``m = p − c``: Nash solves
``m = mu / (1 − q(m))`` (each firm's first-order condition), the joint-profit maximum
``m = mu / (1 − Q(m))`` with ``Q = n q`` the total inside share. Both are solved by bisection
to float precision (no SciPy), then checked against the first-order conditions of the full
price vector. With the defaults and ``n = 2``: p_N ≈ 1.473, p_M ≈ 1.925.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

_FOC_TOL = 1e-9


def _symmetric_share(m: float, n: int, a: float, a0: float, mu: float, c: float) -> float:
    """One firm's share when every firm charges ``c + m`` (stable: max exponent subtracted)."""
    u, u0 = (a - c - m) / mu, a0 / mu
    top = max(u, u0)
    e, e0 = math.exp(u - top), math.exp(u0 - top)
    return e / (n * e + e0)


@lru_cache(maxsize=64)
def _symmetric_markup(joint: bool, n: int, a: float, a0: float, mu: float, c: float) -> float:
    """The root of ``m (1 − s(m)) = mu`` with ``s`` one firm's share (Nash) or the total
    inside share (``joint``: monopoly). ``m (1 − s(m))`` increases from ``−mu`` at 0, so the
    root is unique; it lies at or above ``mu``."""

    def gap(m: float) -> float:
        share = _symmetric_share(m, n, a, a0, mu, c) * (n if joint else 1)
        return m * (1.0 - share) - mu

    lo, hi = mu, 2.0 * mu
    while gap(hi) <= 0:
        lo, hi = hi, 2.0 * hi
        if not math.isfinite(hi):
            raise RuntimeError("the markup equation has no finite root")
    if gap(lo) > 0:  # gap(mu) = −mu s <= 0, but guard an underflowed share
        lo = 0.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if gap(mid) <= 0:
            lo = mid
        else:
            hi = mid
    return hi if abs(gap(hi)) < abs(gap(lo)) else lo


@dataclass(frozen=True)
class LogitMarket:
    """A market of ``n`` symmetric firms with logit demand (Calvano et al. 2020, §I).

    ``a``: product quality (all firms); ``a0``: the outside good's; ``mu``: horizontal
    differentiation (→ 0: perfect substitutes); ``c``: marginal cost. Prices, profits and
    shares are per unit of time.
    """

    n: int = 2
    a: float = 2.0
    a0: float = 0.0
    mu: float = 0.25
    c: float = 1.0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("a", "a0", "mu", "c"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if not self.mu > 0:
            raise ValueError(f"mu must be > 0, got {self.mu}")

    def _check(self, p: np.ndarray) -> np.ndarray:
        p = np.asarray(p, dtype=np.float64)
        if p.ndim < 1 or p.shape[-1] != self.n:
            raise ValueError(f"prices must have shape (..., {self.n}), got {p.shape}")
        return p

    def demand(self, p: np.ndarray) -> np.ndarray:
        """Each firm's share q_i, shape of ``p``: ``(n,)`` or batched ``(..., n)``."""
        p = self._check(p)
        u = (self.a - p) / self.mu
        u0 = self.a0 / self.mu
        top = np.maximum(u.max(axis=-1, keepdims=True), u0)
        e = np.exp(u - top)
        return e / (e.sum(axis=-1, keepdims=True) + np.exp(u0 - top))

    def profits(self, p: np.ndarray) -> np.ndarray:
        """Each firm's profit per unit time (p_i − c) q_i, shape of ``p``."""
        p = self._check(p)
        return (p - self.c) * self.demand(p)

    def _markup(self, joint: bool) -> float:
        return _symmetric_markup(joint, self.n, self.a, self.a0, self.mu, self.c)

    def nash_prices(self) -> np.ndarray:
        """The one-shot Bertrand–Nash prices, shape ``(n,)``: p_i = c + mu / (1 − q_i(p)).

        Raises:
            RuntimeError: the solution misses the first-order conditions (no convergence).
        """
        p = np.full(self.n, self.c + self._markup(joint=False))
        residual = p - self.c - self.mu / (1.0 - self.demand(p))
        if not np.all(np.abs(residual) <= _FOC_TOL * max(1.0, float(p[0]))):
            raise RuntimeError(f"Nash prices did not converge: FOC residual {residual}")
        return p

    def monopoly_prices(self) -> np.ndarray:
        """The joint-profit-maximising prices, shape ``(n,)``: equal markups m with
        m = mu / (1 − Q), Q the total inside share.

        Raises:
            RuntimeError: no convergence, or the point is not a local maximum of joint profit.
        """
        p = np.full(self.n, self.c + self._markup(joint=True))
        share = float(self.demand(p).sum())
        residual = p[0] - self.c - self.mu / (1.0 - share)
        if not abs(residual) <= _FOC_TOL * max(1.0, float(p[0])):
            raise RuntimeError(f"monopoly prices did not converge: FOC residual {residual}")
        best = float(self.profits(p).sum())
        h = 1e-4 * max(1.0, float(p[0]))
        directions = [np.ones(self.n)] + list(np.eye(self.n))
        if self.n > 1:
            directions.append(np.eye(self.n)[0] - np.eye(self.n)[1])
        for d in directions:
            for sign in (1.0, -1.0):
                if float(self.profits(p + sign * h * d).sum()) > best:
                    raise RuntimeError(f"monopoly prices {p} are not a joint-profit maximum")
        return p

    def nash_profit(self) -> float:
        """Each firm's profit per unit time at the Nash prices."""
        return float(self.profits(self.nash_prices())[0])

    def monopoly_profit(self) -> float:
        """Each firm's profit per unit time at the monopoly prices."""
        return float(self.profits(self.monopoly_prices())[0])

    def price_bounds(self, xi: float) -> tuple[float, float]:
        """The price range [p_N − xi (p_M − p_N), p_M + xi (p_M − p_N)] (Calvano's grid)."""
        if not xi >= 0:
            raise ValueError(f"xi must be >= 0, got {xi}")
        p_n, p_m = float(self.nash_prices()[0]), float(self.monopoly_prices()[0])
        return p_n - xi * (p_m - p_n), p_m + xi * (p_m - p_n)

    def collusion_index(self, mean_profit: float | np.ndarray) -> float | np.ndarray:
        """Δ = (π̄ − π_N) / (π_M − π_N): 0 at Nash, 1 at monopoly profits (per firm, per
        unit time); an array is mapped element by element.

        Raises:
            ValueError: π_M = π_N (one firm: Nash is the monopoly), where Δ is undefined.
        """
        pi_n, pi_m = self.nash_profit(), self.monopoly_profit()
        if not pi_m > pi_n:
            raise ValueError(f"the collusion index needs π_M > π_N, got {pi_m} and {pi_n}")
        if isinstance(mean_profit, np.ndarray):
            return (mean_profit - pi_n) / (pi_m - pi_n)
        return (float(mean_profit) - pi_n) / (pi_m - pi_n)
