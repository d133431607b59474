"""The strategy interface (the package's docstring says what a strategy decides) and what
every rule shares: the server optimiser, central DP's mechanism, the staleness weight."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

from fedasync import ServerOptimizer, make_weight_fn
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
    halts_for_erasure: ClassVar[bool] = False
    """Whether no silo trains while an erasure is carried out (until its boundary)."""
    rebuilds_for_erasure: ClassVar[bool] = False
    """Whether an erasure rebuilds the model without the silo from the retained history
    (FedEraser) instead of the server's removal and the silo's own part."""

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
        attribute = cfg.lab.erasure.server_removal and bool(cfg.erasures or cfg.unlearning.service)
        return {"mechanism": mech, "attribute": attribute}

    def _optimizer(self) -> ServerOptimizer:
        o = self.cfg.server.optimizer
        return ServerOptimizer(kind=o.kind, lr=o.lr, momentum=o.momentum)
