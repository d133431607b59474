"""How close an erased model is to retraining, and whether erased influence comes back.

Papers: the Anamnesis index (relearn time of the erased model over that of a model retrained
without the data; Chundawat et al. 2023, arXiv 2201.05629); the reversion of unlearned models
toward the pre-erasure model (FedOSD, arXiv 2412.20200). The verification protocol these serve
is issue 14 §4: every score is a *distance to retraining*, two-sided (landing below retraining
on forget accuracy or membership inference is over-erasure, and counts against a method), and
scaled by the retraining noise floor (how far two retrainings on different seeds land apart).

Per-example membership inference, the field's protocol: the likelihood-ratio attack LiRA
(Carlini et al. 2022, "Membership Inference Attacks From First Principles", arXiv 2112.03570)
in its unlearning form U-LiRA (Hayes et al. 2024, "Inexact Unlearning Needs More Careful
Evaluations to Avoid a False Sense of Privacy", arXiv 2403.01218): shadow models that trained
on the forget examples ("in") and models retrained without them ("out") give each example two
Gaussians over its logit-scaled confidence; an unlearned model should score like a held-out
retrained one (``ulira_auc`` near 0.5).

Pure functions over named tensors, arrays and plain numbers; no model evaluation happens here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from fedasync.types import Params
from fedasync.unlearning import params_to_vector


def _flat(p: Params) -> torch.Tensor:
    """The floating tensors of ``p`` as one float64 vector (sorted names, as ``params_to_vector``)."""
    return params_to_vector(p).double().cpu()


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


ArrayLike = np.ndarray | torch.Tensor | Sequence[float] | Sequence[Sequence[float]]

_EPS = 1e-6  # confidences are clipped to [_EPS, 1 - _EPS] before the logit


def _array(x: ArrayLike, name: str) -> np.ndarray:
    """``x`` (numpy, torch or nested lists) as a float64 numpy array; NaN is refused."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    a = np.asarray(x, dtype=np.float64)
    if np.isnan(a).any():
        raise ValueError(f"{name} holds NaN")
    return a


def rank_auc(positive: ArrayLike, negative: ArrayLike) -> float:
    """ROC AUC of scores where ``positive`` should score higher than ``negative``: the
    probability that a random positive outscores a random negative, ties counted as one half
    (the Mann–Whitney U over midranks; equal to scikit-learn's ``roc_auc_score``). 1: every
    positive above every negative; 0.5: no separation; 0: every positive below."""
    pos = _array(positive, "positive").ravel()
    neg = _array(negative, "negative").ravel()
    if pos.size == 0 or neg.size == 0:
        raise ValueError(
            f"AUC needs a positive and a negative score, got {pos.size} and {neg.size}"
        )
    _, inverse, counts = np.unique(
        np.concatenate([pos, neg]), return_inverse=True, return_counts=True
    )
    below = np.cumsum(counts) - counts  # how many scores rank below each distinct value
    midrank = below + (counts + 1) / 2.0  # 1-based ranks, ties averaged
    ranks = midrank[inverse.ravel()]
    u = float(ranks[: pos.size].sum()) - pos.size * (pos.size + 1) / 2.0
    return u / (pos.size * neg.size)


def true_label_confidence(logits: ArrayLike, labels: ArrayLike) -> np.ndarray:
    """Softmax probability of the true label, float64 ``(n,)``: LiRA's per-example statistic.

    ``logits`` are ``(n, classes, ...)`` (class on dim 1) and ``labels`` ``(n, ...)`` integer
    class indices; trailing dims (pixels, for segmentation) are averaged over."""
    z = _array(logits, "logits")
    y = np.asarray(labels.detach().cpu() if isinstance(labels, torch.Tensor) else labels)
    if z.ndim < 2 or y.shape != z.shape[:1] + z.shape[2:]:
        raise ValueError(
            f"logits must be (n, classes, ...) and labels (n, ...), got {z.shape} and {y.shape}"
        )
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integer class indices, got {y.dtype}")
    if y.size and (y.min() < 0 or y.max() >= z.shape[1]):
        raise ValueError(f"labels must lie in [0, {z.shape[1]}), got {y.min()}..{y.max()}")
    z = z - z.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    p = np.exp(np.take_along_axis(log_p, y[:, None, ...].astype(np.int64), axis=1))[:, 0]
    return p.reshape(len(p), -1).mean(axis=1)


def logit_scale(conf: ArrayLike) -> np.ndarray:
    """log(p / (1 − p)) of confidences clipped to [1e-6, 1 − 1e-6]: LiRA's scaling, under
    which a model's confidence on one example over training seeds is close to Gaussian."""
    p = np.clip(_array(conf, "confidence"), _EPS, 1.0 - _EPS)
    return np.log(p) - np.log1p(-p)


def _shadow(conf: ArrayLike, name: str) -> np.ndarray:
    """Shadow-model confidences as a ``(K, N)`` float64 array (a ``(N,)`` one is K = 1)."""
    a = _array(conf, name)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError(f"{name} must be (K models, N examples) with K, N >= 1, got {a.shape}")
    return a


def _gaussian(
    conf: np.ndarray, name: str, fixed_variance: bool, min_std: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per-example mean and std ``(N,)`` of logit-scaled ``(K, N)`` confidences."""
    x = logit_scale(conf)
    mean = x.mean(axis=0)
    if fixed_variance:  # one std over all models and examples, as LiRA's reference code
        std = np.full_like(mean, x.std())
    elif x.shape[0] < 2:
        raise ValueError(
            f"{name} has K=1 model: a per-example std needs K >= 2; use fixed_variance=True"
        )
    else:
        std = x.std(axis=0, ddof=1)
    return mean, np.maximum(std, min_std)


def _log_normal(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """log N(x; mean, std²), elementwise with broadcasting."""
    return -0.5 * ((x - mean) / std) ** 2 - np.log(std) - 0.5 * math.log(2 * math.pi)


def lira_scores(
    target_conf: ArrayLike,
    in_conf: ArrayLike,
    out_conf: ArrayLike,
    *,
    fixed_variance: bool = False,
    min_std: float = 1e-2,
) -> np.ndarray:
    """LiRA membership scores of target models on N examples (Carlini et al. 2022).

    ``in_conf`` ``(K_in, N)``: per-example confidences (true-label probability, see
    ``true_label_confidence``) of shadow models that trained on the examples; ``out_conf``
    ``(K_out, N)``: of models that did not (retrained without them). Each side is scaled by
    ``logit_scale`` and fitted with a Gaussian per example (mean, sample std floored at
    ``min_std``; with ``fixed_variance`` one std over all of that side's values instead, LiRA's
    fixed-variance variant, which works down to K = 1). ``target_conf`` is ``(N,)`` for one
    target model or ``(T, N)`` for T of them; the result has its shape:
    log N(x; μ_in, σ_in) − log N(x; μ_out, σ_out) per example, above 0 where the target looks
    like it trained on the example.
    """
    if not min_std > 0:
        raise ValueError(f"min_std must be > 0, got {min_std}")
    ins, outs = _shadow(in_conf, "in_conf"), _shadow(out_conf, "out_conf")
    target = _array(target_conf, "target_conf")
    n = ins.shape[1]
    if outs.shape[1] != n:
        raise ValueError(f"in_conf has {n} examples, out_conf {outs.shape[1]}")
    if target.ndim not in (1, 2) or target.shape[-1] != n:
        raise ValueError(f"target_conf must be (N,) or (T, N) with N={n}, got {target.shape}")
    for a, name in ((ins, "in_conf"), (outs, "out_conf"), (target, "target_conf")):
        if a.min() < 0.0 or a.max() > 1.0:
            raise ValueError(f"{name} must be confidences in [0, 1]")
    mu_in, sd_in = _gaussian(ins, "in_conf", fixed_variance, min_std)
    mu_out, sd_out = _gaussian(outs, "out_conf", fixed_variance, min_std)
    x = logit_scale(target)
    return _log_normal(x, mu_in, sd_in) - _log_normal(x, mu_out, sd_out)


def ulira_auc(
    unlearned_conf: ArrayLike,
    retrained_conf: ArrayLike,
    in_conf: ArrayLike,
    out_conf: ArrayLike,
    *,
    fixed_variance: bool = False,
    min_std: float = 1e-2,
) -> float:
    """U-LiRA (Hayes et al. 2024): how well LiRA tells unlearned models from retrained ones.

    ``unlearned_conf`` ``(U, N)`` or ``(N,)``: confidences on the N forget examples of models
    that trained on them and then unlearned them; ``retrained_conf`` ``(R, N)`` or ``(N,)``:
    of models retrained without them, held out from ``out_conf`` (a shadow model scored
    against its own Gaussian would look more "out" than a fresh retraining). ``in_conf`` and
    ``out_conf`` are the shadow models of ``lira_scores``, which takes the same keywords.

    Returns the AUC of the unlearned models' scores (positives) against the retrained ones'
    (negatives), pooled over every (model, example) pair. 0.5: unlearning is
    indistinguishable from retraining, the goal. Above 0.5: the forget examples still look
    like members (under-erasure). Below 0.5: they look less like members than after retraining
    (over-erasure, a signal too, the Streisand effect). The AUC is returned as is; a caller
    that scores two-sidedly takes |auc − 0.5| or ``distance_to_retraining``.
    """
    unlearned = lira_scores(
        unlearned_conf, in_conf, out_conf, fixed_variance=fixed_variance, min_std=min_std
    )
    retrained = lira_scores(
        retrained_conf, in_conf, out_conf, fixed_variance=fixed_variance, min_std=min_std
    )
    return rank_auc(unlearned, retrained)
