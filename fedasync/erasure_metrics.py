"""How close an erased model is to retraining, and whether erased influence comes back.

Papers: the Anamnesis index (relearn time of the erased model over that of a model retrained
without the data; Chundawat et al. 2023, arXiv 2201.05629); the reversion of unlearned models
toward the pre-erasure model (FedOSD, arXiv 2412.20200). The verification protocol these serve
is issue 14 §4: every score is a *distance to retraining*, two-sided (landing below retraining
on forget accuracy or membership inference is over-erasure, and counts against a method), and
scaled by the retraining noise floor (how far two retrainings on different seeds land apart).

Pure functions over named tensors and plain numbers; no model evaluation happens here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fedasync.types import Params
from fedasync.unlearning import flatten


def _flat(p: Params) -> torch.Tensor:
    """The floating tensors of ``p`` as one float64 vector (sorted names, as ``flatten``)."""
    return flatten(p).double().cpu()


def reversion_ratio(w_t: Params, w_boundary: Params, w_pre: Params) -> float:
    """ρ(t) = ⟨w_t − w_B, w_pre − w_B⟩ / ‖w_pre − w_B‖²: how far the model at time t has gone
    back from the erasure boundary w_B toward the pre-erasure model w_pre (0: not at all; 1:
    all the way; negative: further away). NaN when the erasure did not move the model."""
    back = _flat(w_pre) - _flat(w_boundary)
    denom = float(back @ back)
    if denom == 0.0:
        return math.nan
    return float((_flat(w_t) - _flat(w_boundary)) @ back) / denom


def relative_l2(a: Params, reference: Params) -> float:
    """‖a − reference‖ / ‖reference‖ over the floating tensors: a distance in weights (to the
    retrained model, say) that does not depend on the model's scale."""
    ref = _flat(reference)
    norm = float(torch.linalg.vector_norm(ref))
    diff = float(torch.linalg.vector_norm(_flat(a) - ref))
    return math.inf if norm == 0.0 and diff > 0 else (0.0 if norm == 0.0 else diff / norm)


def output_divergence(logits_p: torch.Tensor, logits_q: torch.Tensor) -> dict[str, float]:
    """Mean KL(p‖q) and Jensen–Shannon divergence (nats) between two models' predictive
    distributions on the same inputs; ``logits_*`` are ``(n, classes, ...)`` (class on dim 1,
    any trailing dims, e.g. pixels, are averaged over like the samples)."""
    if logits_p.shape != logits_q.shape:
        raise ValueError(
            f"logits shapes differ: {tuple(logits_p.shape)} vs {tuple(logits_q.shape)}"
        )
    lp = torch.log_softmax(logits_p.double(), dim=1)
    lq = torch.log_softmax(logits_q.double(), dim=1)
    p, q = lp.exp(), lq.exp()
    kl = (p * (lp - lq)).sum(dim=1)
    m = 0.5 * (p + q)
    lm = torch.log(m.clamp_min(1e-300))
    js = 0.5 * (p * (lp - lm)).sum(dim=1) + 0.5 * (q * (lq - lm)).sum(dim=1)
    return {"kl": float(kl.mean()), "js": float(js.mean())}


def resurfacing_gap(erased: Sequence[float], retrained: Sequence[float]) -> float:
    """Mean of max(0, erased_t − retrained_t) over the times after the boundary: how much a
    forgetting metric (backdoor success, membership AUC) of the erased run rises above that
    of retraining, never rewarding falling below it. Both series at the same times."""
    if len(erased) != len(retrained):
        raise ValueError(f"{len(erased)} erased values for {len(retrained)} retrained ones")
    if not erased:
        return math.nan
    return sum(max(0.0, e - r) for e, r in zip(erased, retrained)) / len(erased)


def anamnesis_index(relearn_erased: float, relearn_retrained: float) -> float:
    """Relearn time of the erased model over that of the retrained one (steps, or seconds, to
    reach the same accuracy on the forget data again). Near 1: as forgotten as retraining;
    below 1: the erased model still remembers and relearns faster."""
    if relearn_retrained <= 0:
        raise ValueError(f"the retrained model's relearn time must be > 0, got {relearn_retrained}")
    return relearn_erased / relearn_retrained


def noise_floor(values: Sequence[float]) -> float:
    """The retraining noise floor of a metric: the mean absolute difference between its values
    over pairs of retrainings on different seeds (0 with fewer than two)."""
    n = len(values)
    if n < 2:
        return 0.0
    pairs = [abs(values[i] - values[j]) for i in range(n) for j in range(i + 1, n)]
    return sum(pairs) / len(pairs)


def distance_to_retraining(value: float, retrained: Sequence[float]) -> float:
    """|value − mean(retrained)| over the retraining noise floor (two-sided: over-erasure
    counts as much as under-erasure); ≤ 1 is within the noise of retraining itself. With a
    zero floor, the plain distance."""
    if not retrained:
        raise ValueError("no retrained values")
    mean = sum(retrained) / len(retrained)
    floor = noise_floor(retrained)
    gap = abs(value - mean)
    return gap / floor if floor > 0 else gap
