"""The erasure's stopping rule (fedasync.membership): a two-sided membership test."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedasync.membership import MembershipStop, Reading, band, null_sd


def test_the_band_is_the_normal_quantile_times_the_null_sd():
    assert null_sd(100, 100) == pytest.approx(math.sqrt(201 / 120000))
    assert band(100, 100, 0.05) == pytest.approx(1.959964 * math.sqrt(201 / 120000), rel=1e-5)
    assert band(400, 400, 0.05) < band(100, 100, 0.05) < band(100, 100, 0.01)


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.1, 2.0])
def test_alpha_outside_zero_one_is_refused(alpha):
    with pytest.raises(ValueError, match="alpha"):
        MembershipStop(alpha=alpha)


def test_empty_sets_are_refused():
    with pytest.raises(ValueError):
        MembershipStop().read(np.array([]), np.array([1.0]))


def test_samples_drawn_alike_are_rejected_at_about_the_stated_rate():
    # the test's size: drawn from one distribution, "not indistinguishable" about alpha of the time
    rule, rng = MembershipStop(alpha=0.1), np.random.default_rng(0)
    wrong = sum(
        rule.read(rng.normal(size=60), rng.normal(size=80)).verdict != "indistinguishable"
        for _ in range(2000)
    )
    assert 0.07 < wrong / 2000 < 0.13


def test_the_verdict_says_which_side_a_shift_lies_on():
    rule, rng = MembershipStop(), np.random.default_rng(1)
    held = rng.normal(size=200)
    member = rule.read(rng.normal(1.0, size=200), held)
    assert member.verdict == "member" and member.p_value < 1e-6
    assert rule.read(rng.normal(-1.0, size=200), held).verdict == "over"
    assert rule.read(held + 10.0, held).auc == 1.0


def test_a_track_goes_on_while_member_and_stops_within_the_band():
    track = MembershipStop().track()
    b = band(100, 100, 0.05)
    assert not track.add(0, Reading(0.9, b, 100, 100)).stop
    assert not track.add(2, Reading(0.7, b, 100, 100)).stop
    d = track.add(4, Reading(0.5 + b / 2, b, 100, 100))
    assert d.stop and d.reason == "indistinguishable" and d.revert_to is None
    assert track.summary()["auc_before"] == 0.9 and track.summary()["readings"] == 3


def test_an_overshoot_reverts_to_the_reading_closest_to_one_half():
    track = MembershipStop().track()
    b = 0.05
    track.add(0, Reading(0.9, b, 100, 100))
    track.add(3, Reading(0.58, b, 100, 100))  # gap 0.08: the best so far
    d = track.add(6, Reading(0.35, b, 100, 100))  # gap 0.15, over-erased
    assert d.stop and d.reason == "over" and d.revert_to == 3
    assert track.best() == (3, Reading(0.58, b, 100, 100))
