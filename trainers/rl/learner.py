"""The learner: GRPO on groups of stale rollouts, with the core's corrections.

Papers: GRPO (Shao et al. 2024) group-normalised advantages, no critic, token-level mean
(DAPO, Yu et al. 2025); truncated importance sampling (IMPALA, Espeholt et al. 2018);
decoupled PPO (Hilton et al. 2022, as in AReaL, Fu et al. 2025); FedAsync's staleness weight
s(τ) (Xie et al. 2019). Every piece of stale-update arithmetic comes from ``fedasync``.

Corrections (``learner.correction``), for a token of behaviour policy μ (the version that
generated it), proximal policy π_prox (the learner's weights at the start of the step, i.e.
its previous version) and current weights π_θ:
- ``none``: the stale token is treated as if π_prox had generated it (PPO against π_prox).
- ``tis``: policy gradient weighted by sg(min(π_prox/μ, C)) (token-level truncated IS).
- ``decoupled``: PPO clipped on π_θ/π_prox, weighted by sg(min(π_prox/μ, C)).
- ``drop``: trajectories staler than ``learner.drop_beyond`` are dropped, the rest as ``none``.
- ``weight``: ``tis`` times the core's staleness weight s(τ) per token.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch

from fedasync.importance import (
    decoupled_ppo_loss,
    effective_sample_size,
    importance_ratio,
    masked_mean,
    staleness_aware_weight,
    token_staleness,
    truncated_importance_weight,
)
from fedasync.staleness import make_weight_fn
from trainers.rl.config import LearnerSection
from trainers.rl.policy import Policy, sequence_logprobs
from trainers.rl.rollout import Group, Trajectory


def grpo_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """(r − mean) / (std + eps) within one group (population std); 0 for a single sample."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + eps) for r in rewards]


def pad_rows(rows: list[list[Any]], value: Any, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` right-padded with ``value`` to the longest, as one tensor of ``dtype``."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)


def behaviour_metrics(
    prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, cap: float
) -> dict[str, float]:
    """How far the behaviour policies are from the proximal one, over ``mask``: KL(μ‖π_prox)
    (k3 estimator), the ESS of π_prox/μ and the fraction of ratios above ``cap``."""
    raw_w = importance_ratio(prox, behav).masked_fill(~mask, 1.0)
    return {
        "kl_behav": float(masked_mean((raw_w - 1.0) - torch.log(raw_w), mask)),
        "ess": effective_sample_size(raw_w, mask),
        "trunc_frac": float(masked_mean((raw_w > cap).float(), mask)),
    }


class Learner:
    """Holds the policy and its optimiser; one ``step`` per batch makes one new version."""

    def __init__(
        self, policy: Policy, cfg: LearnerSection, temperature: float, device: torch.device
    ):
        self.policy = policy
        self.cfg = cfg
        self.temperature = temperature
        self.device = device
        self.opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
        self.weight_fn = make_weight_fn(cfg.weight_fn, cfg.weight_a, cfg.weight_b)

    def step(self, groups: list[Group], version: int) -> dict[str, Any]:
        """One learner step on ``groups`` (sorted by group id) at learner ``version``.

        Returns the step's metrics; ``dropped`` counts trajectories left out and why.
        """
        c = self.cfg
        items, metrics = self.select(groups, version)
        if not items:
            metrics["skipped"] = "no trajectory to learn from"
            return metrics

        prompts = [t.prompt for t, _ in items]
        comps = [t.tokens for t, _ in items]
        behav = pad_rows([t.logprobs for t, _ in items], 0.0, torch.float32).to(self.device)
        tau = token_staleness(
            version, pad_rows([t.versions for t, _ in items], version, torch.long)
        )
        adv = torch.tensor([a for _, a in items], dtype=torch.float32, device=self.device)[:, None]

        self.policy.eval()
        with torch.no_grad():
            prox, mask, entropy = sequence_logprobs(
                self.policy, prompts, comps, self.temperature, self.device
            )
        metrics["entropy"] = float(masked_mean(entropy, mask))
        metrics |= behaviour_metrics(prox, behav, mask, c.tis_cap)

        n = len(items)
        parts = [list(range(n))[i :: c.minibatches] for i in range(c.minibatches)]
        clipped = 0.0
        losses, gnorms = [], []
        self.policy.train()
        for idx in parts:
            if not idx:
                continue
            sel = torch.tensor(idx, device=self.device)
            new, m, _ = sequence_logprobs(
                self.policy,
                [prompts[i] for i in idx],
                [comps[i] for i in idx],
                self.temperature,
                self.device,
            )
            width = new.shape[1]
            p, b, a = prox[sel][:, :width], behav[sel][:, :width], adv[sel]
            t_idx = tau[sel.cpu()][:, :width]
            loss = self._loss(new, p, b, a, m, t_idx)
            ratio = importance_ratio(new.detach(), p)
            clipped += float((((ratio - 1.0).abs() > c.clip_eps) & m).sum())
            losses.append(float(loss.detach()))
            gnorms.append(self.apply(loss))
        self.policy.eval()
        metrics["loss"] = sum(losses) / len(losses)
        metrics["grad_norm"] = max(gnorms)
        metrics["clip_frac"] = clipped / max(float(mask.sum()), 1.0)
        return metrics

    def apply(self, loss: torch.Tensor) -> float:
        """One optimiser step on ``loss`` (gradient clipped); returns the gradient norm."""
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.max_grad_norm)
        self.opt.step()
        return float(gn)

    def select(
        self, groups: list[Group], version: int
    ) -> tuple[list[tuple[Trajectory, float]], dict[str, Any]]:
        """The trajectories to learn from with their GRPO advantages (``drop`` leaves out the
        staler ones), and the batch's metrics."""
        dropped: Counter[str] = Counter()
        items: list[tuple[Trajectory, float]] = []
        for g in groups:
            for t, a in zip(
                g.trajectories, grpo_advantages([t.reward for t in g.trajectories]), strict=True
            ):
                if (
                    self.cfg.correction == "drop"
                    and version - min(t.versions) > self.cfg.drop_beyond
                ):
                    dropped["staler than learner.drop_beyond"] += 1
                    continue
                items.append((t, a))
        trajs = [t for g in groups for t in g.trajectories]
        stale_hist = Counter(version - min(t.versions) for t in trajs)
        rewards = [t.reward for t in trajs]
        lengths = [len(t.tokens) for t in trajs]
        metrics: dict[str, Any] = {
            "dropped": dict(dropped),
            "trajectories": len(items),
            "staleness_hist": {str(k): v for k, v in sorted(stale_hist.items())},
            "reward": sum(rewards) / max(len(rewards), 1),
            "accuracy": sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
            "response_length": sum(lengths) / max(len(lengths), 1),
            "tokens": sum(len(t.prompt) + len(t.tokens) for t in trajs),
        }
        return items, metrics

    def _loss(
        self,
        new: torch.Tensor,
        prox: torch.Tensor,
        behav: torch.Tensor,
        adv: torch.Tensor,
        mask: torch.Tensor,
        tau: torch.Tensor,
    ) -> torch.Tensor:
        c = self.cfg
        if c.correction in ("none", "drop"):
            return decoupled_ppo_loss(new, prox, prox, adv, c.clip_eps, None, mask)
        if c.correction == "decoupled":
            return decoupled_ppo_loss(new, prox, behav, adv, c.clip_eps, c.tis_cap, mask)
        w = truncated_importance_weight(importance_ratio(prox, behav), c.tis_cap)
        if c.correction == "weight":
            w = staleness_aware_weight(w, tau.to(w.device), self.weight_fn)
        pg = importance_ratio(new, new.detach())  # 1, with the gradient of log π_θ
        return -masked_mean(w.detach() * pg * adv, mask)

    def state_dict(self) -> dict[str, Any]:
        """The policy's and the optimiser's state."""
        return {"policy": self.policy.state_dict(), "opt": self.opt.state_dict()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.policy.load_state_dict(d["policy"])
        self.opt.load_state_dict(d["opt"])
