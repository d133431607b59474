"""The three strategies fedasync started with: FedAsync, FedBuff, synchronous FedAvg."""

from __future__ import annotations

from fedasync import FedAsyncAggregator, FedBuffAggregator, make_weight_fn
from fedasync.aggregators import Aggregator
from server.strategies.strategy import Strategy, StrategyHost


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
        """It waits for the next round; with no round in progress (no job in flight: the
        federation was halted), the next round starts now."""
        if not host.inflight:
            for s in sorted(host.roster):
                host.dispatch(s)
