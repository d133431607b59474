"""Strategies: the rule that folds an update, and what the server sends when.

Paper: each strategy's own (below). In the spirit of Flower's ``Strategy``, kept apart from
the Grid: the loop (server/loop.py) keeps the Grid, the clock and the version, takes each
reply in order and has it corrected (server/corrections.py); a strategy decides the rest, and
the loop and its parts never ask which one runs:

- ``aggregator``: the core rule that folds a corrected update into the model
  (fedasync/aggregators.py), built with what every rule shares (the server optimiser, central
  DP's mechanism, whether each silo's share is attributed for an erasure);
- ``evaluates``: whether a new version is evaluated;
- ``replies_taken``: what is sent once the replies of one poll are taken (their silos are
  ``ready``);
- ``failed``: what happens to a silo whose job failed (``down_s``: how long it is down);
- ``free``: a silo that may train again outside that flow (its retry is due, an erasure
  released it, a resumed run found it between two jobs).

``FedAsync`` (Xie et al. 2019) folds every update at once and sends its silo the newest model;
``FedBuff`` (Nguyen et al. 2022) buffers K updates per server step; ``SyncFedAvg`` is
synchronous FedAvg (McMahan et al. 2017) on the same silos and clock: a round waits for every
silo's reply, so one straggler stalls everyone. Adding a rule is a class here and a name in
``STRATEGIES`` (``server.mode``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

from fedasync import (
    FedAsyncAggregator,
    FedBuffAggregator,
    ServerOptimizer,
    make_weight_fn,
)
from fedasync.aggregators import Aggregator
from fedasync.privacy import GaussianMechanism
from server.config import FedAsyncConfig


class StrategyHost(Protocol):
    """What a strategy sees of the loop: the silos, the jobs in flight, and the few actions
    it may ask for."""

    @property
    def roster(self) -> Mapping[int, int]:
        """The silos: silo -> node id."""
        ...

    @property
    def inflight(self) -> Mapping[str, Any]:
        """The jobs in flight, by message id."""
        ...

    def dispatch(self, silo: int) -> None:
        """Send ``silo`` training work with the newest model (if it may train)."""
        ...

    def retry_after(self, silo: int, down_s: float) -> None:
        """Make ``silo`` free again ``down_s`` clock seconds from now (``Strategy.free``)."""
        ...

    def flush(self) -> None:
        """Fold what the aggregator holds as the next version (a round's end)."""
        ...


class Strategy:
    """An asynchronous strategy: every silo is kept busy, each one sent work as soon as it is
    free. Subclasses give the fold rule (``aggregator``)."""

    name: ClassVar[str]
    """Its ``server.mode``."""

    def __init__(self, cfg: FedAsyncConfig):
        self.cfg = cfg

    def aggregator(self) -> Aggregator:
        """The core rule that folds a corrected update into the model."""
        raise NotImplementedError

    def evaluates(self, version: int) -> bool:
        """Whether ``version`` is evaluated: every ``server.eval_every``-th."""
        return version % self.cfg.server.eval_every == 0

    def replies_taken(self, host: StrategyHost, ready: list[int]) -> None:
        """Each silo whose reply was taken is sent the newest model at once."""
        for silo in sorted(ready):
            host.dispatch(silo)

    def failed(self, host: StrategyHost, silo: int, down_s: float) -> None:
        """A silo whose job failed is free again after ``down_s``."""
        host.retry_after(silo, down_s)

    def free(self, host: StrategyHost, silo: int) -> None:
        """A free silo is sent work at once."""
        host.dispatch(silo)

    # what every rule shares
    def _weight_fn(self) -> Any:
        s = self.cfg.server.staleness
        return make_weight_fn(s.fn, s.a, s.b)

    def _shared(self) -> dict[str, Any]:
        """The fold's keyword arguments every rule takes: central DP's mechanism (noise from
        OS entropy), and whether each fold attributes its change to the silos (only where an
        erasure can happen and the server's removal reads them)."""
        cfg, s = self.cfg, self.cfg.server
        mech = None
        if s.dp.noise_multiplier is not None and s.clip_norm is not None:
            mech = GaussianMechanism(s.clip_norm, s.dp.noise_multiplier)
        attribute = cfg.unlearning.server_removal and bool(cfg.erasures or cfg.unlearning.service)
        return {"mechanism": mech, "attribute": attribute}

    def _optimizer(self) -> ServerOptimizer:
        o = self.cfg.server.optimizer
        return ServerOptimizer(kind=o.kind, lr=o.lr, momentum=o.momentum)


class FedAsync(Strategy):
    """FedAsync (Xie et al. 2019): every update is mixed in as it arrives,
    w <- (1 - a_t) w + a_t (w + delta), a_t = ``server.alpha`` times the staleness weight."""

    name = "fedasync"

    def aggregator(self) -> Aggregator:
        """FedAsync's mixing (`fedasync.FedAsyncAggregator`)."""
        return FedAsyncAggregator(self.cfg.server.alpha, self._weight_fn(), **self._shared())


class FedBuff(Strategy):
    """FedBuff (Nguyen et al. 2022): ``server.buffer_size`` staleness-weighted updates are
    averaged into one server optimiser step."""

    name = "fedbuff"

    def aggregator(self) -> Aggregator:
        """FedBuff's buffer and server optimiser (`fedasync.FedBuffAggregator`)."""
        s = self.cfg.server
        return FedBuffAggregator(
            s.buffer_size,
            self._weight_fn(),
            weight_by_samples=s.sample_weighting,
            optimizer=self._optimizer(),
            **self._shared(),
        )


class SyncFedAvg(Strategy):
    """Synchronous FedAvg (McMahan et al. 2017), the baseline: a round sends every silo the
    same model and waits for every reply; the round's updates are averaged (FedBuff's buffer
    with K = all silos and no staleness weight) and every version is evaluated. A silo that
    fails or comes free mid-round rejoins at the next round."""

    name = "sync"

    def aggregator(self) -> Aggregator:
        """FedBuff's buffer of every silo's update, weighted alike."""
        return FedBuffAggregator(
            self.cfg.silos.count,
            make_weight_fn("constant"),
            weight_by_samples=self.cfg.server.sample_weighting,
            optimizer=self._optimizer(),
            **self._shared(),
        )

    def evaluates(self, version: int) -> bool:
        """Every round (rounds are few and long)."""
        return True

    def replies_taken(self, host: StrategyHost, ready: list[int]) -> None:
        """The round ends when no job is in flight: what it brought is averaged, then every
        silo is sent the new model."""
        if host.inflight:
            return
        host.flush()
        for silo in sorted(host.roster):
            host.dispatch(silo)

    def failed(self, host: StrategyHost, silo: int, down_s: float) -> None:
        """It rejoins at the next round."""

    def free(self, host: StrategyHost, silo: int) -> None:
        """It waits for the next round."""


STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (FedAsync, FedBuff, SyncFedAvg)}
"""The strategies by ``server.mode``."""


def strategy_for(cfg: FedAsyncConfig) -> Strategy:
    """The strategy ``server.mode`` names."""
    return STRATEGIES[cfg.server.mode](cfg)
