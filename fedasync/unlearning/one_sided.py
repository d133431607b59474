"""One-sided projections: directions a later change to the model may not move against (the
erasure's jump, the forget set's mean loss gradient), one or several at once.

Papers: PCGrad (Yu et al. 2020, arXiv:2001.06782) and FedOSD (arXiv:2412.20200): of a change
only the component moving against a direction is removed (:class:`OneSided`; the erasure's
jump, :class:`ErasureJump`, and the forget set's mean loss gradient, :class:`ForgetGradient`;
several at once, the projection onto their cone, :func:`block_one_sided`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import torch

from fedasync.types import Params
from fedasync.unlearning.vectors import _float_names, params_to_vector, vector_to_params


@dataclass
class OneSided:
    """A unit direction ``a`` over the floating tensors ``names`` that a later change Δ may not
    move against: of Δ only the component with ⟨Δ, a⟩ < 0 is removed, Δ − min(0, ⟨Δ, a⟩)·a;
    moving along ``a`` or across it is kept (the one-sided projection of PCGrad, Yu et al.
    2020, arXiv 2001.06782, as FedOSD, arXiv 2412.20200, uses it in federated unlearning).
    Several at once: :func:`block_one_sided`."""

    direction: torch.Tensor
    """``a``, shape ``(d,)``, unit L2 norm, float32."""
    names: list[str]
    """Tensor names the entries of ``direction`` run over, in flattening order."""

    def along(self, change: Params) -> float:
        """⟨Δ, a⟩: how far ``change`` moves along the direction (negative: against it)."""
        delta = params_to_vector(change, self.names)
        return float(delta.float() @ self.direction.to(delta.device))

    def block(self, change: Params) -> Params:
        """``change`` without its component against the direction (``change`` itself when it
        has none)."""
        c = self.along(change)
        if c >= 0.0:
            return change
        delta = params_to_vector(change, self.names)
        fixed = delta - (c * self.direction.to(device=delta.device)).to(delta.dtype)
        return vector_to_params(fixed, change, self.names)

    def state_dict(self) -> dict[str, Any]:
        """The direction and its tensor names."""
        return {"direction": self.direction.clone(), "names": list(self.names)}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> Self:
        """The direction ``state_dict`` described."""
        return cls(d["direction"].clone(), [str(n) for n in d["names"]])

    @classmethod
    def unit(cls, vector: torch.Tensor, names: Sequence[str]) -> Self | None:
        """``vector / ‖vector‖`` (float32, CPU) over ``names``; None when it is zero or not
        finite."""
        v = vector.detach().reshape(-1).cpu().float()
        norm = float(torch.linalg.vector_norm(v))
        if norm == 0.0 or not math.isfinite(norm):
            return None
        return cls(v / norm, list(names))


@dataclass
class ErasureJump(OneSided):
    """The direction an erasure moved the model, ĵ = (w_B − w_pre) / ‖w_B − w_pre‖ over the
    floating tensors ``names``: what the model must not move back along.

    Paper: the one-sided projection of PCGrad (Yu et al. 2020, arXiv 2001.06782), as FedOSD
    (arXiv 2412.20200) uses it against unlearned models reverting: of a later change Δ only the
    component moving back along the jump is removed, Δ − min(0, ⟨Δ, ĵ⟩)·ĵ; moving further
    along it or across it is kept. Summed over every later change, the model's displacement
    from the boundary then never has a positive component toward w_pre, so the reversion ratio
    ρ(t) = ⟨w_t − w_B, w_pre − w_B⟩ / ‖w_pre − w_B‖² stays ≤ 0 (issue 14 §4).
    """

    @classmethod
    def between(cls, before: Params, after: Params) -> ErasureJump | None:
        """The jump from ``before`` to ``after`` (None when they are equal)."""
        names = _float_names(after, None)
        return cls.unit(params_to_vector(after, names) - params_to_vector(before, names), names)

    def block_reversal(self, change: Params) -> Params:
        """``change`` without its component moving back along the jump (one-sided)."""
        return self.block(change)


@dataclass
class ForgetGradient(OneSided):
    """The erased data's mean loss gradient ĝ_f = g_f / ‖g_f‖ at the erased model, over the
    tensors ``names`` (the signature's): what the model must not descend along.

    A later change Δ with ⟨Δ, g_f⟩ < 0 lowers the forget loss to first order, i.e. relearns
    the erased data; it loses that component, Δ − min(0, ⟨Δ, ĝ_f⟩)·ĝ_f, and nothing else is
    touched (PCGrad's one-sided projection, arXiv 2001.06782, against the forget objective
    as in FedOSD, arXiv 2412.20200). Unlike the signature's two-sided projection it leaves
    every change that does not lower the forget loss as it is.
    """

    def block_descent(self, change: Params) -> Params:
        """``change`` without its component lowering the forget loss (one-sided)."""
        return self.block(change)


def block_one_sided(change: Params, directions: Sequence[OneSided], sweeps: int = 200) -> Params:
    """The nearest change to ``change`` that moves against none of ``directions`` (⟨Δ', a⟩ ≥ 0
    for each), on its floating tensors; ``change`` itself when it already does.

    One direction: :meth:`OneSided.block`. Several (jumps and forget gradients of one or more
    erasures, each over its own tensor names): removing them one after another can bring back
    an earlier one's violation when they are not orthogonal, so the projection onto the cone
    is solved instead: Δ' = Δ + Aᵀλ with λ ≥ 0 minimising ½λᵀ(AAᵀ)λ + λᵀ(AΔ) (its dual, a
    tiny nonnegative quadratic programme in one variable per direction), by exact coordinate
    descent for at most ``sweeps`` sweeps (to 1e-12).
    """
    if not directions:
        return change
    if len(directions) == 1:
        return directions[0].block(change)
    names = _float_names(change, None)
    delta = params_to_vector(change, names).double()
    zeros = {k: torch.zeros_like(v) for k, v in change.items()}
    rows = [
        params_to_vector(vector_to_params(d.direction, zeros, d.names), names)
        .double()
        .to(delta.device)
        for d in directions
    ]
    a = torch.stack(rows)  # (n, d)
    c = a @ delta
    if bool((c >= 0).all()):
        return change
    g = a @ a.T
    lam = torch.zeros_like(c)
    for _ in range(sweeps):
        moved = 0.0
        for i in range(len(rows)):
            if float(g[i, i]) <= 0.0:
                continue
            new = max(0.0, float(lam[i]) - float(c[i] + g[i] @ lam) / float(g[i, i]))
            moved = max(moved, abs(new - float(lam[i])))
            lam[i] = new
        if moved < 1e-12:
            break
    fixed = delta + a.T @ lam
    return vector_to_params(fixed.to(params_to_vector(change, names).dtype), change, names)
