"""The erasing silo's bound: L2 distances, the projection onto an L2 ball around a reference
model, and how far a sample-level erasure may go (its share of the silo's samples).

Paper: Halimi et al. 2022, "Federated Unlearning: How to Efficiently Erase a Client in FL?"
(arXiv:2207.05521): the erasing silo runs projected gradient *ascent* on its data, kept in an
L2 ball around a reference model (:func:`project_to_ball`; the silo-side loop is
``clients.unlearn.erase_pga``). Departure: :func:`forget_share_scale` shrinks the ball for an
erasure of part of a silo's samples (our rule, docs/erasure.md).
"""

from __future__ import annotations

import math

from fedasync.tensors import clone, sub
from fedasync.types import Params


def l2_distance(a: Params, b: Params) -> float:
    """``||a − b||`` over all floating tensors together (a and b must share names)."""
    diff = sub(a, b)
    return math.sqrt(
        sum(float(v.double().pow(2).sum()) for v in diff.values() if v.is_floating_point())
    )


def project_to_ball(params: Params, center: Params, radius: float) -> Params:
    """Nearest point of the L2 ball ``{w : ||w − center|| <= radius}`` to ``params``.

    Inside the ball the result equals ``params``; outside it is pulled back along the line to
    ``center`` onto the sphere: ``center + radius · (params − center) / ||params − center||``.
    Only floating tensors move; others are copied from ``params``.
    """
    if radius < 0:
        raise ValueError(f"radius must be >= 0, got {radius}")
    dist = l2_distance(params, center)
    if dist <= radius:
        return clone(params)
    c = radius / dist
    return {
        k: center[k] + (v - center[k]) * c if v.is_floating_point() else v.detach().clone()
        for k, v in params.items()
    }


SHARE_RULES = ("linear", "sqrt", "none")
"""How an erasure's size follows its forget set's share of the silo (:func:`forget_share_scale`)."""


def forget_share_scale(
    n_forget: int, n_held: int, rule: str = "linear", floor: float = 0.01
) -> float:
    """Factor in ``(0, 1]`` by which an erasure's size (PGA's ball radius, relabelling's steps)
    shrinks when it erases ``n_forget`` of the ``n_held`` samples its silo holds.

    ``linear`` (the default): ``max(n_forget / n_held, floor)``. To first order, retraining
    without ``n`` of a silo's ``N`` samples moves the model by ``n/N`` of what retraining
    without the whole silo does, and the configured radius is sized for a whole silo; so the
    ball gets ``n/N`` of it. The floor keeps a single sample erasable at all.
    ``sqrt``: ``max(sqrt(n/N), floor)``, the norm of a sum of ``n`` *uncorrelated* per-sample
    contributions against ``N``. Gradient ascent's direction is the forget set's mean gradient,
    which is correlated with everyone's data, so this over-sizes small erasures: at 1% it
    allows 10% of the radius, 0.2 of brain-tissue's 2.0, about the 0.17-0.24 that five
    unbounded PGA steps on 5 samples travel (seeds 0-2), so hardly a bound.
    ``none``: 1, every erasure the full size (the behaviour before the rule existed: on
    brain-tissue, 5 of 456 samples then cost the global test score 5-23 points at the
    boundary over 3 seeds; ``linear`` 0.3-1.5, docs/erasure.md).
    A whole silo (``n_forget >= n_held``) or an unknown size (``n_held < 1``) is always 1.
    """
    if rule not in SHARE_RULES:
        raise ValueError(f"rule must be one of {SHARE_RULES}, got {rule!r}")
    if not 0.0 < floor <= 1.0:
        raise ValueError(f"floor must be in (0, 1], got {floor}")
    if n_held < 1 or n_forget >= n_held or rule == "none":
        return 1.0
    share = max(n_forget, 0) / n_held
    return max(share if rule == "linear" else math.sqrt(share), floor)
