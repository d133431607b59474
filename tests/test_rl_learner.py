"""The RL learner's arithmetic by hand: GRPO advantages, what each correction does with a
stale token, the staleness histogram and drops."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.rl.config import LearnerSection
from trainers.rl.learner import Learner, grpo_advantages
from trainers.rl.policy import PolicyConfig, TinyLM, sequence_logprobs
from trainers.rl.rollout import Group, Trajectory
from trainers.rl.tasks import VOCAB_SIZE, encode


def test_grpo_advantages_are_the_group_z_scores():
    a = grpo_advantages([1.0, 0.0, 0.0, 1.0])

    assert a == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert grpo_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert grpo_advantages([0.5]) == [0.0]


def _policy() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(PolicyConfig(vocab_size=VOCAB_SIZE, d_model=16, n_layers=1, n_heads=2))


def _group(policy: TinyLM, version: int, shift: float, group_id: int = 0) -> Group:
    """Two trajectories (rewards 1 and 0) whose behaviour log-probs are the policy's own
    shifted by ``shift`` nats (shift < 0: the behaviour policy thought them less likely)."""
    prompt = (1, *encode("s:21="))
    comps = [encode("12") + [2], encode("21") + [2]]
    with torch.no_grad():
        logp, mask, _ = sequence_logprobs(policy, [prompt, prompt], comps)
    trajs = [
        Trajectory(
            prompt=prompt,
            tokens=c,
            logprobs=[float(x) + shift for x in logp[i, : len(c)]],
            versions=[version] * len(c),
            reward=r,
            text="",
        )
        for i, (c, r) in enumerate(zip(comps, [1.0, 0.0]))
    ]
    return Group(group_id, version, trajs)


def _learner(policy: TinyLM, **kw) -> Learner:
    return Learner(policy, LearnerSection(**kw), 1.0, torch.device("cpu"))


def test_fresh_tokens_have_unit_weights_and_no_kl():
    policy = _policy()
    m = _learner(policy, correction="decoupled").step([_group(policy, 3, 0.0)], 3)

    assert m["staleness_hist"] == {"0": 2}
    assert m["ess"] == pytest.approx(1.0, abs=1e-6)
    assert m["kl_behav"] == pytest.approx(0.0, abs=1e-6)
    assert m["trunc_frac"] == 0.0
    assert m["grad_norm"] > 0


def test_a_stale_token_above_the_cap_is_truncated_and_counted():
    policy = _policy()
    # behaviour log-probs 2 nats lower: π_prox/μ = e² ≈ 7.4 > C = 2
    m = _learner(policy, correction="tis", tis_cap=2.0).step([_group(policy, 1, -2.0)], 3)

    assert m["staleness_hist"] == {"2": 2}
    assert m["trunc_frac"] == 1.0
    k3 = (math.exp(2.0) - 1.0) - 2.0
    assert m["kl_behav"] == pytest.approx(k3, rel=1e-4)


@pytest.mark.parametrize("correction", ["tis", "decoupled", "weight"])
def test_the_truncated_weight_scales_the_gradient_by_the_cap(correction):
    """A uniform importance weight w scales the gradient by w: capped at C it is C x the
    gradient of the same fresh batch (PPO's clip does not act on the first pass)."""
    grads = {}
    for name, version, shift in (("fresh", 5, 0.0), ("stale", 4, -3.0)):
        policy = _policy()
        learner = _learner(policy, correction=correction, tis_cap=2.0, max_grad_norm=1e9)
        learner.opt = torch.optim.SGD(policy.parameters(), lr=0.0)
        learner.step([_group(policy, version, shift)], 5)
        grads[name] = torch.cat([p.grad.reshape(-1) for p in policy.parameters()])

    scale = 2.0
    if correction == "weight":  # times s(τ=1) = (1 + 1)^−0.5
        scale *= 2**-0.5
    assert torch.allclose(grads["stale"], scale * grads["fresh"], rtol=1e-4, atol=1e-7)


def test_none_ignores_the_behaviour_policy():
    grads = []
    for shift in (0.0, -3.0):
        policy = _policy()
        learner = _learner(policy, correction="none", max_grad_norm=1e9)
        learner.opt = torch.optim.SGD(policy.parameters(), lr=0.0)
        learner.step([_group(policy, 4, shift)], 5)
        grads.append(torch.cat([p.grad.reshape(-1) for p in policy.parameters()]))

    assert torch.equal(grads[0], grads[1])


def test_drop_leaves_out_trajectories_staler_than_drop_beyond():
    policy = _policy()
    learner = _learner(policy, correction="drop", drop_beyond=1)
    groups = [_group(policy, 5, 0.0, 0), _group(policy, 3, 0.0, 1)]

    m = learner.step(groups, 5)

    assert m["trajectories"] == 2
    assert m["dropped"] == {"staler than learner.drop_beyond": 2}
    assert m["staleness_hist"] == {"0": 2, "2": 2}
