"""How samples are spread over silos, and how a silo's scanner differs from another's.

- `dirichlet_partition`: label skew. For each class, silo proportions are drawn from
  Dir(alpha) (Hsu et al. 2019, "Measuring the effects of non-identical data distribution");
  small alpha gives few classes per silo, large alpha approaches iid. Redrawn until every
  silo has ``min_per_silo`` samples.
- `natural_partition`: whole groups (axial slices, patients, regions) go to silos as
  contiguous runs, balancing sample counts; with fewer groups than silos a group is split
  into contiguous pieces (e.g. one patient's slices over two silos).
- `iid_partition`: a seeded random even split.
- `apply_site_shift`: a simulated site/scanner: bias field (coil inhomogeneity), gamma
  contrast, Gaussian blur (resolution) and Gaussian noise, each a MONAI intensity transform
  with its own seeded generator. The site's parameters depend only on ``seed``; only the noise
  realisation depends on the images. On one-row "images" of features (a tabular benchmark,
  breast-fna) those image operations mean nothing (a blur would mix unrelated features), so
  the site is a measurement shift instead: a per-feature gain and offset (calibration) and
  Gaussian noise, in the features' standard-deviation units.
"""

from __future__ import annotations

import numpy as np
import torch
from monai.data import get_track_meta, set_track_meta
from monai.transforms import (
    AdjustContrast,
    RandAdjustContrast,
    RandBiasField,
    RandGaussianNoise,
    RandGaussianSmooth,
)

from fedasync import seeds
from fedasync.errors import ConfigError
from medical_data.registry import is_tabular

TABULAR_SHIFT = {"gain": 0.1, "offset": 0.2, "noise_std": 0.1}
"""A tabular site at strength 1: log-gain and offset standard deviations per feature, and the
noise standard deviation, all in the features' standard-deviation units (z-scores)."""


def iid_partition(n: int, num_silos: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Random even split of ``range(n)``: ``num_silos`` sorted int64 index arrays."""
    if num_silos < 1 or num_silos > n:
        raise ConfigError(f"cannot split {n} samples over {num_silos} silos (silos.count)")
    return [np.sort(part) for part in np.array_split(rng.permutation(n), num_silos)]


def dirichlet_partition(
    labels: np.ndarray,
    num_silos: int,
    alpha: float,
    rng: np.random.Generator,
    min_per_silo: int = 2,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Label-skewed split of sample indices.

    Args:
        labels: int, shape ``(N,)``: class (or stratum) per sample.
        alpha: Dirichlet concentration > 0; smaller means more skew.
        min_per_silo: redraw until every silo has at least this many samples.

    Returns ``num_silos`` sorted int64 index arrays, disjoint, covering ``range(N)``.
    """
    labels = np.asarray(labels)
    if alpha <= 0:
        raise ConfigError(f"dirichlet alpha (data.dirichlet_alpha) must be > 0, got {alpha}")
    if num_silos < 1 or num_silos * min_per_silo > len(labels):
        raise ConfigError(
            f"{len(labels)} samples cannot give {num_silos} silos >= {min_per_silo} samples each"
        )
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_silos)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            share = rng.dirichlet(np.full(num_silos, alpha))
            cuts = (np.cumsum(share)[:-1] * len(idx)).astype(int)
            for silo, chunk in enumerate(np.split(idx, cuts)):
                parts[silo].append(chunk)
        out = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(p) for p in out) >= min_per_silo:
            return out
    raise ConfigError(
        f"no Dirichlet(alpha={alpha}) draw in {max_tries} tries gave every one of {num_silos} "
        f"silos >= {min_per_silo} samples; raise data.dirichlet_alpha or lower silos.count"
    )


def _contiguous_cuts(sizes: np.ndarray, k: int) -> list[int]:
    """Cut ``len(sizes)`` >= k ordered items into k non-empty runs minimising the largest sum.

    Returns the k-1 cut positions. Binary search on the capacity with a greedy fill.
    """

    def greedy(cap: int) -> list[int]:
        cuts, load = [], 0
        for i, s in enumerate(sizes):
            if load + s > cap and load > 0:
                cuts.append(i)
                load = 0
            load += s
        return cuts

    lo, hi = int(sizes.max()), int(sizes.sum())
    while lo < hi:
        mid = (lo + hi) // 2
        if len(greedy(mid)) + 1 <= k:
            hi = mid
        else:
            lo = mid + 1
    cuts = greedy(lo)
    while len(cuts) + 1 < k:  # fewer runs than silos: split the largest run of >= 2 items
        bounds = [0, *cuts, len(sizes)]
        runs = [(sizes[a:b].sum(), a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b - a > 1]
        _, a, b = max(runs)
        csum = np.cumsum(sizes[a:b])
        cuts = sorted([*cuts, a + 1 + int(np.argmin(np.abs(csum[:-1] - csum[-1] / 2)))])
    return cuts


def natural_partition(groups: np.ndarray, num_silos: int) -> list[np.ndarray]:
    """Split samples by natural group: whole groups per silo when there are enough.

    Args:
        groups: int, shape ``(N,)``: group per sample; group ids are ordered so that
            neighbouring ids are neighbouring anatomy (slices) or space (regions).

    Returns ``num_silos`` sorted int64 index arrays. With ``G >= num_silos`` groups each silo
    gets a contiguous run of whole groups (balanced sample counts); with ``G < num_silos``
    each group is split into contiguous pieces, proportionally to its size.
    """
    groups = np.asarray(groups)
    if num_silos < 1 or num_silos > len(groups):
        raise ConfigError(
            f"cannot split {len(groups)} samples over {num_silos} silos (silos.count)"
        )
    ids, sizes = np.unique(groups, return_counts=True)
    order = np.argsort(groups, kind="stable")
    if len(ids) >= num_silos:
        bounds = [0, *_contiguous_cuts(sizes, num_silos), len(ids)]
        return [
            np.sort(np.flatnonzero(np.isin(groups, ids[a:b]))).astype(np.int64)
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
    # fewer groups than silos: give each group >= 1 silo, the rest by largest remainder
    pieces = np.ones(len(ids), dtype=int)
    for _ in range(num_silos - len(ids)):
        pieces[np.argmax(np.where(pieces < sizes, sizes / pieces, -np.inf))] += 1
    if (pieces > sizes).any():
        raise ConfigError(
            f"groups of sizes {sizes.tolist()} cannot fill {num_silos} silos; lower silos.count "
            "or use data.partition=iid"
        )
    out = []
    for gid, k in zip(ids, pieces):
        members = order[groups[order] == gid]
        out += [np.sort(p).astype(np.int64) for p in np.array_split(members, k)]
    return out


def apply_site_shift(
    images: np.ndarray, seed: int, strength: float = 1.0
) -> tuple[np.ndarray, dict[str, float]]:
    """Apply one simulated site's acquisition differences to images.

    Args:
        images: float32, shape ``(N, C, H, W)`` or volumes ``(N, C, D, H, W)`` (the blur
            then in 3D too), intensities roughly in ``[0, 1]``; or ``(N, C, 1, F)``
            standardised features (a tabular benchmark: :func:`_tabular_site_shift`).
        seed: identifies the site; the same seed gives the same bias field, gamma and blur,
            and (for the same N) the same noise.
        strength: 0 returns a copy unchanged; 1 is a moderate, visible shift.

    Returns the shifted images, float32, shaped as given, and the site's parameters.
    """
    x = np.ascontiguousarray(images, dtype=np.float32)
    if x.ndim == 4 and is_tabular(x.shape[2:]):
        return _tabular_site_shift(x, seed, strength)
    if strength <= 0 or len(x) == 0:
        return x.copy(), {"gamma": 1.0, "bias": 0.0, "blur_sigma": 0.0, "noise_std": 0.0}
    n, c = x.shape[:2]
    spatial = x.shape[2:]  # (H, W), or (D, H, W) for volumes
    bias = RandBiasField(degree=3, coeff_range=(-0.25 * strength, 0.25 * strength), prob=1.0)
    contrast = RandAdjustContrast(prob=1.0, gamma=(1.0 / (1 + 0.5 * strength), 1 + 0.5 * strength))
    sigma = (0.1, 0.8 * strength)
    if len(spatial) == 3:  # (the draws are the same: MONAI draws a z sigma in 2D too)
        smooth = RandGaussianSmooth(sigma_x=sigma, sigma_y=sigma, sigma_z=sigma, prob=1.0)
    else:
        smooth = RandGaussianSmooth(sigma_x=sigma, sigma_y=sigma, prob=1.0)
    noise = RandGaussianNoise(prob=1.0, mean=0.0, std=0.04 * strength)
    for k, t in enumerate((bias, contrast, smooth, noise)):
        t.set_random_state(seed=(int(seed) * 7919 + k) % (2**32))
    track = get_track_meta()
    set_track_meta(False)
    try:
        field = np.asarray(bias(np.ones((1, *spatial), np.float32)), dtype=np.float32)
        contrast.randomize()
        gamma = float(contrast.gamma_value)
        adjust = AdjustContrast(gamma)
        flat = torch.from_numpy(x.reshape(n * c, 1, *spatial))
        # MONAI types a transform's output as ndarray | Tensor; a Tensor in gives a Tensor out
        out = torch.stack([adjust(img) for img in flat])  # type: ignore[misc]  # per image, as MONAI does
        out = out.reshape(n * c, *spatial) * torch.from_numpy(field)
        smooth.randomize()
        shifted = noise(smooth(out, randomize=False))
    finally:
        set_track_meta(track)
    params = {
        "gamma": round(gamma, 3),
        "bias": round(float(np.abs(np.log(field)).mean()), 3),
        "blur_sigma": round(float(smooth.x), 3),
        "noise_std": round(float(noise.noise.std()) if noise.noise is not None else 0.0, 3),
    }
    return np.asarray(shifted, dtype=np.float32).reshape(x.shape), params


def _tabular_site_shift(
    x: np.ndarray, seed: int, strength: float
) -> tuple[np.ndarray, dict[str, float]]:
    """One site's measurement shift of standardised features ``x (N, C, 1, F)``.

    Each feature is scaled by its own gain ``exp(g)``, ``g ~ N(0, 0.1 s)``, and shifted by its
    own offset ``N(0, 0.2 s)`` (a site whose segmentation and measurement of the image is
    calibrated differently), then Gaussian noise of standard deviation ``0.1 s`` is added
    (``s`` = ``strength``, `TABULAR_SHIFT`). Gains and offsets depend only on ``seed``.
    Parameters: the mean ``|g|``, the mean ``|offset|`` and the noise standard deviation.
    """
    zero = {"gain": 0.0, "offset": 0.0, "noise_std": 0.0}
    if strength <= 0 or len(x) == 0:
        return x.copy(), zero
    site = seeds.rng(int(seed) % (2**32), "site.shift")
    shape = (1, *x.shape[1:])
    log_gain = site.normal(0.0, TABULAR_SHIFT["gain"] * strength, size=shape)
    offset = site.normal(0.0, TABULAR_SHIFT["offset"] * strength, size=shape)
    noise_std = TABULAR_SHIFT["noise_std"] * strength
    noise = np.random.default_rng(  # the site stream, one more word: its noise
        [*seeds.entropy(int(seed) % (2**32), "site.shift"), len(x)]
    ).normal(0.0, noise_std, size=x.shape)
    out = (x * np.exp(log_gain) + offset + noise).astype(np.float32)
    params = {
        "gain": round(float(np.abs(log_gain).mean()), 3),
        "offset": round(float(np.abs(offset).mean()), 3),
        "noise_std": round(noise_std, 3),
    }
    return out, params
