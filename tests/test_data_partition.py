"""Partition and site-shift behaviour (medical_data.partition), on small hand-made inputs."""

import numpy as np
import pytest

from medical_data.partition import (
    apply_site_shift,
    dirichlet_partition,
    iid_partition,
    natural_partition,
)


def _assert_disjoint_cover(parts: list[np.ndarray], n: int) -> None:
    allidx = np.concatenate(parts)
    assert len(allidx) == n
    assert np.array_equal(np.sort(allidx), np.arange(n))


def test_dirichlet_is_deterministic_and_seed_dependent() -> None:
    labels = np.repeat(np.arange(3), 100)
    a = dirichlet_partition(labels, 5, 0.5, np.random.default_rng(1))
    b = dirichlet_partition(labels, 5, 0.5, np.random.default_rng(1))
    c = dirichlet_partition(labels, 5, 0.5, np.random.default_rng(2))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    _assert_disjoint_cover(a, 300)


def test_dirichlet_small_alpha_skews_more() -> None:
    labels = np.repeat(np.arange(4), 250)

    def mean_max_share(alpha: float) -> float:
        shares = []
        for seed in range(5):
            for p in dirichlet_partition(labels, 8, alpha, np.random.default_rng(seed)):
                counts = np.bincount(labels[p], minlength=4)
                shares.append(counts.max() / counts.sum())
        return float(np.mean(shares))

    skewed, near_iid = mean_max_share(0.1), mean_max_share(100.0)
    assert skewed > 0.7
    assert near_iid < 0.4
    assert all(len(p) >= 2 for p in dirichlet_partition(labels, 8, 0.05, np.random.default_rng(0)))


def test_dirichlet_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="alpha"):
        dirichlet_partition(np.zeros(10), 2, 0.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="cannot give"):
        dirichlet_partition(np.zeros(10), 6, 1.0, np.random.default_rng(0))


def test_natural_keeps_groups_whole_and_contiguous() -> None:
    # Prepare: 12 slices with 10 samples each, shuffled order
    groups = np.random.default_rng(0).permutation(np.repeat(np.arange(12), 10))
    # Execute
    parts = natural_partition(groups, 4)
    # Assert: each group in exactly one silo, silos are runs of 3 slices
    _assert_disjoint_cover(parts, 120)
    owners = [sorted(set(groups[p].tolist())) for p in parts]
    assert owners == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_natural_splits_groups_when_fewer_than_silos() -> None:
    groups = np.array([0] * 25 + [1] * 23 + [2] * 21 + [3] * 48 + [4] * 61)
    parts = natural_partition(groups, 10)
    _assert_disjoint_cover(parts, len(groups))
    assert all(len(set(groups[p].tolist())) == 1 for p in parts)  # a silo never mixes patients
    assert sorted(len(p) for p in parts)[0] >= 12
    assert [len(p) for p in natural_partition(groups, 5)] == [25, 23, 21, 48, 61]


def test_iid_even_split() -> None:
    parts = iid_partition(103, 10, np.random.default_rng(0))
    _assert_disjoint_cover(parts, 103)
    assert {len(p) for p in parts} == {10, 11}


def test_site_shift_deterministic_per_seed_and_changes_intensities() -> None:
    images = np.random.default_rng(0).random((16, 1, 28, 28), dtype=np.float32)
    a, pa = apply_site_shift(images, seed=3, strength=1.0)
    b, pb = apply_site_shift(images, seed=3, strength=1.0)
    c, pc = apply_site_shift(images, seed=4, strength=1.0)
    assert a.dtype == np.float32 and a.shape == images.shape
    assert np.array_equal(a, b) and pa == pb
    assert not np.allclose(a, c) and pa != pc
    assert np.abs(a - images).mean() > 0.01
    same, p0 = apply_site_shift(images, seed=3, strength=0.0)
    assert np.array_equal(same, images) and p0["gamma"] == 1.0


def test_site_parameters_do_not_depend_on_batch() -> None:
    images = np.random.default_rng(0).random((20, 1, 16, 16), dtype=np.float32)
    _, p_all = apply_site_shift(images, seed=9)
    _, p_few = apply_site_shift(images[:5], seed=9)
    assert p_all["gamma"] == p_few["gamma"] and p_all["blur_sigma"] == p_few["blur_sigma"]
