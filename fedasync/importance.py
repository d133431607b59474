"""Importance ratios for learning from stale (off-policy) rollouts.

Papers: PPO (Schulman et al. 2017) clipped surrogate, as used by GRPO (Shao et al. 2024);
IMPALA / V-trace (Espeholt et al. 2018) truncated importance weights; decoupled PPO (Hilton
et al. 2022, "Batch size-invariance for policy optimization"; as used by AReaL, Fu et al.
2025) for rollouts whose behaviour policy is older than the proximal one. The
staleness-aware weight borrows FedAsync's s(τ) (Xie et al. 2019, arXiv:1903.03934).

Departure: :func:`staleness_aware_weight` multiplies the importance ratio by a staleness
weight s(τ), where τ counts policy versions between the behaviour policy that produced a
rollout and the learner's policy; this combination is ours, not from either paper.
:func:`decoupled_ppo_loss` caps the behaviour weight (AReaL's choice) and takes a token
mask. All functions are elementwise over tensors of any shape unless stated; a ``mask`` is a
bool or 0/1 tensor of the same shape whose zeros (padding) take no part.
"""

from __future__ import annotations

import torch

from fedasync.staleness import WeightFn
from fedasync.versions import FutureVersionError


def importance_ratio(
    logp_new: torch.Tensor, logp_old: torch.Tensor, max_log_ratio: float | None = None
) -> torch.Tensor:
    """r = exp(logp_new − logp_old), same (broadcast) shape; log-probs in nats.

    ``max_log_ratio`` (c > 0) clamps the log-ratio to [−c, c] before the exponential, so a
    very stale token cannot overflow to inf (None: no clamp, the exact ratio)."""
    d = logp_new - logp_old
    if max_log_ratio is not None:
        if not max_log_ratio > 0:
            raise ValueError(f"max_log_ratio must be > 0, got {max_log_ratio}")
        d = torch.clamp(d, -max_log_ratio, max_log_ratio)
    return torch.exp(d)


def truncated_importance_weight(ratio: torch.Tensor, max_weight: float) -> torch.Tensor:
    """min(r, max_weight) elementwise (IMPALA/V-trace ρ̄ truncation); ``max_weight`` > 0."""
    if max_weight <= 0:
        raise ValueError(f"max_weight must be > 0, got {max_weight}")
    return torch.clamp(ratio, max=max_weight)


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, eps: float) -> torch.Tensor:
    """PPO/GRPO loss: −mean(min(r·A, clip(r, 1−eps, 1+eps)·A)), a scalar (shape ``()``).

    ``ratio`` and ``advantages`` broadcast together (e.g. both shape ``(b, t)``).
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps, 1.0 + eps) * advantages
    return -torch.minimum(unclipped, clipped).mean()


def staleness_aware_weight(
    ratio: torch.Tensor, tau: int | torch.Tensor, weight_fn: WeightFn
) -> torch.Tensor:
    """r · s(τ); ``tau`` is an int or an integer tensor broadcastable to ``ratio``'s shape."""
    if isinstance(tau, torch.Tensor):
        if tau.is_floating_point() or tau.is_complex():
            raise TypeError(f"tau must be an integer tensor, got dtype {tau.dtype}")
        flat = [weight_fn(int(t)) for t in tau.reshape(-1).tolist()]
        w = torch.tensor(flat, dtype=ratio.dtype, device=ratio.device).reshape(tau.shape)
        return ratio * w
    return ratio * weight_fn(int(tau))


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is true (all when None), shape ``()``.

    Raises ValueError when the mask selects nothing (a mean of no tokens is not 0)."""
    if mask is None:
        return x.mean()
    m = mask.to(x.dtype)
    count = m.sum()
    if float(count) == 0.0:
        raise ValueError("the mask selects no position")
    return (x * m).sum() / count


def decoupled_ppo_loss(
    logp_new: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    eps: float,
    max_behav_weight: float | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decoupled PPO: −mean(w · min(r·A, clip(r, 1−eps, 1+eps)·A)), shape ``()``.

    ``r = exp(logp_new − logp_prox)`` is the trust-region ratio against the *proximal* policy
    (the learner's previous version) and ``w = exp(logp_prox − logp_behav)`` the importance
    weight of the *behaviour* policy that generated the token (any older version), detached
    and capped at ``max_behav_weight`` (None: uncapped). With ``logp_prox == logp_behav`` it is
    :func:`clipped_surrogate`. All inputs broadcast together, e.g. shape ``(b, t)``; log-probs
    in nats; the mean runs over ``mask``.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    ratio = importance_ratio(logp_new, logp_prox.detach())
    weight = importance_ratio(logp_prox, logp_behav).detach()
    if max_behav_weight is not None:
        weight = truncated_importance_weight(weight, max_behav_weight)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps, 1.0 + eps) * advantages
    return -masked_mean(weight * torch.minimum(unclipped, clipped), mask)


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Kish's effective sample size of importance weights, (Σw)² / Σw², normalised by the
    number of weights: 1.0 when all are equal, 1/n when one carries everything.

    ``weights`` >= 0, any shape; ``mask`` selects which count (all when None). Returns 0.0
    when every selected weight is 0; raises ValueError on a negative or non-finite weight or
    an empty selection."""
    w = weights.detach().double().reshape(-1)
    if mask is not None:
        w = w[mask.reshape(-1).bool()]
    if w.numel() == 0:
        raise ValueError("no weight selected")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("importance weights must be finite and >= 0")
    sq = float((w * w).sum())
    if sq == 0.0:
        return 0.0
    return float(w.sum()) ** 2 / sq / w.numel()


def token_staleness(version: int, token_versions: torch.Tensor) -> torch.Tensor:
    """Per-token staleness τ = ``version − token_versions`` (the policy version that produced
    each token: a trajectory resumed under a newer version carries two), integer tensor of
    ``token_versions``' shape; the per-token form of :func:`fedasync.versions.staleness`.

    Raises TypeError on a floating tensor, ValueError on a negative version and
    FutureVersionError on a token from a version newer than ``version``."""
    if token_versions.is_floating_point() or token_versions.is_complex():
        raise TypeError(f"token versions must be integers, got dtype {token_versions.dtype}")
    if token_versions.numel() and int(token_versions.min()) < 0:
        raise ValueError("token versions must be >= 0")
    if token_versions.numel() and int(token_versions.max()) > version:
        raise FutureVersionError(
            f"a token's version {int(token_versions.max())} is newer than version {version}"
        )
    return version - token_versions
