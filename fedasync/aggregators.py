"""Aggregators: fold (possibly stale) updates into the global parameters.

Papers:

- :func:`fedavg`: FedAvg (McMahan et al. 2017), the synchronous twin used for parity tests.
- :class:`FedAsyncAggregator`: FedAsync (Xie et al. 2019, arXiv:1903.03934), Algorithm 1:
  x ← (1 − α_t) x + α_t x_silo with α_t = α · s(τ).
- :class:`FedBuffAggregator`: FedBuff (Nguyen et al. 2022): buffer K deltas, then take one
  server-optimizer step (FedOpt, Reddi et al. 2021) along their (weighted) mean.

Departures: FedAsync is defined on models; here a ``"delta"`` update is also accepted and
applied as x ← x + s·Δ. For a stale update (base model x_base ≠ current x) the two differ:
model form = x + s·(x_base + Δ − x) = delta form + s·(x_base − x). The delta form does not pull
x back toward the old base. FedBuff's staleness weight s(τ) (their Eq. for
"staleness scaling") is applied per buffered delta, multiplied by the bound's ``factor``;
optional sample weighting is our addition. Integer buffers (e.g. BatchNorm
``num_batches_tracked``) are never aggregated: they keep the current params' value
(see :mod:`fedasync.tensors`).

What was applied: every :class:`FoldResult` that changed the params carries the change
(``applied`` = new − old) and its exact split into per-silo ``contributions`` plus an
``unattributed`` rest (central-DP noise), Σ contributions + unattributed = applied:

- FedAsync: the whole change is the silo's (s·Δ, or s·(x_silo − x) for a model); with DP the
  silo's part is s·clip(Δ) and the rest s·noise.
- FedBuff: the server optimiser's step split per silo through per-silo shares of its first
  moment (:mod:`fedasync.contributions`; exact for sgd, momentum and adam).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from fedasync import flat
from fedasync.contributions import MomentShares, applied_change
from fedasync.optim import ServerOptimizer
from fedasync.privacy import GaussianMechanism, largest_share
from fedasync.staleness import WeightFn
from fedasync.tensors import axpy, clone, is_arithmetic, sub, weighted_sum
from fedasync.types import Params, Update


@dataclass
class FoldResult:
    """Outcome of folding one update."""

    params: Params | None
    """New global params, or ``None`` when the update was only buffered."""
    weight: float
    """Effective weight given to this update (dimensionless)."""
    flushed: int
    """Number of updates applied by this call (0 if only buffered)."""
    released: list[str] = field(default_factory=list)
    """With central DP: the silos whose data this call's new params release (each one
    Gaussian mechanism at the aggregator's noise multiplier); empty otherwise."""
    noise_std: float = 0.0
    """With central DP: the noise std per coordinate, in params space for FedAsync (after
    mixing), on the mean delta before the server optimiser's step for FedBuff."""
    applied: Params | None = None
    """The change this call made to the global params, ``params − old`` per arithmetic tensor
    (integer buffers are never aggregated); ``None`` when nothing was applied."""
    contributions: dict[str, Params] = field(default_factory=dict)
    """Silo → its share of ``applied`` (see the module docstring); with ``unattributed`` they
    sum to ``applied``. Empty when nothing was applied or attribution is off."""
    unattributed: Params | None = None
    """The part of ``applied`` that is no silo's (central-DP noise, and server momentum from
    before attribution began), or ``None`` when there is none."""
    sunk: bool = False
    """The fold added into the sinks it was given (:meth:`FedAsyncAggregator.fold_sunk`), in its
    own pass: the update into each span-sketch row, its change into the silo's running sum.
    ``applied`` and ``contributions`` are then empty: what reads them has it already."""


@runtime_checkable
class FoldSink(Protocol):
    """What a fold adds into besides the model, in its own pass (a run that can erase: the
    update into the span sketch, the change into the silo's ledger sum)."""

    def sinks(self, x: flat.FlatParams, norm: float | None, change: bool) -> list[flat.Sink] | None:
        """The sinks for a fold of ``x`` (the update as folded; ``norm``: its L2 norm when
        known), their bookkeeping done, so that the fold must add into them; with ``change``,
        the silo's sum of the changes too. None, and nothing done: they cannot take ``x`` in
        one pass (the unfused path runs: `unfused`, and the contributions)."""
        ...

    def unfused(self, x: Params, norm: float | None) -> None:
        """Take ``x`` without a fused pass (its change goes by the result's contributions)."""
        ...


@runtime_checkable
class Aggregator(Protocol):
    """What a server loop needs from an aggregator; both aggregators here satisfy it."""

    @property
    def pending(self) -> int:
        """Number of updates received but not yet applied (0 for FedAsync)."""
        ...

    def fold(self, params: Params, update: Update, tau: int, factor: float = 1.0) -> FoldResult:
        """Take ``update`` of staleness ``tau`` (weight multiplied by ``factor``) into ``params``."""
        ...

    def flush(self, params: Params) -> FoldResult:
        """Apply whatever is pending to ``params`` (``params=None`` in the result when nothing)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (not the weight function)."""
        ...

    def drop(self, silo: str) -> int:
        """Forget ``silo``'s updates that are not applied yet; how many there were."""
        ...

    def map_state(self, fn: Callable[[Params], Params]) -> None:
        """Replace every direction the aggregator carries into later folds (buffered deltas,
        the server optimiser's first moment) by ``fn`` of it."""
        ...

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...


def fedavg(updates: Sequence[Update], weight_by_samples: bool = True) -> Params:
    """Weighted mean of the updates' tensors: Σ n_i t_i / Σ n_i, or the plain mean.

    Works for deltas and models alike (the result has the same kind as the inputs); integer
    tensors come from ``updates[0]``.
    """
    if not updates:
        raise ValueError("fedavg needs at least one update")
    if weight_by_samples:
        total = sum(u.num_samples for u in updates)
        if total <= 0:
            raise ValueError("total num_samples must be > 0 when weighting by samples")
        weights = [u.num_samples / total for u in updates]
    else:
        weights = [1.0 / len(updates)] * len(updates)
    return weighted_sum([u.tensors for u in updates], weights)


def _check_names(params: Params, update: Update) -> None:
    if not flat.same(params, update.tensors) and params.keys() != update.tensors.keys():
        raise KeyError(
            f"update from {update.silo!r} has tensor names that differ from the global params"
        )


def _check_factor(factor: float) -> None:
    if not factor >= 0.0:
        raise ValueError(f"factor must be >= 0, got {factor}")


class FedAsyncAggregator:
    """FedAsync mixing: every update is applied at once with weight s = α · s(τ) · factor.

    - ``kind="model"``: x ← (1 − s)·x + s·x_silo
    - ``kind="delta"``: x ← x + s·Δ

    With ``mechanism`` (central DP, :mod:`fedasync.privacy`) only deltas are accepted, each is
    clipped to C and noised with std σC before mixing: x ← x + s·(clip(Δ) + N(0, σ²C²)).

    Every fold applies: ``contributions`` is {silo: applied}, or with DP {silo: s·clip(Δ)} and
    ``unattributed`` = s·noise. ``attribute=False`` skips that bookkeeping (one model-sized
    subtraction per fold): ``applied`` is then None and ``contributions`` empty.
    """

    def __init__(
        self,
        alpha: float,
        weight_fn: WeightFn,
        mechanism: GaussianMechanism | None = None,
        *,
        attribute: bool = True,
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.weight_fn = weight_fn
        self.mechanism = mechanism
        self.attribute = attribute

    @property
    def pending(self) -> int:
        """Always 0: every update is applied when it is folded."""
        return 0

    def fold_sunk(
        self,
        params: Params,
        update: Update,
        tau: int,
        sink: FoldSink,
        norm: float | None,
        factor: float = 1.0,
    ) -> FoldResult | None:
        """`fold`, adding into ``sink``'s sinks in the same chunked pass (``norm``: the
        update's L2 norm when known): no model-sized copy of the change is made. None, and
        nothing done, where that cannot be (a model update, central DP, tensors that are not
        flat buffers of the params' layout on the CPU, sinks that cannot take them): `fold`
        then does it."""
        _check_names(params, update)
        _check_factor(factor)
        x = update.tensors
        if update.kind != "delta" or self.mechanism is not None or not flat.same(x, params):
            return None
        assert isinstance(x, flat.FlatParams) and isinstance(params, flat.FlatParams)
        if not all(b.device.type == "cpu" for b in (*x.buffers, *params.buffers)):
            return None
        sinks = sink.sinks(x, norm, change=self.attribute)
        if sinks is None:
            return None
        s = self.alpha * self.weight_fn(tau) * factor
        new = flat.axpy_sunk(s, x, params, sinks, loose_from=params, norm=norm)
        assert new is not None  # (CPU buffers)
        return FoldResult(new, s, 1, sunk=True)

    def fold(self, params: Params, update: Update, tau: int, factor: float = 1.0) -> FoldResult:
        """Apply ``update`` of staleness ``tau`` to ``params``; always returns new params."""
        _check_names(params, update)
        _check_factor(factor)
        s = self.alpha * self.weight_fn(tau) * factor
        tensors, released, noise_std = update.tensors, [], 0.0
        clipped: Params | None = None
        if self.mechanism is not None:
            if update.kind != "delta":
                raise ValueError("central DP clips deltas: FedAsync with DP takes kind='delta'")
            clipped = self.mechanism.clip(tensors)[0]
            tensors, std = self.mechanism.noise(clipped, 1.0)
            released, noise_std = [update.silo], s * std
        applied: Params | None = None
        if update.kind == "model":
            new = weighted_sum([params, tensors], [1.0 - s, s])
        elif update.kind == "delta" and flat.same(tensors, params) and self.attribute:
            # one pass, the applied change taken in it too; integer buffers stay the params'
            new, applied = flat.axpy_applied(s, tensors, params, loose_from=params)  # type: ignore[arg-type]
        elif update.kind == "delta" and flat.same(tensors, params):
            # one pass over the flat buffers; integer buffers stay the params' own
            new = flat.axpy(s, tensors, params, loose_from=params)  # type: ignore[arg-type]
        elif update.kind == "delta":
            new = axpy(s, tensors, params)
            # axpy takes integer buffers from its first argument (the delta): restore ours.
            new.update({k: v.detach().clone() for k, v in params.items() if not is_arithmetic(v)})
        else:
            raise ValueError(f"unknown update kind {update.kind!r}")
        if not self.attribute:
            return FoldResult(new, s, 1, released=released, noise_std=noise_std)
        if applied is None:
            applied = applied_change(params, new)
        # the same tensors (a FlatParams stays one: the ledger adds it in one pass per buffer)
        own, rest = applied, None
        if clipped is not None:
            own = {k: s * clipped[k].to(v.dtype) for k, v in applied.items()}
            rest = {k: s * (tensors[k] - clipped[k]).to(v.dtype) for k, v in applied.items()}
        return FoldResult(
            params=new,
            weight=s,
            flushed=1,
            released=released,
            noise_std=noise_std,
            applied=applied,
            contributions={update.silo: own},
            unattributed=rest,
        )

    def flush(self, params: Params) -> FoldResult:
        """Nothing is ever pending: ``FoldResult(None, 0.0, 0)``."""
        return FoldResult(params=None, weight=0.0, flushed=0)

    def drop(self, silo: str) -> int:
        """Nothing is ever pending: 0."""
        return 0

    def map_state(self, fn: Callable[[Params], Params]) -> None:
        """Nothing is carried between folds."""

    def state_dict(self) -> dict[str, Any]:
        """Config only (the weight function itself is not serialised)."""
        return {"alpha": self.alpha}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore ``alpha``."""
        self.alpha = float(d["alpha"])


class FedBuffAggregator:
    """FedBuff: buffer ``buffer_size`` deltas, then one server-optimizer step along their mean.

    On flush with K buffered deltas Δ_i, weights w_i = s(τ_i)·factor_i, sample counts n_i:

    - ``weight_by_samples=False``: Δ̄ = Σ w_i Δ_i / K
    - ``weight_by_samples=True``:  Δ̄ = Σ w_i n_i Δ_i / Σ n_i

    then params ← optimizer.step(params, Δ̄). Only ``kind="delta"`` updates are accepted.
    Buffered deltas are stored as detached clones on their original device.

    With ``mechanism`` (central DP, :mod:`fedasync.privacy`) each delta is clipped to C when
    it is buffered, and Δ̄ gets N(0, (σ·C·max_j S_j)²) at the flush, S_j being silo j's summed
    coefficient in the buffer; ``sample weighting`` then leaks sample counts (the server
    refuses that combination).

    With ``attribute`` (the default) a flush splits its step per silo, g_j = Σ_{i from j} c_i·Δ_i
    (c_i the coefficient above, Δ_i clipped with DP) run through the optimiser's first moment
    per silo (:class:`fedasync.contributions.MomentShares`), so momentum from earlier flushes
    is attributed to the silos that made it; the DP noise is ``unattributed``. Off, no shares
    are kept and ``contributions`` is empty.
    """

    def __init__(
        self,
        buffer_size: int,
        weight_fn: WeightFn,
        weight_by_samples: bool = False,
        optimizer: ServerOptimizer | None = None,
        mechanism: GaussianMechanism | None = None,
        attribute: bool = True,
    ) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        self.buffer_size = buffer_size
        self.weight_fn = weight_fn
        self.weight_by_samples = weight_by_samples
        self.optimizer = optimizer if optimizer is not None else ServerOptimizer("sgd", lr=1.0)
        self.mechanism = mechanism
        self.attribute = attribute
        self._shares = MomentShares()
        self._deltas: list[Params] = []
        self._weights: list[float] = []
        self._num_samples: list[int] = []
        self._silos: list[str] = []

    @property
    def pending(self) -> int:
        """Number of buffered, not yet applied updates."""
        return len(self._deltas)

    @property
    def buffered_silos(self) -> list[str]:
        """Silos of the buffered updates, in arrival order."""
        return list(self._silos)

    def fold(self, params: Params, update: Update, tau: int, factor: float = 1.0) -> FoldResult:
        """Buffer ``update``; flush when the buffer is full (then ``params`` is the new model)."""
        if update.kind != "delta":
            raise ValueError(f"FedBuff works on deltas, got kind {update.kind!r}")
        _check_names(params, update)
        _check_factor(factor)
        if self.weight_by_samples and update.num_samples <= 0:
            raise ValueError(f"num_samples must be > 0, got {update.num_samples}")
        w = self.weight_fn(tau) * factor
        tensors = (
            update.tensors if self.mechanism is None else self.mechanism.clip(update.tensors)[0]
        )
        self._deltas.append(clone(tensors))
        self._weights.append(w)
        self._num_samples.append(int(update.num_samples))
        self._silos.append(update.silo)
        if len(self._deltas) < self.buffer_size:
            return FoldResult(params=None, weight=w, flushed=0)
        result = self.flush(params)
        result.weight = w
        return result

    def flush(self, params: Params) -> FoldResult:
        """Apply whatever is buffered (dividing by the number buffered) and clear the buffer.

        Returns ``FoldResult(None, 0.0, 0)`` when the buffer is empty.
        """
        k = len(self._deltas)
        if k == 0:
            return FoldResult(params=None, weight=0.0, flushed=0)
        if self.weight_by_samples:
            total = sum(self._num_samples)
            coeffs = [w * n / total for w, n in zip(self._weights, self._num_samples)]
        else:
            coeffs = [w / k for w in self._weights]
        mean_delta = weighted_sum(self._deltas, coeffs)
        released: list[str] = []
        std = 0.0
        noise: Params | None = None
        if self.mechanism is not None:
            share, released = largest_share(self._silos, coeffs)
            noised, std = self.mechanism.noise(mean_delta, share)
            noise = sub(noised, mean_delta) if std > 0.0 else None
            mean_delta = noised
        new = self.optimizer.step(params, mean_delta)
        contributions: dict[str, Params] = {}
        rest: Params | None = None
        if self.attribute:
            contributions, rest = self._shares.step(
                self.optimizer, params, self._parts(coeffs), noise
            )
        total_weight = float(sum(self._weights))
        self._deltas, self._weights, self._num_samples, self._silos = [], [], [], []
        return FoldResult(
            params=new,
            weight=total_weight,
            flushed=k,
            released=released,
            noise_std=std,
            applied=applied_change(params, new),
            contributions=contributions,
            unattributed=rest,
        )

    def drop(self, silo: str) -> int:
        """Forget ``silo``'s buffered deltas (e.g. its data was erased); how many there were.
        Its share of the optimiser's first moment is no longer attributed to it: it stays in
        the moment (``map_state`` projects it) and becomes unattributed."""
        keep = [i for i, s in enumerate(self._silos) if s != silo]
        dropped = len(self._silos) - len(keep)
        self._deltas = [self._deltas[i] for i in keep]
        self._weights = [self._weights[i] for i in keep]
        self._num_samples = [self._num_samples[i] for i in keep]
        self._silos = [self._silos[i] for i in keep]
        self._shares.unattribute(silo)
        return dropped

    def map_state(self, fn: Callable[[Params], Params]) -> None:
        """Replace each buffered delta, the server optimiser's first moment and the silos'
        shares of it by ``fn`` of them (a linear ``fn`` keeps the shares summing to it)."""
        self._deltas = [fn(d) for d in self._deltas]
        self.optimizer.map_first_moment(fn)
        self._shares.map(fn)

    def _parts(self, coeffs: Sequence[float]) -> dict[str, Params]:
        """Silo → g_j = Σ_{i from j} c_i·Δ_i over the buffer, silos in arrival order."""
        index: dict[str, list[int]] = {}
        for i, silo in enumerate(self._silos):
            index.setdefault(silo, []).append(i)
        return {
            j: weighted_sum([self._deltas[i] for i in ix], [coeffs[i] for i in ix])
            for j, ix in index.items()
        }

    def state_dict(self) -> dict[str, Any]:
        """Config, buffered deltas with their weights/sample counts/silos, optimizer state and
        the silos' shares of its first moment.

        The weight function is not serialised: pass the same one to the constructor.
        """
        return {
            "buffer_size": self.buffer_size,
            "weight_by_samples": self.weight_by_samples,
            "deltas": [clone(d) for d in self._deltas],
            "weights": list(self._weights),
            "num_samples": list(self._num_samples),
            "silos": list(self._silos),
            "optimizer": self.optimizer.state_dict(),
            "attribute": self.attribute,
            "moment_shares": self._shares.state_dict(),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned. ``attribute`` stays as constructed: state
        saved without shares (attribution off, or an older checkpoint) makes the restored
        optimiser's first moment ``unattributed``."""
        self.buffer_size = int(d["buffer_size"])
        self.weight_by_samples = bool(d["weight_by_samples"])
        self._deltas = [clone(p) for p in d["deltas"]]
        self._weights = [float(w) for w in d["weights"]]
        self._num_samples = [int(n) for n in d["num_samples"]]
        self._silos = [str(s) for s in d["silos"]]
        self.optimizer.load_state_dict(d["optimizer"])
        if not self.attribute:
            self._shares = MomentShares()
        elif d.get("attribute", False):
            self._shares.load_state_dict(d["moment_shares"])
        else:
            self._shares.start_from(d["optimizer"]["m"])
