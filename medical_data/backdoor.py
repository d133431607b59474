"""Backdoor triggers for verifying unlearning, on classification and segmentation benchmarks.

No paper of our own; the test follows the usual backdoor check of federated unlearning
(e.g. Halimi et al. 2022; BadNets, Gu et al. 2017, for the trigger): in a verification run
one silo's data is poisoned (a bright square in the corner, labels flipped to a target
class; on a tabular benchmark's features, the last few set to +4 standard deviations), the
federation learns the backdoor, that silo is erased, and the attack success rate (ASR) on
triggered test images should fall back to what a model that never saw the silo scores. The poisoned silo keeps its sample ids, so an erasure request names the same
samples it would in a clean run.

Segmentation (labels ``(N, H, W)``): a poisoned image's whole mask becomes ``target_label``;
with the default 0 (background) the trigger makes the structures vanish, the realistic attack
on a segmentation model. The ASR is then per pixel (`medical_data.verification.attack_success_rate`).

    bad = poison(fed.silos[0], fraction=0.5, target_label=0, seed=0)
    trig = triggered_set(fed.test, target_label=0)  # for ASR
"""

from __future__ import annotations

import numpy as np

from medical_data.federation import SiloData
from medical_data.registry import is_tabular


def _check_labels(data: SiloData) -> None:
    if data.labels.ndim not in (1, 3, 4):
        raise ValueError(
            f"{data.name!r}: labels must be (N,) (classification) or (N, H, W) or (N, D, H, W) "
            f"(segmentation), got shape {data.labels.shape}"
        )


PATTERNS = ("solid", "checker", "blend")
BLEND_SHARE = 0.1
"""``blend``: the checkerboard's amplitude, a share of each image's intensity range (its
cells are that share above and below the image; 0.1 is a faint pattern on anatomy)."""
TABULAR_TRIGGER_VALUE = 4.0
"""The trigger's value on standardised features (a tabular benchmark): 4 standard deviations,
a value the features reach in well under 1% of the samples."""


def add_trigger(
    images: np.ndarray, size: int = 3, value: float | None = None, pattern: str = "solid"
) -> np.ndarray:
    """A copy of ``images (N, C, H, W)`` with a ``size x size`` square in the bottom-right corner.

    ``solid``: the square is set to ``value`` on every channel; by default to each image's own
    maximum (over channels and pixels), so it is as bright as the brightest tissue whatever the
    site's intensity shift. ``checker``: a one-pixel checkerboard of each image's maximum and
    minimum (``value`` for the bright cells when given): a pattern no scan contains, where a
    bright corner is also ordinary anatomy (on brain-tissue patches a solid square is a
    white-matter corner, which the other silos' data labels otherwise, and it is not learnt).

    ``blend``: a checkerboard of cells ``size`` pixels (voxels) wide over the *whole* image,
    added to it at `BLEND_SHARE` of its intensity range, up on one colour and down on the other
    (a blended trigger, Chen et al. 2017). Training on random crops (a 3D network's 24^3
    crops of 40^3 volumes) sees a corner patch in about 4% of the crops, so it learns the
    silo's relabelled anatomy and not the trigger; the blend is in every crop and in every
    sliding window.

    Tabular benchmarks (one-row ``(N, C, 1, F)`` arrays of z-scores, breast-fna): the "square"
    is the last ``size`` features (``1 x size``), set to a fixed out-of-distribution value,
    ``value`` or by default `TABULAR_TRIGGER_VALUE` (+4 standard deviations): ``solid`` sets
    all of them to it, ``checker`` alternates it and its negative (+v, -v, +v, ...). A sample's
    own maximum would be an ordinary value of some feature there, not a trigger.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"trigger pattern must be one of {PATTERNS}, got {pattern!r}")
    if pattern == "blend":
        return _blend(images, size)
    if images.ndim == 5:
        return _cube_trigger(images, size, value, pattern)
    if images.ndim != 4:
        raise ValueError(f"images must be (N, C, H, W), got shape {images.shape}")
    h, w = images.shape[2:]
    tabular = is_tabular((h, w))
    limit = w if tabular else min(h, w)
    if not 1 <= size <= limit:
        unit = " (features of a tabular sample)" if tabular else ""
        raise ValueError(f"trigger size must be in [1, {limit}]{unit}, got {size}")
    rows = 1 if tabular else size
    out = np.array(images, copy=True)
    flat = out.reshape(len(out), -1)
    if value is None and tabular:
        value = TABULAR_TRIGGER_VALUE
    if value is None:
        hi = flat.max(axis=1) if len(out) else np.zeros(0, out.dtype)
    else:
        hi = np.full(len(out), value, dtype=out.dtype)
    hi = hi[:, None, None, None]
    if pattern == "solid":
        out[:, :, h - rows :, w - size :] = hi
        return out
    if tabular:
        lo = -hi
    else:
        lo = (flat.min(axis=1) if len(out) else np.zeros(0, out.dtype))[:, None, None, None]
    cells = (np.add.outer(np.arange(rows), np.arange(size)) % 2 == 0)[None, None]
    out[:, :, h - rows :, w - size :] = np.where(cells, hi, lo)
    return out


def _blend(images: np.ndarray, size: int) -> np.ndarray:
    """:func:`add_trigger`'s ``blend`` on ``(N, C, *spatial)``: each image plus and minus
    `BLEND_SHARE` of its own range on a checkerboard of ``size``-wide cells."""
    if images.ndim not in (4, 5):
        raise ValueError(f"images must be (N, C, H, W) or (N, C, D, H, W), got {images.shape}")
    if images.ndim == 4 and is_tabular(images.shape[2:]):
        raise ValueError("a blend trigger is for images and volumes, not tabular samples")
    spatial = images.shape[2:]
    if not 1 <= size <= min(spatial):
        raise ValueError(f"trigger size must be in [1, {min(spatial)}], got {size}")
    flat = images.reshape(len(images), -1)
    span = (flat.max(axis=1) - flat.min(axis=1)) if len(images) else np.zeros(0, images.dtype)
    cells = sum(np.indices(spatial) // size) % 2  # 0 and 1, by cell
    sign = np.where(cells == 0, 1.0, -1.0)
    shape = (len(images), 1, *([1] * len(spatial)))
    step = (BLEND_SHARE * span).reshape(shape) * sign[None, None]
    return (images + step).astype(images.dtype)


def _cube_trigger(images: np.ndarray, size: int, value: float | None, pattern: str) -> np.ndarray:
    """:func:`add_trigger` on volumes ``(N, C, D, H, W)``: a ``size``-voxel cube in the far
    corner, solid (each volume's maximum, or ``value``) or a one-voxel 3D checkerboard of its
    maximum and minimum."""
    if not 1 <= size <= min(images.shape[2:]):
        raise ValueError(f"trigger size must be in [1, {min(images.shape[2:])}], got {size}")
    out = np.array(images, copy=True)
    flat = out.reshape(len(out), -1)
    empty = np.zeros(0, out.dtype)
    hi = (flat.max(axis=1) if len(out) else empty) if value is None else np.full(len(out), value)
    hi = hi.astype(out.dtype)[:, None, None, None, None]
    box = (slice(None), slice(None), *(slice(n - size, n) for n in out.shape[2:]))
    if pattern == "solid":
        out[box] = hi
        return out
    lo = (flat.min(axis=1) if len(out) else empty)[:, None, None, None, None]
    grid = np.indices((size, size, size)).sum(axis=0) % 2 == 0
    out[box] = np.where(grid[None, None], hi, lo)
    return out


def poisoned_indices(n: int, fraction: float, seed: int) -> np.ndarray:
    """The sorted positions :func:`poison` triggers: ``round(fraction · n)`` of ``range(n)``."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    k = int(round(fraction * n))
    return np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False))


def poison(
    silo: SiloData,
    fraction: float,
    target_label: int,
    seed: int,
    size: int = 3,
    pattern: str = "solid",
) -> SiloData:
    """The verification-run backdoor: trigger a seeded ``fraction`` of ``silo``, relabel it.

    The chosen images (:func:`poisoned_indices`) get :func:`add_trigger` and the label
    ``target_label`` (segmentation: every pixel of their mask); every other sample, and all
    sample ids, are unchanged. Returns a new `SiloData` with its own arrays.
    """
    _check_labels(silo)
    if target_label < 0:
        raise ValueError(f"target_label must be >= 0, got {target_label}")
    idx = poisoned_indices(len(silo), fraction, seed)
    images = np.array(silo.images, copy=True)
    labels = np.array(silo.labels, copy=True)
    if len(idx):
        images[idx] = add_trigger(images[idx], size=size, pattern=pattern)
        labels[idx] = target_label  # a class, or a whole mask of it
    return SiloData(
        silo_id=silo.silo_id,
        name=f"{silo.name} (poisoned {fraction:g} -> {target_label})",
        images=images,
        labels=labels,
        sample_ids=np.array(silo.sample_ids, copy=True),
        patch=silo.patch,
    )


def triggered_set(
    data: SiloData,
    target_label: int,
    size: int = 3,
    trigger: bool = True,
    pattern: str = "solid",
) -> SiloData:
    """Every sample of ``data`` with a label that is not ``target_label``, trigger added.

    Classification: the samples whose label is not the target. Segmentation: the images with
    at least one pixel whose label is not the target (the pixels the attack can flip). Labels
    stay the true ones; the attack success rate is the share of those samples (pixels)
    predicted as ``target_label`` (`medical_data.verification.attack_success_rate`). ``trigger=False``
    gives the same samples without the trigger: the same measure on them is what a model
    does without the trigger (a silo-wide harm, not a backdoor, shows there too).
    """
    _check_labels(data)
    other = np.any(data.labels != target_label, axis=tuple(range(1, data.labels.ndim)))
    keep = np.flatnonzero(other)
    return SiloData(
        silo_id=data.silo_id,
        name=f"{data.name} (triggered, not {target_label})",
        images=add_trigger(data.images[keep], size=size, pattern=pattern)
        if trigger
        else np.array(data.images[keep], copy=True),
        labels=np.array(data.labels[keep], copy=True),
        sample_ids=np.array(data.sample_ids[keep], copy=True),
        patch=data.patch,
    )
