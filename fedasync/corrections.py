"""Corrections applied to a stale update: delay compensation and compressed error feedback.

Papers:

- DC-ASGD (Zheng et al. 2017, "Asynchronous SGD with Delay Compensation"): a gradient g
  computed at w_base is corrected to the current w_now by a first-order Taylor term whose
  Hessian is approximated by λ·g⊙g:  g̃ = g + λ·g⊙g⊙(w_now − w_base).
- Error feedback (Seide et al. 2014, 1-bit SGD; Karimireddy et al. 2019, EF-SGD): compress
  C(x + e), keep the residual e ← x + e − C(x + e) and add it to the next message.
- Delay error feedback (for a constant one-step delay, as in PipeDream-2BW; the rule of
  arXiv 2606.30634 is not printed, so this is ours): step t applies g_t = ∇f(W(t−1)) where
  ∇f(W(t)) was due. One step later the due gradient is known: it is g_{t+1}. So the error of
  step t is e_t = g_{t+1} − g_t, and it is fed back at step t+1, which applies
  g_{t+1} + β·(g_{t+1} − g_t). That is a linear extrapolation of the gradient one step ahead;
  with minibatch gradients the difference carries the noise of two batches, so β trades
  bias for variance (β = 0 is no correction).

Departures: :func:`delay_compensate_delta` applies DC-ASGD to a federated *delta* by
treating the whole local run as one SGD step, Δ = −lr·g (so g = −Δ/lr); that is only exact
for a single local step and is a heuristic for several. The compressor here is top-k
(Stich et al. 2018) with deterministic tie breaking; the paper's 1-bit quantiser is not
included. Error feedback keeps one residual per key (a silo, a pipeline stage, ...).
Only floating tensors are transformed; integer buffers pass through unchanged.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from fedasync import flat
from fedasync.flat import FlatParams
from fedasync.tensors import add, clone, is_arithmetic, zeros_like
from fedasync.types import Params


def _check_names(*ps: Params) -> None:
    for p in ps[1:]:
        if not flat.same(p, ps[0]) and p.keys() != ps[0].keys():
            raise KeyError("tensor names differ between arguments")


def delay_compensate(grad: Params, w_now: Params, w_base: Params, lam: float) -> Params:
    """DC-ASGD: g + λ·g⊙g⊙(w_now − w_base), per tensor (all same shapes).

    ``grad`` is the gradient computed at ``w_base``; ``lam`` (λ ≥ 0) is the variance-control
    coefficient. Integer tensors are copied from ``grad``.
    """
    _check_names(grad, w_now, w_base)
    out: Params = {}
    for k, g in grad.items():
        if not is_arithmetic(g):
            out[k] = g.detach().clone()
            continue
        out[k] = g + lam * g * g * (w_now[k] - w_base[k])
    return out


def delay_compensate_delta(
    delta: Params, w_now: Params, w_base: Params, lam: float, lr: float
) -> Params:
    """DC-ASGD on a delta: Δ − (λ/lr)·Δ⊙Δ⊙(w_now − w_base).

    Treats the local delta as one SGD step Δ = −lr·g, so g = −Δ/lr, and returns
    −lr·(g + λ·g⊙g⊙(w_now − w_base)). ``lr`` (> 0) is the client learning rate (or the
    effective lr of the whole local run).
    """
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if flat.same(delta, w_now, w_base):  # one chunked pass over the flat buffers
        return flat.delay_compensate_flat(delta, w_now, w_base, lam / lr)  # type: ignore[arg-type]
    _check_names(delta, w_now, w_base)
    out: Params = {}
    for k, d in delta.items():
        if not is_arithmetic(d):
            out[k] = d.detach().clone()
            continue
        out[k] = d - (lam / lr) * d * d * (w_now[k] - w_base[k])
    return out


def identity(t: torch.Tensor) -> torch.Tensor:
    """No compression: a copy of ``t``."""
    return t.detach().clone()


def topk_count(numel: int, ratio: float) -> int:
    """Number of entries top-k keeps: ceil(ratio·numel), at least 1 for a non-empty tensor."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if numel == 0:
        return 0
    # round() first so that e.g. 0.3 * 10 = 3.0000000000000004 keeps 3, not 4.
    return min(numel, max(1, math.ceil(round(ratio * numel, 9))))


def topk(t: torch.Tensor, ratio: float) -> torch.Tensor:
    """Keep the ceil(ratio·numel) largest-|x| entries of ``t``, zero the rest (same shape).

    Ties are broken deterministically: among equal magnitudes the lower flat index wins.
    """
    k = topk_count(t.numel(), ratio)
    if k >= t.numel():
        return t.detach().clone()
    flat = t.detach().reshape(-1)
    mag = flat.abs()
    # O(n) selection (no sort): the k-th largest magnitude is the threshold; everything above
    # it is kept, and the ties at it are taken in flat-index order until k are kept.
    thr = torch.kthvalue(mag, mag.numel() - k + 1).values
    keep = mag > thr
    need = k - int(keep.sum())
    if need > 0:
        keep[torch.nonzero(mag == thr).reshape(-1)[:need]] = True
    return torch.where(keep, flat, torch.zeros((), dtype=flat.dtype)).reshape(t.shape)


class ErrorFeedback:
    """Compression with error feedback, one residual per key.

    ``apply(key, x)`` returns C(x + e_key) and sets e_key ← x + e_key − C(x + e_key).
    ``ratio = 1.0`` means no compression (the residual stays exactly zero).

    The compressor is top-k over the whole update: the ceil(ratio·n) largest magnitudes among
    all n floating entries of every tensor together (Stich et al. 2018 compress the whole
    vector; a per-tensor top-k would keep the same fraction of a layer of noise as of the layer
    that moved). It runs on flat buffers (:func:`fedasync.flat.compress_topk`): exact up to
    :data:`fedasync.flat.EXACT_TOPK_MAX` entries, above that with a threshold estimated from a
    fixed sample (k within ~1%; what is not sent stays in the residual, so nothing is lost).
    ``compress`` (any ``compress(t, ratio)`` returning a tensor of ``t``'s shape, e.g.
    :func:`topk`) replaces it by a per-tensor compressor.

    **Bounded memory** (``budget_bytes``): one residual per key is a model per silo, which for
    thousands of silos of a large network does not fit. When the residuals pass the budget,
    the least recently used ones are merged into one shared *pool* (their sum) and the pool is
    added to the next ``apply`` of any key: the mass error feedback holds back is conserved,
    only its sender changes, and memory stays within the budget plus one model. What each
    residual may carry from other keys is tracked, so ``drop(key)`` (an erasure) also drops
    every residual, and the pool, that may hold the key's mass.
    """

    def __init__(
        self,
        ratio: float,
        compress: Callable[[torch.Tensor, float], torch.Tensor] | None = None,
        budget_bytes: int | None = None,
    ) -> None:
        topk_count(1, ratio)  # validates ratio
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.ratio = ratio
        self.compress = compress
        """``compress(t, ratio)``: a per-tensor compressor replacing the global top-k (None);
        not in the state dict."""
        self.budget_bytes = budget_bytes
        self._residuals: OrderedDict[str, Params] = OrderedDict()
        """Least recently used first."""
        self._held = 0
        """Bytes in ``_residuals``."""
        self._pool: Params | None = None
        self._origins: dict[str, set[str]] = {}
        """Key -> the other keys whose mass its residual may hold (absent: none)."""
        self._pool_origins: set[str] = set()
        self.merged = 0
        """Residuals merged into the pool so far (the budget's doing)."""

    def apply(
        self,
        key: str,
        tensors: Params,
        *,
        owned: bool = False,
        compensate: tuple[Params, Params, float] | None = None,
    ) -> Params:
        """Compressed ``tensors + residual[key]`` (+ the pool); updates the residual.
        ``tensors`` is not mutated unless ``owned`` (the caller's to overwrite).

        ``compensate`` = (w_now, w_base, λ/lr): delay-compensate ``tensors`` first
        (:func:`delay_compensate_delta`); on flat buffers both run in one fused pass."""
        if compensate is not None and not (
            self.compress is None and self.ratio < 1.0 and flat.same(tensors, *compensate[:2])
        ):
            w_now, w_base, coef = compensate
            tensors, owned, compensate = _dc(tensors, w_now, w_base, coef), True, None
        residual = self._pop(key)
        if self._pool is not None:  # the merged residuals ride with this update
            residual = self._pool if residual is None else add(residual, self._pool)
            self._origins.setdefault(key, set()).update(self._pool_origins)
            self._pool, self._pool_origins = None, set()
        if self.ratio >= 1.0:
            sent = tensors if owned else clone(tensors)
            if residual is not None:
                sent = add(sent, residual)
            self._put(key, zeros_like(tensors))
            self._enforce_budget(key)
            return sent
        if self.compress is not None:
            sent, kept = self._per_tensor(tensors, residual)
        else:
            x = tensors if isinstance(tensors, FlatParams) else flat.flatten(tensors)
            owned = owned or x is not tensors
            # the residual is ours (popped above, or a sum made here): overwritten in place
            r = None if residual is None else flat.as_flat(residual, like=x)
            k = topk_count(x.layout.numel, self.ratio)
            sent, kept = flat.compress_topk(x, r, k, owned=owned, compensate=compensate)  # type: ignore[arg-type]
        self._put(key, kept)
        self._enforce_budget(key)
        return sent

    def _per_tensor(self, tensors: Params, residual: Params | None) -> tuple[Params, Params]:
        """The reference path, tensor by tensor with ``self.compress``."""
        assert self.compress is not None
        if residual is None:
            residual = zeros_like(tensors)
        _check_names(tensors, residual)
        sent: Params = {}
        kept: Params = {}
        for k, x in tensors.items():
            if not is_arithmetic(x):
                sent[k] = x.detach().clone()
                kept[k] = x.detach().clone()
                continue
            corrected = x.detach() + residual[k]
            compressed = self.compress(corrected, self.ratio)
            sent[k] = compressed
            kept[k] = corrected - compressed
        return sent, kept

    def _enforce_budget(self, current: str) -> None:
        if self.budget_bytes is None:
            return
        while len(self._residuals) > 1 and self.nbytes() > self.budget_bytes:
            key, r = next(iter(self._residuals.items()))
            if key == current:
                break
            self._pop(key)
            self._pool = r if self._pool is None else add(self._pool, r)
            self._pool_origins |= {key} | self._origins.pop(key, set())
            self.merged += 1

    def nbytes(self) -> int:
        """Bytes the residuals and the pool hold (kept as a running total: O(1))."""
        return self._held + (_nbytes(self._pool) if self._pool is not None else 0)

    def _put(self, key: str, r: Params) -> None:
        self._pop(key)
        self._residuals[key] = r
        self._held += _nbytes(r)

    def _pop(self, key: str) -> Params | None:
        r = self._residuals.pop(key, None)
        if r is not None:
            self._held -= _nbytes(r)
        return r

    def drop(self, key: str) -> None:
        """Forget ``key``'s residual (its sender's data was erased), and every residual (and
        the pool) that may hold mass of ``key`` merged into it under the budget."""
        self._pop(key)
        self._origins.pop(key, None)
        for other in [k for k, o in self._origins.items() if key in o]:
            self._pop(other)
            del self._origins[other]
        if key in self._pool_origins:
            self._pool, self._pool_origins = None, set()

    def map_residuals(self, fn: Callable[[Params], Params]) -> None:
        """Replace every residual (and the pool) by ``fn`` of it (e.g. a projection out of an
        erased subspace); integer tensors pass through unchanged."""

        def mapped(r: Params) -> Params:
            out = fn(r)
            return {k: (out[k] if is_arithmetic(v) else v) for k, v in r.items()}

        for key, r in self._residuals.items():
            self._residuals[key] = mapped(r)
        if self._pool is not None:
            self._pool = mapped(self._pool)
        self._held = sum(_nbytes(r) for r in self._residuals.values())

    def residual(self, key: str) -> Params | None:
        """The residual kept for ``key`` (a copy), or ``None`` before the first ``apply``."""
        r = self._residuals.get(key)
        return None if r is None else {k: v.clone() for k, v in r.items()}

    def reset(self, key: str) -> None:
        """Forget the residual for ``key`` (no-op when absent)."""
        self._pop(key)
        self._origins.pop(key, None)

    def keys(self) -> list[str]:
        """Keys that hold a residual, sorted."""
        return sorted(self._residuals)

    def state_dict(self) -> dict[str, Any]:
        """The ratio, a copy of every key's residual (least recently used first), the pool."""
        return {
            "ratio": self.ratio,
            "residuals": {
                key: {k: v.clone() for k, v in r.items()} for key, r in self._residuals.items()
            },
            "pool": None if self._pool is None else {k: v.clone() for k, v in self._pool.items()},
            "origins": {k: sorted(o) for k, o in self._origins.items()},
            "pool_origins": sorted(self._pool_origins),
            "merged": self.merged,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the ratio checked as the constructor does)."""
        topk_count(1, float(d["ratio"]))
        self.ratio = float(d["ratio"])
        self._residuals = OrderedDict(
            (str(key), {k: v.detach().clone() for k, v in r.items()})
            for key, r in d["residuals"].items()
        )
        self._held = sum(_nbytes(r) for r in self._residuals.values())
        pool = d.get("pool")
        self._pool = None if pool is None else {k: v.detach().clone() for k, v in pool.items()}
        self._origins = {str(k): set(o) for k, o in d.get("origins", {}).items()}
        self._pool_origins = set(d.get("pool_origins", []))
        self.merged = int(d.get("merged", 0))


def _dc(delta: Params, w_now: Params, w_base: Params, coef: float) -> Params:
    """:func:`delay_compensate_delta` with λ/lr given as one coefficient."""
    return delay_compensate_delta(delta, w_now, w_base, coef, 1.0)


def _nbytes(p: Params) -> int:
    if isinstance(p, FlatParams):
        return p.nbytes
    return sum(v.nbytes for v in p.values())


class DelayErrorFeedback:
    """Feed back the error a one-step delay made: ``apply(key, g)`` returns g + β·(g − g_prev)
    for the key's previous input g_prev (g itself at a key's first call) and keeps g.

    Optimiser-agnostic: it corrects the gradient an optimiser is about to apply. One state per
    key (a pipeline stage, a worker). Integer tensors pass through unchanged.
    """

    def __init__(self, beta: float = 1.0) -> None:
        if not (math.isfinite(beta) and beta >= 0.0):
            raise ValueError(f"beta must be finite and >= 0, got {beta}")
        self.beta = beta
        self._previous: dict[str, Params] = {}

    def apply(self, key: str, grad: Params) -> Params:
        """The corrected gradient; ``grad`` is not mutated."""
        prev = self._previous.get(key)
        if prev is not None:
            _check_names(grad, prev)
        out: Params = {}
        for k, g in grad.items():
            g = g.detach()
            if prev is None or not is_arithmetic(g):
                out[k] = g.clone()
            else:
                out[k] = g + self.beta * (g - prev[k])
        self._previous[key] = {k: g.detach().clone() for k, g in grad.items()}
        return out

    def residual(self, key: str, grad: Params) -> Params | None:
        """The error the key's previous step made, given the gradient now due: g − g_prev
        (``None`` before the key's first call). Does not change the state."""
        prev = self._previous.get(key)
        if prev is None:
            return None
        _check_names(grad, prev)
        return {k: g.detach() - prev[k] for k, g in grad.items() if is_arithmetic(g)}

    def reset(self, key: str) -> None:
        """Forget the key's previous gradient (no-op when absent)."""
        self._previous.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        """β and a copy of every key's previous gradient."""
        return {
            "beta": self.beta,
            "previous": {
                key: {k: v.clone() for k, v in p.items()} for key, p in self._previous.items()
            },
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (β checked as the constructor does)."""
        beta = float(d["beta"])
        if not (math.isfinite(beta) and beta >= 0.0):
            raise ValueError(f"beta must be finite and >= 0, got {beta}")
        self.beta = beta
        self._previous = {
            str(key): {k: v.detach().clone() for k, v in p.items()}
            for key, p in d["previous"].items()
        }
