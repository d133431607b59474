import math

import pytest
import torch

from fedasync.importance import (
    clipped_surrogate,
    importance_ratio,
    staleness_aware_weight,
    truncated_importance_weight,
)
from fedasync.staleness import make_weight_fn


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
