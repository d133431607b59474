"""Exact attribution of an applied server step to the silos behind it.

No paper: this is bookkeeping for FedEraser-style removal (Liu et al. 2021), which subtracts a
silo's summed contributions from the global model (:class:`fedasync.unlearning.ContributionLedger`).
A contribution is the silo's share of the change a fold *applied* to the global params, so
that the shares of one fold sum to its change (to float rounding).

Every server optimiser of :mod:`fedasync.optim` takes a step x ← x + P ⊙ m along a first
moment that is linear in the aggregated delta Δ̄, m ← a·m + b·Δ̄, with a per-coordinate scale P
that is the same for every silo:

- ``sgd``:      a = 0,  b = 1,      P = lr
- ``momentum``: a = μ,  b = 1,      P = lr
- ``adam``:     a = β1, b = 1 − β1, P = lr / (√v + ε)   (v after this step)

Δ̄ = Σ_j g_j + ξ splits into silo j's part g_j = Σ_{i from j} c_i Δ_i and the central-DP
noise ξ. :class:`MomentShares` runs the same recurrence per silo, m_j ← a·m_j + b·g_j, and for
the noise m_∅ ← a·m_∅ + b·ξ, so Σ_j m_j + m_∅ = m; silo j's contribution is P ⊙ m_j and the
unattributed rest P ⊙ m_∅. Velocity from earlier steps thus stays with the silos whose deltas
made it (a silo keeps receiving contributions after its last update, decaying as aᵗ), and
Adam's non-linear denominator is shared per coordinate in proportion to each silo's share of
m. Memory: one model-sized share per silo that ever contributed (none for ``sgd``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fedasync import flat
from fedasync.optim import ServerOptimizer
from fedasync.tensors import add, clone, is_arithmetic
from fedasync.types import Params


def applied_change(old: Params, new: Params) -> Params:
    """``new − old`` for the arithmetic tensors (integer buffers are never aggregated)."""
    if flat.same(old, new):
        return flat.arithmetic_diff(new, old)  # type: ignore[arg-type]
    return {k: new[k].detach() - v.detach() for k, v in old.items() if is_arithmetic(v)}


def _moment(old: Params | None, a: float, b: float, g: Params | None, ref: Params) -> Params | None:
    """a·old + b·g over ``ref``'s arithmetic names, in ``ref``'s dtype and device."""
    if old is None and g is None:
        return None
    out: Params = {}
    for k, x in ref.items():
        if not is_arithmetic(x):
            continue
        acc = torch.zeros_like(x) if old is None else a * old[k].to(x.device)
        if g is not None:
            acc = acc + b * g[k].detach().to(dtype=x.dtype, device=x.device)
        out[k] = acc
    return out


class MomentShares:
    """Per silo, its share m_j of a server optimiser's first moment (see the module docstring).

    ``step`` is called once per optimiser step, after it, with the silos' parts of the delta
    the optimiser was given; it returns each silo's contribution to the step and the
    unattributed rest. For ``sgd`` nothing is kept between steps.
    """

    def __init__(self) -> None:
        self.shares: dict[str, Params] = {}
        """Silo → its share of the first moment (arithmetic tensors only)."""
        self.rest: Params | None = None
        """The share no silo owns: noise, and moment present before attribution began."""

    def step(
        self,
        optimizer: ServerOptimizer,
        params: Params,
        parts: dict[str, Params],
        noise: Params | None,
    ) -> tuple[dict[str, Params], Params | None]:
        """Advance the shares by one step of ``optimizer`` taken from ``params``.

        ``parts`` maps each silo to g_j, ``noise`` is ξ (None without central DP); Σ g_j + ξ
        must be the delta the optimiser stepped along. Returns ({silo: P ⊙ m_j}, P ⊙ m_∅).
        """
        if optimizer.kind == "sgd":
            moments, rest = dict(parts), noise
            self.shares, self.rest = {}, None
        else:
            b1 = optimizer.betas[0]
            a, b = (optimizer.momentum, 1.0) if optimizer.kind == "momentum" else (b1, 1.0 - b1)
            for j in [*self.shares, *(j for j in parts if j not in self.shares)]:
                m = _moment(self.shares.get(j), a, b, parts.get(j), params)
                assert m is not None  # j has an old share or a part
                self.shares[j] = m
            self.rest = _moment(self.rest, a, b, noise, params)
            moments, rest = self.shares, self.rest
        scale = self._scale(optimizer, params)
        contributions = {j: self._times(scale, m, params) for j, m in moments.items()}
        return contributions, (None if rest is None else self._times(scale, rest, params))

    @staticmethod
    def _scale(optimizer: ServerOptimizer, params: Params) -> dict[str, float | torch.Tensor]:
        """P per tensor: lr, or lr / (√v + ε) with Adam's second moment after the step."""
        if optimizer.kind != "adam":
            return {k: optimizer.lr for k, x in params.items() if is_arithmetic(x)}
        v = optimizer._v  # the optimiser's own state, read only
        return {
            k: optimizer.lr / (v[k].to(x.device).sqrt() + optimizer.eps)
            for k, x in params.items()
            if is_arithmetic(x)
        }

    @staticmethod
    def _times(scale: dict[str, float | torch.Tensor], m: Params, params: Params) -> Params:
        out: Params = {}
        for k, s in scale.items():
            x = params[k]
            out[k] = m[k].to(dtype=x.dtype, device=x.device) * s
        return out

    def state_dict(self) -> dict[str, Any]:
        """The shares and the rest, as copies."""
        return {
            "shares": {j: clone(m) for j, m in self.shares.items()},
            "rest": None if self.rest is None else clone(self.rest),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.shares = {str(j): clone(m) for j, m in d["shares"].items()}
        self.rest = None if d["rest"] is None else clone(d["rest"])

    def map(self, fn: Callable[[Params], Params]) -> None:
        """Replace every share (and the rest) by ``fn`` of it; with a linear ``fn`` applied to
        the optimiser's first moment too, Σ m_j + m_∅ = m still holds."""
        self.shares = {j: fn(m) for j, m in self.shares.items()}
        self.rest = None if self.rest is None else fn(self.rest)

    def drop(self, silo: str) -> None:
        """Forget ``silo``'s share (its moment was removed from the optimiser)."""
        self.shares.pop(silo, None)

    def unattribute(self, silo: str) -> None:
        """``silo``'s share stays in the optimiser's moment but is no longer its: it joins
        the rest (Σ m_j + m_∅ = m still holds)."""
        share = self.shares.pop(silo, None)
        if share is not None:
            self.rest = share if self.rest is None else add(self.rest, share)

    def start_from(self, moment: Params) -> None:
        """Forget the shares; the optimiser's current first moment becomes the rest (for an
        optimiser restored without shares, so that Σ m_j + m_∅ = m holds again)."""
        self.shares = {}
        self.rest = clone(moment) if moment else None
