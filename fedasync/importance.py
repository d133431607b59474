"""Importance ratios for learning from stale (off-policy) rollouts.

Papers: PPO (Schulman et al. 2017) clipped surrogate, as used by GRPO (Shao et al. 2024);
IMPALA / V-trace (Espeholt et al. 2018) truncated importance weights. The staleness-aware
weight borrows FedAsync's s(τ) (Xie et al. 2019, arXiv:1903.03934).

Departure: :func:`staleness_aware_weight` multiplies the importance ratio by a staleness
weight s(τ), where τ counts policy versions between the behaviour policy that produced a
rollout and the learner's policy; this combination is ours, not from either paper.
All functions are elementwise over tensors of any shape unless stated.
"""

from __future__ import annotations

import torch

from fedasync.staleness import WeightFn


def importance_ratio(logp_new: torch.Tensor, logp_old: torch.Tensor) -> torch.Tensor:
    """r = exp(logp_new − logp_old), same (broadcast) shape; log-probs in nats."""
    return torch.exp(logp_new - logp_old)


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
