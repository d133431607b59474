"""The verification protocol's arithmetic (issue 14 §4), each value worked out by hand."""

import math

import numpy as np
import pytest
import torch

from fedasync.erasure_metrics import (
    anamnesis_index,
    distance_to_retraining,
    lira_scores,
    logit_scale,
    noise_floor,
    output_divergence,
    rank_auc,
    relative_l2,
    resurfacing_gap,
    reversion_ratio,
    true_label_confidence,
    ulira_auc,
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


# --- membership inference: rank AUC, LiRA, U-LiRA ---------------------------------------


def test_rank_auc_by_hand_with_ties():
    assert rank_auc([3.0, 4.0], [1.0, 2.0]) == 1.0
    assert rank_auc([1.0, 2.0], [3.0, 4.0]) == 0.0
    # pairs: 0.1 vs (0.1 tie, 0.3 lose, 0.2 lose); 0.3 vs (win, tie, win) -> (0.5 + 2.5) / 6
    assert rank_auc([0.1, 0.3], [0.1, 0.3, 0.2]) == pytest.approx(0.5)
    assert rank_auc([5.0, 5.0], [5.0]) == 0.5  # all tied
    assert rank_auc([2.0, 1.0, 3.0], [1.0]) == pytest.approx((0.5 + 1 + 1) / 3)
    assert rank_auc(torch.tensor([[2.0], [0.0]]), np.array([1.0])) == 0.5  # any shape, flattened
    with pytest.raises(ValueError, match="positive and a negative"):
        rank_auc([], [1.0])
    with pytest.raises(ValueError, match="NaN"):
        rank_auc([float("nan")], [1.0])


def test_rank_auc_matches_the_pairwise_definition():
    rng = np.random.default_rng(0)
    pos, neg = rng.integers(0, 5, 40).astype(float), rng.integers(0, 5, 30).astype(float)
    pairs = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
    assert rank_auc(pos, neg) == pytest.approx(pairs.mean())


def test_true_label_confidence():
    logits = np.log(np.array([[0.7, 0.2, 0.1], [0.25, 0.25, 0.5]]))
    assert true_label_confidence(logits, np.array([0, 2])) == pytest.approx([0.7, 0.5])
    # torch in, pixels averaged: one image of 2 pixels, true-label probs 0.8 and 0.4
    seg = torch.log(torch.tensor([[[0.8, 0.6], [0.2, 0.4]]], dtype=torch.float64))
    assert true_label_confidence(seg, torch.tensor([[0, 1]])) == pytest.approx([0.6])
    with pytest.raises(ValueError, match="labels"):
        true_label_confidence(logits, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        true_label_confidence(logits, np.array([0, 3]))
    with pytest.raises(ValueError, match="integer"):
        true_label_confidence(logits, np.array([0.0, 1.0]))


def test_logit_scale_clips():
    assert logit_scale([0.5, 0.0, 1.0]) == pytest.approx([0.0, math.log(1e-6), -math.log(1e-6)])


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _shadows(k_in, k_out, n=200, gap=2.0, noise=0.5, seed=0):
    """Confidences whose logits are Gaussian per example: each example has its own difficulty
    (the per-example mean); training on it adds ``gap``. Returns a sampler too."""
    rng = np.random.default_rng(seed)
    base = rng.normal(0.0, 1.5, n)

    def draw(k, member):
        return _sig(base + (gap if member else 0.0) + rng.normal(0.0, noise, (k, n)))

    return draw(k_in, True), draw(k_out, False), draw


def test_lira_separates_members_from_non_members():
    ins, outs, draw = _shadows(16, 16)
    member, non_member = draw(4, True), draw(4, False)
    s_in, s_out = lira_scores(member, ins, outs), lira_scores(non_member, ins, outs)
    assert s_in.shape == s_out.shape == (4, 200)
    assert rank_auc(s_in, s_out) > 0.95
    assert lira_scores(member[0], ins, outs).shape == (200,)  # one target: (N,)
    # U-LiRA: a model that kept the data is told from retraining; a retrained one is not
    assert ulira_auc(member, non_member, ins, outs) > 0.95
    assert abs(ulira_auc(draw(4, False), non_member, ins, outs) - 0.5) < 0.05
    # over-erasure: further out than retraining scores below 0.5, the AUC is not folded
    over = _sig(logit_scale(non_member) - 2.0)
    assert ulira_auc(over, non_member, ins, outs) < 0.25


def test_lira_with_one_shadow_model_per_side_needs_the_fixed_variance():
    ins, outs, draw = _shadows(1, 1)
    with pytest.raises(ValueError, match="fixed_variance"):
        lira_scores(draw(1, True), ins, outs)
    auc = ulira_auc(draw(2, True), draw(2, False), ins, outs, fixed_variance=True)
    assert auc > 0.9
    assert (
        abs(ulira_auc(draw(2, False), draw(2, False), ins[0], outs[0], fixed_variance=True) - 0.5)
        < 0.07
    )


def test_lira_floors_the_std_of_identical_shadow_models():
    ins, outs = np.full((3, 2), 0.9), np.full((3, 2), 0.1)
    scores = lira_scores(np.array([0.9, 0.1]), ins, outs, min_std=0.5)
    assert np.isfinite(scores).all() and scores[0] > 0 > scores[1]
    with pytest.raises(ValueError, match="min_std"):
        lira_scores(np.array([0.9, 0.1]), ins, outs, min_std=0.0)


@pytest.mark.parametrize(
    ("target", "ins", "outs", "match"),
    [
        (np.full(3, 0.5), np.full((2, 3), 0.5), np.full((2, 4), 0.5), "out_conf 4"),
        (np.full(4, 0.5), np.full((2, 3), 0.5), np.full((2, 3), 0.5), "target_conf"),
        (np.full((2, 2, 3), 0.5), np.full((2, 3), 0.5), np.full((2, 3), 0.5), "target_conf"),
        (np.full(3, 0.5), np.full((2, 3, 1), 0.5), np.full((2, 3), 0.5), "in_conf must be"),
        (np.full(3, 0.5), np.zeros((0, 3)), np.full((2, 3), 0.5), "in_conf must be"),
        (np.full(3, 1.5), np.full((2, 3), 0.5), np.full((2, 3), 0.5), r"\[0, 1\]"),
        (np.full(3, 0.5), np.full((2, 3), np.nan), np.full((2, 3), 0.5), "NaN"),
    ],
)
def test_lira_validates_shapes_and_values(target, ins, outs, match):
    with pytest.raises(ValueError, match=match):
        lira_scores(target, ins, outs)
