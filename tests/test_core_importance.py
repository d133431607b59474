import math

import pytest
import torch

from fedasync.importance import (
    clipped_surrogate,
    decoupled_ppo_loss,
    effective_sample_size,
    importance_ratio,
    masked_mean,
    staleness_aware_weight,
    token_staleness,
    truncated_importance_weight,
)
from fedasync.staleness import make_weight_fn
from fedasync.versions import FutureVersionError


def test_importance_ratio_shape_and_values():
    # Prepare
    logp_old = torch.full((2, 3), math.log(0.3))
    logp_new = torch.full((2, 3), math.log(0.6))

    # Execute
    r = importance_ratio(logp_new, logp_old)

    # Assert
    assert r.shape == (2, 3)
    torch.testing.assert_close(r, torch.full((2, 3), 2.0))


def test_truncated_importance_weight():
    r = torch.tensor([0.5, 2.0, 1.0])
    assert truncated_importance_weight(r, 1.0).tolist() == [0.5, 1.0, 1.0]
    with pytest.raises(ValueError):
        truncated_importance_weight(r, 0.0)


def test_clipped_surrogate_by_hand():
    # Prepare
    r = torch.tensor([0.5, 1.5, 1.5])
    adv = torch.tensor([1.0, 1.0, -1.0])

    # Execute
    loss = clipped_surrogate(r, adv, eps=0.2)

    # Assert: r*A = [0.5, 1.5, -1.5]; clip(r)*A = [0.8, 1.2, -1.2]; min = [0.5, 1.2, -1.5]
    assert loss.shape == ()
    assert loss.item() == pytest.approx(-(0.5 + 1.2 - 1.5) / 3, abs=1e-6)


def test_clipped_surrogate_gradient_zero_when_clipped():
    r = torch.tensor([1.5], requires_grad=True)
    clipped_surrogate(r, torch.tensor([1.0]), eps=0.2).backward()
    assert r.grad is not None and r.grad.item() == 0.0


def test_staleness_aware_weight_int_and_tensor_tau():
    # Prepare
    poly = make_weight_fn("polynomial", a=0.5)
    r = torch.tensor([2.0, 2.0])

    # Execute / Assert: s(0) = 1, s(3) = 0.5
    assert staleness_aware_weight(r, torch.tensor([0, 3]), poly).tolist() == [2.0, 1.0]
    assert staleness_aware_weight(r, 3, poly).tolist() == [1.0, 1.0]
    with pytest.raises(TypeError):
        staleness_aware_weight(r, torch.tensor([0.0, 1.0]), poly)


def test_decoupled_ppo_equals_clipped_surrogate_when_behaviour_is_proximal():
    # Prepare
    logp_new = torch.log(torch.tensor([[0.5, 0.3], [0.2, 0.6]]))
    logp_old = torch.log(torch.tensor([[0.25, 0.3], [0.4, 0.5]]))
    adv = torch.tensor([[1.0, -1.0], [1.0, -1.0]])

    # Execute
    decoupled = decoupled_ppo_loss(logp_new, logp_old, logp_old, adv, eps=0.2)
    plain = clipped_surrogate(importance_ratio(logp_new, logp_old), adv, eps=0.2)

    # Assert
    assert decoupled.item() == pytest.approx(plain.item(), abs=1e-6)


def test_decoupled_ppo_by_hand_with_cap_and_mask():
    # Prepare: proximal p = 0.4, new p = 0.6 (r = 1.5, clipped to 1.2 for A > 0);
    # behaviour p = 0.1 (w = 4, capped at 2) and 0.8 (w = 0.5); the last token is padding
    logp_new = torch.log(torch.tensor([0.6, 0.6, 0.6]))
    logp_prox = torch.log(torch.tensor([0.4, 0.4, 0.4]))
    logp_behav = torch.log(torch.tensor([0.1, 0.8, 0.1]))
    adv = torch.tensor([1.0, 1.0, 100.0])
    mask = torch.tensor([True, True, False])

    # Execute
    loss = decoupled_ppo_loss(
        logp_new, logp_prox, logp_behav, adv, eps=0.2, max_behav_weight=2.0, mask=mask
    )

    # Assert: -(2 * 1.2 + 0.5 * 1.2) / 2
    assert loss.item() == pytest.approx(-(2 * 1.2 + 0.5 * 1.2) / 2, abs=1e-5)


def test_decoupled_ppo_gradient_flows_only_through_the_new_policy():
    # Prepare
    logp_new = torch.log(torch.tensor([0.5])).requires_grad_()
    logp_prox = torch.log(torch.tensor([0.5])).requires_grad_()
    logp_behav = torch.log(torch.tensor([0.25])).requires_grad_()

    # Execute: r = 1 (inside the clip range), w = 2
    decoupled_ppo_loss(logp_new, logp_prox, logp_behav, torch.tensor([1.0]), eps=0.2).backward()

    # Assert: d/dlogp_new of -(w * exp(logp_new - logp_prox) * A) = -w * r * A = -2
    assert logp_new.grad is not None and logp_new.grad.item() == pytest.approx(-2.0)
    assert logp_prox.grad is None and logp_behav.grad is None


def test_masked_mean_by_hand():
    x = torch.tensor([[1.0, 2.0], [3.0, 10.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    assert masked_mean(x).item() == pytest.approx(4.0)
    with pytest.raises(ValueError, match="no position"):
        masked_mean(x, torch.zeros(2, 2))


def test_effective_sample_size_by_hand():
    assert effective_sample_size(torch.ones(8)) == pytest.approx(1.0)
    assert effective_sample_size(torch.tensor([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
    # (1 + 3)^2 / (1 + 9) / 2 = 0.8
    assert effective_sample_size(torch.tensor([1.0, 3.0])) == pytest.approx(0.8)
    masked = torch.tensor([1.0, 3.0, 100.0])
    assert effective_sample_size(masked, torch.tensor([1, 1, 0])) == pytest.approx(0.8)
    assert effective_sample_size(torch.zeros(3)) == 0.0
    for bad in (torch.tensor([1.0, -1.0]), torch.tensor([1.0, math.nan])):
        with pytest.raises(ValueError):
            effective_sample_size(bad)
    with pytest.raises(ValueError):
        effective_sample_size(torch.ones(2), torch.zeros(2))


def test_token_staleness_per_token_versions():
    # a trajectory started under version 3 and resumed under 5 (partial rollout), learner at 6
    versions = torch.tensor([[3, 3, 5, 5], [6, 6, 6, 6]])
    assert token_staleness(6, versions).tolist() == [[3, 3, 1, 1], [0, 0, 0, 0]]
    with pytest.raises(FutureVersionError):
        token_staleness(4, versions)
    with pytest.raises(TypeError):
        token_staleness(6, versions.float())
    with pytest.raises(ValueError):
        token_staleness(6, torch.tensor([-1]))


def test_importance_ratio_clamps_the_log_ratio_when_asked():
    new, old = torch.tensor([0.0, -1.0, 200.0]), torch.tensor([0.0, 0.0, 0.0])
    exact = importance_ratio(new, old)
    assert torch.isinf(exact[2])  # exp(200) overflows float32
    r = importance_ratio(new, old, max_log_ratio=5.0)
    assert r.tolist() == pytest.approx([1.0, math.exp(-1.0), math.exp(5.0)], rel=1e-6)
    with pytest.raises(ValueError):
        importance_ratio(new, old, max_log_ratio=0.0)
