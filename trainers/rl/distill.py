"""On-policy distillation (OPD) on stale rollouts: finite teacher caches and their losses.

Papers: on-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025, per-token
reverse KL as a reward); AsyncOPD (Kang et al. 2026, arXiv 2606.24143: staleness in
asynchronous OPD, teacher-score caches of finite size, learner-time recompute of the reverse-KL
signal, multi-sample Monte Carlo).

The student samples completions (the rollout workers, as in RL); a teacher scores every
position of them once, into a *finite cache*: its top-k log-probs, their ids, the log of the
mass left outside them (the tail bucket, so the k + 1 buckets are a proper distribution) and
its log-prob of the generated token and of N − 1 Monte Carlo ids per position. The learner
then trains the student on one of four losses (``distill.loss``), per completion token t with
behaviour μ (the stale version that generated it), proximal π_prox and current π_θ:

- ``forward_kl``: Σ_b p_T(b) (log p_T(b) − log π_θ(b)) over the buckets b (top-k ids + tail).
- ``reverse_kl``: Σ_b π_θ(b) (log π_θ(b) − log p_T(b)) over the same buckets.
- ``pg_kl``: a policy gradient with per-token advantage A_t = log p_T(y_t) − log μ(y_t), the
  signal as the behaviour student saw it (stale when μ is), with PPO ratio clipping.
- ``pg_kl_online``: the same with A_t = sg[log p_T(y_t) − log π_θ(y_t)], recomputed under the
  current student at learner time (its gradient is the sampled reverse-KL gradient).

The pg losses average over N tokens per position (the generated one and N − 1 drawn from μ).
Staleness is handled as the RL modes handle it (``learner.correction``, the core's importance
ratios, truncation, staleness weights and bound): the pg losses go through the GRPO learner's
surrogate with A_t in place of the group advantage; the two top-k losses weight each position
by the correction's token weight (1 for none/drop, sg(min(π_prox/μ, C)) for tis/decoupled,
times s(τ) for weight).

Departures: the tail bucket of a top-k cache is floored at ``TAIL_FLOOR`` (a reverse KL
against a zero-mass bucket is infinite); with k = the vocabulary there is no tail bucket.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from fedasync.importance import (
    importance_ratio,
    masked_mean,
    staleness_aware_weight,
    token_staleness,
    truncated_importance_weight,
)
from trainers.rl.learner import Learner, behaviour_metrics, pad_rows
from trainers.rl.policy import Policy, sequence_distributions
from trainers.rl.rollout import Group, Trajectory

TAIL_FLOOR = math.log(1e-9)
"""Smallest log-mass of the teacher's tail bucket (when k < vocabulary)."""

PG_LOSSES = ("pg_kl", "pg_kl_online")
TOPK_LOSSES = ("forward_kl", "reverse_kl")


# --------------------------------------------------------------------- the teacher's cache
def tail_logmass(logp_top: Tensor) -> Tensor:
    """log(1 − Σ exp(logp_top)) over the last axis: the log-mass outside the top ids
    (−inf when they hold it all)."""
    s = torch.logsumexp(logp_top, dim=-1).clamp(max=0.0)
    return torch.log(-torch.expm1(s))


@torch.no_grad()
def score_group(
    teacher: Policy, group: Group, top_k: int, device: torch.device | None = None
) -> Group:
    """Fill every trajectory's ``teacher`` cache (see :class:`Trajectory`); returns ``group``.

    ``top_k`` 0 or >= the vocabulary caches the whole distribution (no tail bucket).
    """
    trajs = group.trajectories
    if not trajs:
        return group
    logp_all, _, _ = sequence_distributions(
        teacher, [t.prompt for t in trajs], [t.tokens for t in trajs], 1.0, device
    )
    logp_all = logp_all.float().cpu()
    vocab = logp_all.shape[-1]
    k = vocab if top_k <= 0 else min(top_k, vocab)
    for i, t in enumerate(trajs):
        lp = logp_all[i, : len(t.tokens)]
        vals, ids = lp.topk(k, dim=-1)
        if k == vocab:
            tail = torch.full((len(t.tokens),), -math.inf)
        else:
            tail = tail_logmass(vals).clamp(min=TAIL_FLOOR)
        scored = torch.tensor([[y, *more] for y, more in zip(t.tokens, _mc_rows(t))])
        t.teacher = {
            "topk_ids": ids.to(torch.int16),
            "topk_logp": vals.contiguous(),
            "tail_logp": tail,
            "token_logp": lp.gather(1, scored).contiguous(),
        }
    return group


def _mc_rows(t: Trajectory) -> list[list[int]]:
    return t.mc_ids if t.mc_ids else [[] for _ in t.tokens]


def cache_bytes_per_token(top_k: int, vocab: int, mc_samples: int) -> int:
    """Bytes of the teacher cache per scored position: k ids (int16) and log-probs (float32),
    the tail (float32, only when k < vocab), N token log-probs (float32)."""
    k = vocab if top_k <= 0 else min(top_k, vocab)
    return k * (2 + 4) + 4 * (k < vocab) + 4 * mc_samples


def check_cache(t: Trajectory, top_k: int, mc_samples: int) -> str | None:
    """Why ``t``'s teacher cache cannot be learnt from, or None (shapes, finiteness)."""
    c = t.teacher
    if c is None:
        return "no teacher scores"
    n = len(t.tokens)
    want = {"topk_logp": 2, "topk_ids": 2, "tail_logp": 1, "token_logp": 2}
    for key, dims in want.items():
        v = c.get(key)
        if not isinstance(v, Tensor) or v.dim() != dims or v.shape[0] != n:
            return f"teacher cache {key} has the wrong shape for {n} tokens"
    if c["token_logp"].shape[1] != mc_samples or c["topk_ids"].shape != c["topk_logp"].shape:
        return "teacher cache has the wrong number of scored ids"
    k, tail = c["topk_logp"].shape[1], c["tail_logp"]
    whole = bool(torch.isneginf(tail).all())  # no tail bucket: k is the whole vocabulary
    if k != top_k and not (whole and (top_k <= 0 or top_k > k)):
        return f"teacher cache has {k} top-k ids per token, not distill.top_k={top_k}"
    if not (
        torch.isfinite(c["topk_logp"]).all()
        and torch.isfinite(c["token_logp"]).all()
        and (whole or torch.isfinite(tail).all())
    ):
        return "teacher cache holds a non-finite log-prob"
    if (c["topk_logp"] > 0).any() or (c["token_logp"] > 0).any() or (tail > 0).any():
        return "teacher cache holds a positive log-prob"
    return None


# --------------------------------------------------------------------- the losses
def bucket_logprobs(
    logp_all: Tensor, topk_ids: Tensor, topk_logp: Tensor, tail_logp: Tensor
) -> tuple[Tensor, Tensor]:
    """Student and teacher log-probs over the teacher's buckets, shape ``(..., k [+ 1])``.

    ``logp_all`` (..., V) is the student's full distribution; the tail bucket (present when
    k < V) holds the student's mass outside the top-k ids and the cached teacher tail.
    """
    ids = topk_ids.long()
    student = logp_all.gather(-1, ids)
    if ids.shape[-1] >= logp_all.shape[-1]:
        return student, topk_logp
    outside = logp_all.scatter(-1, ids, -math.inf)
    student = torch.cat([student, torch.logsumexp(outside, dim=-1, keepdim=True)], dim=-1)
    teacher = torch.cat([topk_logp, tail_logp.unsqueeze(-1)], dim=-1)
    return student, teacher


def kl_divergence(p_log: Tensor, q_log: Tensor) -> Tensor:
    """Σ exp(p)(p − q) over the last axis; a bucket p gives no mass to adds 0."""
    p = p_log.exp()
    return (p * torch.where(p > 0, p_log - q_log, torch.zeros_like(p_log))).sum(-1)


def forward_kl_topk(
    logp_all: Tensor, topk_ids: Tensor, topk_logp: Tensor, tail_logp: Tensor
) -> Tensor:
    """KL(p_T ‖ π_θ) over the teacher's top-k + tail buckets, per position: shape ``(...)``."""
    s, t = bucket_logprobs(logp_all, topk_ids, topk_logp, tail_logp)
    return kl_divergence(t, s)


def reverse_kl_topk(
    logp_all: Tensor, topk_ids: Tensor, topk_logp: Tensor, tail_logp: Tensor
) -> Tensor:
    """KL(π_θ ‖ p_T) over the teacher's top-k + tail buckets, per position: shape ``(...)``."""
    s, t = bucket_logprobs(logp_all, topk_ids, topk_logp, tail_logp)
    return kl_divergence(s, t)


def pg_kl_advantage(teacher_logp: Tensor, reference_logp: Tensor) -> Tensor:
    """A = sg[log p_T(y) − log π_ref(y)]: π_ref is the behaviour μ (``pg_kl``) or the current
    student (``pg_kl_online``). Its negative is the one-sample reverse-KL estimate."""
    return (teacher_logp - reference_logp).detach()


# --------------------------------------------------------------------- the learner
def _pad(rows: list[Tensor], value: float) -> Tensor:
    return pad_sequence(rows, batch_first=True, padding_value=value)


class DistillLearner(Learner):
    """The learner of ``distill.loss`` != off: one step per batch makes one version."""

    def __init__(
        self,
        policy: Policy,
        cfg: Any,
        temperature: float,
        device: torch.device,
        loss: str,
        mc_samples: int = 1,
    ):
        super().__init__(policy, cfg, temperature, device)
        if loss not in PG_LOSSES + TOPK_LOSSES:
            raise ValueError(f"unknown distillation loss {loss!r}")
        self.loss = loss
        self.mc_samples = mc_samples

    def step(self, groups: list[Group], version: int) -> dict[str, Any]:
        """One learner step on ``groups`` with ``distill.loss``, as :meth:`Learner.step`; the
        metrics add the teacher KLs, the teacher's log-prob and the cache's bytes per token."""
        c = self.cfg
        items, metrics = self.select(groups, version)
        metrics["loss_kind"] = self.loss
        if not items:
            metrics["skipped"] = "no trajectory to learn from"
            return metrics
        trajs = [t for t, _ in items]
        dev = self.device
        prompts = [t.prompt for t in trajs]
        comps = [t.tokens for t in trajs]
        caches = [t.teacher for t in trajs]
        assert all(x is not None for x in caches), "a trajectory reached the learner unscored"
        topk_ids = _pad([x["topk_ids"].long() for x in caches], 0).to(dev)  # type: ignore[index]
        topk_logp = _pad([x["topk_logp"] for x in caches], 0.0).to(dev)  # type: ignore[index]
        # padded positions must stay finite (their gradient is masked, not their value)
        tail = _pad([x["tail_logp"] for x in caches], TAIL_FLOOR).to(dev)  # type: ignore[index]
        t_tok = _pad([x["token_logp"] for x in caches], 0.0).to(dev)  # type: ignore[index]
        # the scored ids per position: the generated token, then the Monte Carlo ones
        ids = _pad(
            [torch.tensor([[y, *m] for y, m in zip(t.tokens, _mc_rows(t))]) for t in trajs], 0
        ).to(dev)
        behav = _pad(
            [torch.tensor([[b, *m] for b, m in zip(t.logprobs, _mc_lp(t))]) for t in trajs], 0.0
        ).to(dev, torch.float32)
        tau = token_staleness(version, pad_rows([t.versions for t in trajs], version, torch.long))

        self.policy.eval()
        with torch.no_grad():
            prox_all, mask, _ = sequence_distributions(
                self.policy, prompts, comps, self.temperature, dev
            )
        prox = prox_all.gather(-1, ids)
        metrics |= behaviour_metrics(prox[..., 0], behav[..., 0], mask, c.tis_cap)
        with torch.no_grad():
            metrics["entropy"] = float(masked_mean(-(prox_all.exp() * prox_all).sum(-1), mask))
            metrics["teacher_fkl"] = float(
                masked_mean(forward_kl_topk(prox_all, topk_ids, topk_logp, tail), mask)
            )
            metrics["teacher_rkl"] = float(
                masked_mean(reverse_kl_topk(prox_all, topk_ids, topk_logp, tail), mask)
            )
            metrics["teacher_logp"] = float(masked_mean(t_tok[..., 0], mask))
        metrics["cache_bytes_per_token"] = cache_bytes_per_token(
            topk_ids.shape[-1], prox_all.shape[-1], t_tok.shape[-1]
        )
        n = len(trajs)
        parts = [list(range(n))[i :: c.minibatches] for i in range(c.minibatches)]
        clipped, losses, gnorms = 0.0, [], []
        self.policy.train()
        for idx in parts:
            if not idx:
                continue
            new_all, m, _ = sequence_distributions(
                self.policy,
                [prompts[i] for i in idx],
                [comps[i] for i in idx],
                self.temperature,
                dev,
            )
            sel = torch.tensor(idx, device=dev)
            w = new_all.shape[1]
            cut = {
                "ids": ids[sel][:, :w],
                "prox": prox[sel][:, :w],
                "behav": behav[sel][:, :w],
                "t_tok": t_tok[sel][:, :w],
                "topk_ids": topk_ids[sel][:, :w],
                "topk_logp": topk_logp[sel][:, :w],
                "tail": tail[sel][:, :w],
                "tau": tau[sel.cpu()][:, :w],
            }
            new = new_all.gather(-1, cut["ids"])
            loss = self._distill_loss(new_all, new, m, cut)
            ratio = importance_ratio(new[..., 0].detach(), cut["prox"][..., 0])
            clipped += float((((ratio - 1.0).abs() > c.clip_eps) & m).sum())
            losses.append(float(loss.detach()))
            gnorms.append(self.apply(loss))
        self.policy.eval()
        metrics["loss"] = sum(losses) / len(losses)
        metrics["grad_norm"] = max(gnorms)
        metrics["clip_frac"] = clipped / max(float(mask.sum()), 1.0)
        return metrics

    def _distill_loss(
        self, new_all: Tensor, new: Tensor, mask: Tensor, cut: dict[str, Tensor]
    ) -> Tensor:
        if self.loss in PG_LOSSES:
            ref = cut["behav"] if self.loss == "pg_kl" else new
            adv = pg_kl_advantage(cut["t_tok"], ref)
            n_mc = new.shape[-1]
            m = mask.unsqueeze(-1).expand(-1, -1, n_mc)
            tau = cut["tau"].unsqueeze(-1).expand(-1, -1, n_mc)
            return self._loss(new, cut["prox"], cut["behav"], adv, m, tau)
        fn = forward_kl_topk if self.loss == "forward_kl" else reverse_kl_topk
        per_pos = fn(new_all, cut["topk_ids"], cut["topk_logp"], cut["tail"])
        w = self._token_weight(cut["prox"][..., 0], cut["behav"][..., 0], cut["tau"])
        return masked_mean(w * per_pos, mask)

    def _token_weight(self, prox: Tensor, behav: Tensor, tau: Tensor) -> Tensor:
        """The correction's weight of each position for the top-k losses (detached)."""
        c = self.cfg
        if c.correction in ("none", "drop"):
            return torch.ones_like(prox)
        w = truncated_importance_weight(importance_ratio(prox, behav), c.tis_cap)
        if c.correction == "weight":
            w = staleness_aware_weight(w, tau.to(w.device), self.weight_fn)
        return w.detach()


def _mc_lp(t: Trajectory) -> list[list[float]]:
    return t.mc_logprobs if t.mc_logprobs else [[] for _ in t.tokens]
