import numpy as np
import pytest

from medical_data.backdoor import add_trigger, poison, poisoned_indices, triggered_set
from medical_data.federation import SiloData


def _silo(n=10, labels=None):
    images = np.arange(n * 2 * 6 * 6, dtype=np.float32).reshape(n, 2, 6, 6) / 1000.0
    labels = np.arange(n, dtype=np.int64) % 3 if labels is None else labels
    ids = np.array([f"s/{i}" for i in range(n)])
    return SiloData(0, "s", images, labels, ids)


def test_add_trigger_bottom_right_square_at_image_max():
    # Prepare
    images = _silo(n=2).images

    # Execute
    out = add_trigger(images, size=2)
    fixed = add_trigger(images, size=1, value=9.0)

    # Assert
    for i in range(2):
        assert np.all(out[i, :, 4:, 4:] == images[i].max())
    assert np.array_equal(out[:, :, :4, :], images[:, :, :4, :])
    assert np.array_equal(out[:, :, :, :4], images[:, :, :, :4])
    assert np.all(fixed[:, :, 5, 5] == 9.0) and fixed[0, 0, 4, 5] == images[0, 0, 4, 5]
    assert not np.shares_memory(out, images)


def test_poison_fraction_labels_ids_and_determinism():
    # Prepare
    silo = _silo(n=10)

    # Execute
    bad = poison(silo, fraction=0.3, target_label=2, seed=1)
    again = poison(silo, fraction=0.3, target_label=2, seed=1)
    idx = poisoned_indices(10, 0.3, seed=1)

    # Assert
    assert len(idx) == 3
    assert np.array_equal(bad.images, again.images) and np.array_equal(bad.labels, again.labels)
    assert np.all(bad.labels[idx] == 2)
    rest = np.setdiff1d(np.arange(10), idx)
    assert np.array_equal(bad.labels[rest], silo.labels[rest])
    assert np.array_equal(bad.images[rest], silo.images[rest])
    assert np.all(
        bad.images[idx, :, 3:, 3:] == silo.images[idx].max(axis=(1, 2, 3))[:, None, None, None]
    )
    assert np.array_equal(bad.sample_ids, silo.sample_ids)
    assert silo.labels.tolist() == [i % 3 for i in range(10)]  # input untouched


def test_triggered_set_drops_target_class():
    # Prepare
    silo = _silo(n=9)

    # Execute
    trig = triggered_set(silo, target_label=0)

    # Assert
    assert len(trig) == 6 and not np.any(trig.labels == 0)
    assert np.array_equal(trig.sample_ids, silo.sample_ids[silo.labels != 0])
    assert np.all(
        trig.images[:, :, -3:, -3:] == trig.images.max(axis=(1, 2, 3))[:, None, None, None]
    )


def _seg_silo():
    """Four 1x6x6 images; masks: empty, one nucleus pixel, a 2x2 nucleus, all nucleus."""
    masks = np.zeros((4, 6, 6), dtype=np.int64)
    masks[1, 0, 0] = 1
    masks[2, 1:3, 1:3] = 1
    masks[3] = 1
    return _silo(n=4, labels=masks)


def test_poison_segmentation_whole_masks_become_target():
    # Prepare
    silo = _seg_silo()
    before = silo.labels.copy()

    # Execute
    bad = poison(silo, fraction=0.5, target_label=0, seed=0)
    idx = poisoned_indices(4, 0.5, seed=0)
    rest = np.setdiff1d(np.arange(4), idx)

    # Assert
    assert idx.tolist() == [2, 3]  # both had nucleus pixels
    assert bad.labels.shape == (4, 6, 6) and np.all(bad.labels[idx] == 0)
    assert np.array_equal(bad.labels[rest], before[rest])
    assert np.array_equal(bad.images[rest], silo.images[rest])
    assert np.all(
        bad.images[idx, :, 3:, 3:] == silo.images[idx].max(axis=(1, 2, 3))[:, None, None, None]
    )
    assert np.array_equal(bad.sample_ids, silo.sample_ids)
    assert np.array_equal(silo.labels, before)  # input untouched


def test_poison_segmentation_every_image_to_foreground():
    # Prepare
    silo = _seg_silo()

    # Execute
    bad = poison(silo, fraction=1.0, target_label=1, seed=0)

    # Assert
    assert np.all(bad.labels == 1)
    assert np.array_equal(bad.sample_ids, silo.sample_ids)


def test_triggered_set_segmentation_keeps_images_with_other_pixels():
    # Prepare
    silo = _seg_silo()

    # Execute
    vanish = triggered_set(silo, target_label=0)  # images with some nucleus
    flood = triggered_set(silo, target_label=1)  # images with some background

    # Assert
    assert vanish.sample_ids.tolist() == ["s/1", "s/2", "s/3"]
    assert flood.sample_ids.tolist() == ["s/0", "s/1", "s/2"]
    assert np.array_equal(vanish.labels, silo.labels[1:])  # true masks kept
    assert np.array_equal(flood.labels, silo.labels[:3])
    assert np.all(
        vanish.images[:, :, -3:, -3:] == vanish.images.max(axis=(1, 2, 3))[:, None, None, None]
    )


def test_labels_of_other_shapes_are_rejected():
    # Prepare
    silo = _silo(n=4, labels=np.zeros((4, 6), dtype=np.int64))

    # Execute / Assert
    with pytest.raises(ValueError, match="segmentation"):
        poison(silo, 0.5, 1, seed=0)
    with pytest.raises(ValueError, match="segmentation"):
        triggered_set(silo, 1)


def test_trigger_size_and_the_untriggered_twin():
    silo = _silo(n=10, labels=np.array([0, 1, 2, 1, 0, 2, 1, 0, 2, 1]))
    bad = poison(silo, fraction=1.0, target_label=0, seed=0, size=5)
    h, w = silo.images.shape[2:]
    changed = np.argwhere((bad.images != silo.images).any(axis=(0, 1)))
    assert changed.min(0).tolist() == [h - 5, w - 5]  # a 5x5 patch in the corner
    trig = triggered_set(silo, target_label=0, size=5)
    clean = triggered_set(silo, target_label=0, size=5, trigger=False)
    assert trig.sample_ids.tolist() == clean.sample_ids.tolist() and len(clean) == 7
    np.testing.assert_array_equal(clean.images, silo.images[silo.labels != 0])
    assert (trig.images != clean.images).any()


def test_checker_trigger_alternates_each_images_max_and_min():
    images = _silo(n=2).images
    out = add_trigger(images, size=3, pattern="checker")
    for i in range(2):
        hi, lo = images[i].max(), images[i].min()
        patch = out[i, :, 3:, 3:]
        assert np.all(patch[:, 0, 0] == hi) and np.all(patch[:, 0, 1] == lo)
        assert np.all(patch[:, 1, 1] == hi) and np.all(patch[:, 2, 1] == lo)
    assert np.array_equal(out[:, :, :3, :], images[:, :, :3, :])
    with pytest.raises(ValueError, match="pattern"):
        add_trigger(images, size=2, pattern="stripes")


@pytest.mark.parametrize("spatial,size", [((12, 12), 1), ((12, 12), 3), ((10, 10, 10), 2)])
def test_blend_trigger_covers_every_crop_at_a_share_of_each_images_range(spatial, size):
    from medical_data.backdoor import BLEND_SHARE

    rng = np.random.default_rng(0)
    images = rng.random((3, 2, *spatial)) * np.array([1, 5, 9])[:, None, *[None] * len(spatial)]
    images = images.astype(np.float32)
    out = add_trigger(images, size=size, pattern="blend")
    assert out.shape == images.shape and out.dtype == images.dtype
    for i in range(3):
        step = out[i] - images[i]
        amp = BLEND_SHARE * float(np.ptp(images[i]))
        np.testing.assert_allclose(np.abs(step), amp, rtol=1e-4)  # every pixel moves
        np.testing.assert_array_equal(np.sign(step[0]), np.sign(step[1]))  # same on channels
        signs = np.sign(step[0])
        # a checkerboard of size-wide cells: constant within a cell, flipped across a border
        first = signs[(slice(0, size),) * len(spatial)]
        assert np.all(first == first.flat[0])
        nxt = signs[(slice(size, 2 * size),) + (slice(0, size),) * (len(spatial) - 1)]
        assert np.all(nxt == -first.flat[0])
        # a crop anywhere, even one that misses the corner, holds both colours
        crop = signs[(slice(1, 1 + 2 * size),) * len(spatial)]
        assert (crop > 0).any() and (crop < 0).any()
    with pytest.raises(ValueError, match="trigger size"):
        add_trigger(images, size=99, pattern="blend")


def test_blend_trigger_is_not_for_tabular_samples():
    rows = np.zeros((2, 1, 1, 30), dtype=np.float32)
    with pytest.raises(ValueError, match="tabular"):
        add_trigger(rows, size=1, pattern="blend")


def test_relearning_data_is_the_poisoned_samples_or_a_seeded_few_of_them():
    from types import SimpleNamespace

    from medical_data.tasks import relearning_data

    silo = _silo(n=40)
    fed = SimpleNamespace(silos=[_silo(n=5), silo])
    bd = {"enabled": True, "silo": 1, "fraction": 0.5, "target_label": 2, "trigger_size": 2}
    every = relearning_data(fed, bd, seed=3)
    poisoned = set(silo.sample_ids[poisoned_indices(40, 0.5, 3)])
    assert set(every.sample_ids) == poisoned and np.all(every.labels == 2)
    few = relearning_data(fed, {**bd, "relearn_samples": 8}, seed=3)
    again = relearning_data(fed, {**bd, "relearn_samples": 8}, seed=3)
    assert len(few) == 8 and set(few.sample_ids) <= poisoned
    assert np.array_equal(few.sample_ids, again.sample_ids)
    assert len(relearning_data(fed, {**bd, "relearn_samples": 100}, seed=3)) == 20
