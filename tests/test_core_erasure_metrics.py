"""The verification protocol's arithmetic (issue 14 §4), each value worked out by hand."""

import math

import pytest
import torch

from fedasync.erasure_metrics import (
    anamnesis_index,
    distance_to_retraining,
    noise_floor,
    output_divergence,
    relative_l2,
    resurfacing_gap,
    reversion_ratio,
)


def _p(*values, n=3):
    return {"w": torch.tensor(values, dtype=torch.float32), "n": torch.tensor(n)}


def test_reversion_ratio():
    w_pre, w_b = _p(2.0, 0.0), _p(0.0, 0.0)  # w_pre - w_B = (2, 0), squared norm 4
    assert reversion_ratio(_p(1.0, 5.0), w_b, w_pre) == pytest.approx(0.5)  # (1, 5).(2, 0)/4
    assert reversion_ratio(w_pre, w_b, w_pre) == pytest.approx(1.0)
    assert reversion_ratio(_p(-1.0, 0.0), w_b, w_pre) == pytest.approx(-0.5)
    assert math.isnan(reversion_ratio(w_b, w_b, w_b))


def test_relative_l2():
    assert relative_l2(_p(3.0, 4.0), _p(0.0, 5.0)) == pytest.approx(math.sqrt(9 + 1) / 5)
    assert relative_l2(_p(1.0, 1.0), _p(1.0, 1.0, n=9)) == 0.0  # integer buffers ignored


def test_output_divergence_of_equal_and_of_two_known_distributions():
    same = output_divergence(torch.zeros(4, 3), torch.zeros(4, 3))
    assert same == {"kl": pytest.approx(0.0), "js": pytest.approx(0.0)}
    # p = (0.5, 0.5) and q = (0.8, 0.2): KL = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2)
    p = torch.log(torch.tensor([[0.5, 0.5]]))
    q = torch.log(torch.tensor([[0.8, 0.2]]))
    got = output_divergence(p, q)
    assert got["kl"] == pytest.approx(0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2))
    m = (0.65, 0.35)
    js = 0.5 * (0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1])) + 0.5 * (
        0.8 * math.log(0.8 / m[0]) + 0.2 * math.log(0.2 / m[1])
    )
    assert got["js"] == pytest.approx(js)
    with pytest.raises(ValueError, match="shapes differ"):
        output_divergence(torch.zeros(2, 3), torch.zeros(2, 4))


def test_segmentation_logits_average_over_pixels_too():
    p, q = torch.zeros(1, 2, 2, 2), torch.zeros(1, 2, 2, 2)
    q[0, 0, 0, 0] = math.log(4.0)  # one pixel: q = (0.8, 0.2); the other three equal p
    one = output_divergence(p[:, :, 0, 0], q[:, :, 0, 0])["kl"]
    assert output_divergence(p, q)["kl"] == pytest.approx(one / 4)


def test_resurfacing_gap_counts_only_rising_above_retraining():
    assert resurfacing_gap([0.5, 0.1, 0.9], [0.2, 0.3, 0.3]) == pytest.approx((0.3 + 0.6) / 3)
    assert resurfacing_gap([0.0, 0.0], [0.5, 0.5]) == 0.0
    with pytest.raises(ValueError):
        resurfacing_gap([0.1], [0.1, 0.2])


def test_anamnesis_index():
    assert anamnesis_index(30, 60) == 0.5
    with pytest.raises(ValueError):
        anamnesis_index(30, 0)


def test_noise_floor_and_the_two_sided_distance():
    retrained = [0.70, 0.74, 0.78]  # pairs: 0.04, 0.08, 0.04 -> floor 0.16/3
    floor = 0.16 / 3
    assert noise_floor(retrained) == pytest.approx(floor)
    assert noise_floor([0.7]) == 0.0
    # 0.80 is 0.06 above the mean 0.74; 0.68 is 0.06 below: the same distance both ways
    assert distance_to_retraining(0.80, retrained) == pytest.approx(0.06 / floor)
    assert distance_to_retraining(0.68, retrained) == pytest.approx(0.06 / floor)
    assert distance_to_retraining(0.5, [0.7]) == pytest.approx(0.2)  # no floor: plain distance
