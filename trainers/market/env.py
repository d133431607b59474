"""The logit market in continuous time: firms revise prices on Poisson clocks and see their
competitors' prices ``latency`` time units late (arXiv 2606.09884, after the discrete-time
market of Calvano et al., AER 2020).

Departure from Calvano et al.: time is continuous. A firm earns profit at a rate (per unit
time) that changes only when some price changes, so prices are piecewise constant and every
integral here is exact: the undiscounted one for the measures (``profit_integral``), the
discounted one, at rate ``discount_rate`` (ρ), for a firm's rewards (``settle``). A firm's
learning problem is then a semi-MDP: between two of its revisions it collects
``∫ e^{−ρ (s − t_i)} π_i(s) ds`` and its future is discounted by ``e^{−ρ (t − t_i)}``.

Revision events come from :class:`fedasync.clock.PoissonClocks`; each firm's posted price is
a :class:`fedasync.versions.TimedHistory`, read ``latency`` late by the others (kept only as
far back as that, so memory stays bounded).

Order within one event (the engine's contract): at a synchronous event all movers
``observe`` before any of them ``post``s, so each observation is the state before this
event's posts. An ``observe`` after another firm's ``post`` at the same time would see that
post when ``latency`` is 0 (it is in effect from ``now`` on).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedasync.clock import PoissonClocks
from fedasync.versions import TimedHistory, staleness
from trainers.market.market import LogitMarket


class ContinuousMarket:
    """``market``'s firms on Poisson clocks of rate ``rate`` (asynchronous: one per firm;
    ``synchronous``: one for all), seeing competitors ``latency`` late, rewards discounted
    at ``discount_rate`` per unit time. Prices start at ``init_prices`` (shape ``(n,)``),
    in effect since before time 0; time starts at 0.
    """

    def __init__(
        self,
        market: LogitMarket,
        *,
        rate: float,
        synchronous: bool,
        latency: float,
        discount_rate: float,
        init_prices: np.ndarray,
        rng: np.random.Generator,
    ) -> None:
        if not (math.isfinite(latency) and latency >= 0):
            raise ValueError(f"latency must be >= 0 and finite, got {latency}")
        if not (math.isfinite(discount_rate) and discount_rate >= 0):
            raise ValueError(f"discount_rate must be >= 0 and finite, got {discount_rate}")
        init = np.array(init_prices, dtype=np.float64)
        if init.shape != (market.n,) or not np.all(np.isfinite(init)):
            raise ValueError(f"init_prices must be {market.n} finite prices, got {init_prices}")
        self.market = market
        self.latency = float(latency)
        self.discount_rate = float(discount_rate)
        self._clocks = PoissonClocks(market.n, rate, synchronous=synchronous, rng=rng)
        self._init = [float(x) for x in init]
        self._prices = init
        self._posted: list[TimedHistory[float]] = []
        for price in self._init:
            history: TimedHistory[float] = TimedHistory(retain=self.latency)
            history.record(0.0, price)
            self._posted.append(history)
        self._integral = np.zeros(market.n)  # ∫_0^now π_i dt
        self._reward = np.zeros(market.n)  # ∫_{t_i}^now e^{−ρ (s − t_i)} π_i(s) ds
        self._since = np.zeros(market.n)  # t_i: each firm's previous settle

    @property
    def n(self) -> int:
        """Number of firms."""
        return self.market.n

    @property
    def now(self) -> float:
        """Current time (that of the last revision event; 0 before the first)."""
        return self._clocks.now

    @property
    def prices(self) -> np.ndarray:
        """The posted prices now, shape ``(n,)`` (a copy)."""
        return self._prices.copy()

    def next_revision(self) -> tuple[float, tuple[int, ...]]:
        """Advance to the next revision event, accruing every firm's profit up to it; returns
        (its time, the firms that revise then, sorted)."""
        start = self.now
        t, movers = self._clocks.next()
        dt = t - start
        profit = self.market.profits(self._prices)
        self._integral += profit * dt
        rho = self.discount_rate
        if rho == 0:
            self._reward += profit * dt
        else:  # π e^{−ρ (s0 − t_i)} (1 − e^{−ρ (s1 − s0)}) / ρ
            self._reward += (
                profit * np.exp(-rho * (start - self._since)) * (-math.expm1(-rho * dt) / rho)
            )
        return t, movers

    def _firm(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"firm {i} is not one of 0..{self.n - 1}")
        return i

    def _seen(self, j: int) -> tuple[int, float]:
        """(version, price) of firm ``j``'s post as seen by the others now."""
        t = self.now - self.latency
        if t < 0:  # before time 0: the initial price (version 0)
            return 0, self._init[j]
        return self._posted[j].as_of(t)

    def observe(self, i: int) -> np.ndarray:
        """Firm ``i``'s observation now, shape ``(n,)``: its own posted price and each
        competitor's as of ``now − latency``. With latency 0 it equals :attr:`prices`."""
        i = self._firm(i)
        obs = np.empty(self.n)
        for j in range(self.n):
            obs[j] = self._prices[j] if j == i else self._seen(j)[1]
        return obs

    def observed_age(self, i: int) -> np.ndarray:
        """For each competitor, how many of its posts firm ``i`` has not seen yet (a post
        of an unchanged price counts too); 0 for itself. Shape ``(n,)``, integers. (A
        diagnostic.)"""
        i = self._firm(i)
        age = np.zeros(self.n, dtype=np.int64)
        t = self.now - self.latency
        for j in range(self.n):
            if j == i:
                continue
            if t < 0:  # still seeing the initial price, version 0
                age[j] = staleness(self._posted[j].latest()[0], 0)
            else:
                age[j] = self._posted[j].staleness_at(t)
        return age

    def post(self, i: int, price: float) -> None:
        """Firm ``i`` charges ``price`` from now on."""
        i = self._firm(i)
        price = float(price)
        if not math.isfinite(price):
            raise ValueError(f"price must be finite, got {price}")
        self._prices[i] = price
        self._posted[i].record(self.now, price)

    def settle(self, i: int) -> tuple[float, float, float]:
        """Firm ``i``'s semi-MDP transition since its previous settle (or time 0) at t_i:
        (reward ∫_{t_i}^{now} e^{−ρ (s − t_i)} π_i(s) ds, discount e^{−ρ (now − t_i)},
        elapsed now − t_i); its accrual restarts now."""
        i = self._firm(i)
        elapsed = self.now - float(self._since[i])
        reward = float(self._reward[i])
        discount = math.exp(-self.discount_rate * elapsed)
        self._reward[i] = 0.0
        self._since[i] = self.now
        return reward, discount, elapsed

    def state_dict(self) -> dict[str, Any]:
        """The clocks, the prices, every firm's posts still seen and its accruals."""
        return {
            "clocks": self._clocks.state_dict(),
            "prices": self._prices.tolist(),
            "posted": [h.state_dict() for h in self._posted],
            "integral": self._integral.tolist(),
            "reward": self._reward.tolist(),
            "since": self._since.tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from what `state_dict` gave: the same events and profits follow."""
        self._clocks.load_state_dict(state["clocks"])
        self._prices = np.array(state["prices"], dtype=np.float64)
        for h, saved in zip(self._posted, state["posted"], strict=True):
            h.load_state_dict(saved)
        self._integral = np.array(state["integral"], dtype=np.float64)
        self._reward = np.array(state["reward"], dtype=np.float64)
        self._since = np.array(state["since"], dtype=np.float64)

    def profit_integral(self) -> np.ndarray:
        """Each firm's undiscounted ∫_0^now π_i dt, shape ``(n,)`` (a copy); differences over
        a window / its length give time-average profits."""
        return self._integral.copy()
