"""CA2FL: asynchronous FL with cached update calibration (``server.mode=ca2fl``).

Paper: Wang, Cheng, Liu, Fan, Chen and Zhou, "Tackling the Data Heterogeneity in Asynchronous
Federated Learning with Cached Update Calibration", ICLR 2024 (OpenReview 4aywmeb97I),
Algorithm 1. The server caches each silo's latest update h_i (zero before its first) and
buffers M updates, as FedBuff does. An update Δ_i of silo i enters the buffer as its
calibration Δ_i − h_i, and h_i ← Δ_i at once. When the buffer holds M, the server steps along

    v = h̄ + (1/M) Σ_{i in the buffer} (Δ_i − h_i),

h̄ being the mean of all n silos' caches at the start of the round: the cache stands in for
the silos whose update is stale or missing, so a fast silo's data does not outweigh a slow
one's (the data heterogeneity that plain buffering suffers). The step goes through the server
optimiser (``server.optimizer``; the paper's x ← x + η v is its ``sgd`` at ``lr`` η).

Departures: the paper weighs the buffer uniformly and so does this, times the intake's soft
staleness factor (``lab.soft_staleness``); ``server.staleness.fn`` and
``server.sample_weighting`` are not used. A silo whose data is erased loses its cache and its
buffered calibrations (``drop``): the cache would otherwise keep its last update in every
later step. Central DP is refused: a silo's update reaches every later step through h̄, so a
mechanism calibrated per step would not bound it.

Memory: one model per silo that has sent an update (its cache), and per silo that sent one
this round the cache as it was at the round's start (for h̄ and the split per silo); a
cross-silo federation has few silos.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedasync import FoldResult, Params, ServerOptimizer, Update, flat
from fedasync.aggregators import Aggregator
from fedasync.contributions import MomentShares, applied_change
from fedasync.tensors import add, clone, scale, sub, weighted_sum
from server.strategies.strategy import Strategy


class CA2FLAggregator:
    """CA2FL's fold (module docstring) for ``silos`` silos, ``buffer_size`` updates per step.
    With ``attribute``, a step is split per silo: silo j's share is h_j/n (its cache at the
    round's start) plus its buffered calibrations over M, and these sum to v."""

    def __init__(
        self,
        buffer_size: int,
        silos: int,
        optimizer: ServerOptimizer | None = None,
        attribute: bool = True,
    ) -> None:
        if buffer_size < 1 or silos < 1:
            raise ValueError(f"buffer_size and silos must be >= 1, got {buffer_size}, {silos}")
        self.buffer_size, self.silos = buffer_size, silos
        self.optimizer = optimizer if optimizer is not None else ServerOptimizer("sgd", lr=1.0)
        self.attribute = attribute
        self._shares = MomentShares()
        self.caches: dict[str, Params] = {}  # silo -> its latest update (h_i)
        self._start: dict[str, Params] = {}  # silo -> its cache at the round's start
        self._calibrated: list[Params] = []  # Δ_i − h_i of the round's updates, in order
        self._factors: list[float] = []
        self._silos: list[str] = []

    @property
    def pending(self) -> int:
        """Updates buffered, not yet applied."""
        return len(self._calibrated)

    def fold(self, params: Params, update: Update, tau: int, factor: float = 1.0) -> FoldResult:
        """Buffer ``update``'s calibration and cache it; a step when the buffer is full."""
        if update.kind != "delta":
            raise ValueError(f"CA2FL works on deltas, got kind {update.kind!r}")
        if not flat.same(params, update.tensors) and params.keys() != update.tensors.keys():
            raise KeyError(f"update from {update.silo!r} has tensor names the model has not")
        if not factor >= 0.0:
            raise ValueError(f"factor must be >= 0, got {factor}")
        delta = clone(update.tensors)
        cached = self.caches.get(update.silo)
        self._calibrated.append(delta if cached is None else sub(delta, cached))
        self.caches[update.silo] = delta
        self._factors.append(float(factor))
        self._silos.append(update.silo)
        if len(self._calibrated) < self.buffer_size:
            return FoldResult(params=None, weight=float(factor), flushed=0)
        result = self.flush(params)
        result.weight = float(factor)
        return result

    def flush(self, params: Params) -> FoldResult:
        """The step along v over what is buffered (M = how many), then a new round."""
        k = len(self._calibrated)
        if k == 0:
            return FoldResult(params=None, weight=0.0, flushed=0)
        starts = list(self._start.values())
        terms = starts + self._calibrated
        coeffs = [1.0 / self.silos] * len(starts) + [f / k for f in self._factors]
        v = weighted_sum(terms, coeffs)
        new = self.optimizer.step(params, v)
        contributions: dict[str, Params] = {}
        rest: Params | None = None
        if self.attribute:
            contributions, rest = self._shares.step(self.optimizer, params, self._parts(k), None)
        self._start = dict(self.caches)  # (the caches are replaced, never changed in place)
        flushed, weight = k, float(sum(self._factors))
        self._calibrated, self._factors, self._silos = [], [], []
        return FoldResult(
            params=new,
            weight=weight,
            flushed=flushed,
            applied=applied_change(params, new),
            contributions=contributions,
            unattributed=rest,
        )

    def _parts(self, k: int) -> dict[str, Params]:
        """Silo -> its share of v: h_j(start)/n plus its calibrations over ``k``."""
        parts = {j: scale(h, 1.0 / self.silos) for j, h in self._start.items()}
        for silo, c, f in zip(self._silos, self._calibrated, self._factors):
            term = scale(c, f / k)
            parts[silo] = add(parts[silo], term) if silo in parts else term
        return parts

    def drop(self, silo: str) -> int:
        """Forget ``silo`` (its data was erased): its buffered calibrations, its cache and its
        cache at the round's start; how many buffered updates there were. Its share of the
        optimiser's first moment becomes unattributed (``map_state`` projects it)."""
        keep = [i for i, s in enumerate(self._silos) if s != silo]
        dropped = len(self._silos) - len(keep)
        self._calibrated = [self._calibrated[i] for i in keep]
        self._factors = [self._factors[i] for i in keep]
        self._silos = [self._silos[i] for i in keep]
        self.caches.pop(silo, None)
        self._start.pop(silo, None)
        self._shares.unattribute(silo)
        return dropped

    def map_state(self, fn: Callable[[Params], Params]) -> None:
        """Replace every direction carried into later steps (the caches, the buffered
        calibrations, the optimiser's first moment and its shares) by ``fn`` of it."""
        mapped: dict[int, Params] = {}

        def once(p: Params) -> Params:  # a cache and its start are often the same object
            if id(p) not in mapped:
                mapped[id(p)] = fn(p)
            return mapped[id(p)]

        self.caches = {s: once(p) for s, p in self.caches.items()}
        self._start = {s: once(p) for s, p in self._start.items()}
        self._calibrated = [fn(c) for c in self._calibrated]
        self.optimizer.map_first_moment(fn)
        self._shares.map(fn)

    def state_dict(self) -> dict[str, Any]:
        """The caches, the round's start, the buffer, the optimiser and the shares."""
        return {
            "buffer_size": self.buffer_size,
            "silos": self.silos,
            "caches": {s: clone(p) for s, p in self.caches.items()},
            "start": {s: clone(p) for s, p in self._start.items()},
            "calibrated": [clone(c) for c in self._calibrated],
            "factors": list(self._factors),
            "buffered_silos": list(self._silos),
            "optimizer": self.optimizer.state_dict(),
            "moment_shares": self._shares.state_dict(),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.buffer_size, self.silos = int(d["buffer_size"]), int(d["silos"])
        self.caches = {s: clone(p) for s, p in d["caches"].items()}
        self._start = {s: clone(p) for s, p in d["start"].items()}
        self._calibrated = [clone(c) for c in d["calibrated"]]
        self._factors = [float(f) for f in d["factors"]]
        self._silos = [str(s) for s in d["buffered_silos"]]
        self.optimizer.load_state_dict(d["optimizer"])
        self._shares.load_state_dict(d["moment_shares"])


class CA2FL(Strategy):
    """CA2FL (module docstring): asynchronous like FedBuff, every silo sent the newest model
    as soon as its reply is taken; ``server.buffer_size`` updates per step."""

    name = "ca2fl"

    def aggregator(self) -> Aggregator:
        """CA2FL's cached calibration (``CA2FLAggregator``)."""
        shared = self._shared()
        if shared["mechanism"] is not None:
            raise ValueError("server.mode=ca2fl does not take central DP (server.dp)")
        return CA2FLAggregator(
            self.cfg.server.buffer_size,
            self.cfg.silos.count,
            optimizer=self._optimizer(),
            attribute=shared["attribute"],
        )
