"""The pooled, unpartitioned form every loader returns, and shared array helpers.

A loader (offline: `medical_data.offline`, online: `medical_data.online`) returns one
`RawData`: all samples of a benchmark, each with a natural group (slab, patient, region) and a
stratification key. `medical_data.federation` then partitions it into silos.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class RawData:
    """All samples of one benchmark before partitioning."""

    images: np.ndarray
    """float32, shape ``(N, C, H, W)``, intensities roughly in ``[0, 1]`` (a tabular benchmark:
    ``(N, 1, 1, F)`` z-scores)."""
    labels: np.ndarray
    """int64, ``(N,)`` (classification) or ``(N, H, W)`` (segmentation)."""
    groups: np.ndarray
    """int64, ``(N,)``: natural group (slice, patient, region), ordered so that neighbouring
    group ids are neighbouring anatomy/space."""
    sample_ids: np.ndarray
    """str, ``(N,)``: globally unique and stable ids, e.g. ``"brain-tissue/z071/x045y102"``."""
    strata: np.ndarray
    """int64, ``(N,)``: key for stratified splits and Dirichlet skew (class label, or
    "contains foreground" for segmentation)."""
    info: dict[str, object] = field(default_factory=dict)
    """Source, licence and anything a table should show."""
    is_test: np.ndarray | None = None
    """bool ``(N,)`` when the source has an official test split, else None."""

    def __post_init__(self) -> None:
        n = len(self.images)
        for name in ("labels", "groups", "sample_ids", "strata"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"RawData.{name} has {len(getattr(self, name))} rows, not {n}")
        if len(set(self.sample_ids.tolist())) != n:
            raise ValueError("RawData.sample_ids are not unique")

    def subset(self, idx: np.ndarray) -> RawData:
        """Rows ``idx`` (any integer index array) as a new RawData."""
        return RawData(
            images=self.images[idx],
            labels=self.labels[idx],
            groups=self.groups[idx],
            sample_ids=self.sample_ids[idx],
            strata=self.strata[idx],
            info=self.info,
            is_test=None if self.is_test is None else self.is_test[idx],
        )


def robust_unit(x: np.ndarray, low_pct: float = 0.5, high_pct: float = 99.5) -> np.ndarray:
    """Map percentiles ``[low_pct, high_pct]`` of ``x`` to ``[0, 1]`` and clip; float32."""
    lo, hi = np.percentile(x, [low_pct, high_pct])
    return np.clip((x - lo) / max(float(hi - lo), 1e-6), 0.0, 1.0).astype(np.float32)


def pad_square(x: np.ndarray, value: float) -> np.ndarray:
    """Pad the last two axes of ``x`` symmetrically to a square with ``value``."""
    h, w = x.shape[-2:]
    s = max(h, w)
    pads = [(0, 0)] * (x.ndim - 2) + [((s - h) // 2, s - h - (s - h) // 2)]
    pads += [((s - w) // 2, s - w - (s - w) // 2)]
    return np.pad(x, pads, constant_values=value)


def resize_images(x: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Area/bilinear resize of float images ``(N, C, H, W)`` to ``(N, C, *size)``."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    mode = "area" if x.shape[-1] >= size[-1] else "bilinear"
    kwargs = {} if mode == "area" else {"align_corners": False}
    return F.interpolate(t, size=size, mode=mode, **kwargs).numpy()


def resize_masks(y: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Nearest-neighbour resize of integer masks ``(N, H, W)`` to ``(N, *size)``; int64."""
    t = torch.from_numpy(np.ascontiguousarray(y, dtype=np.float32))[:, None]
    return F.interpolate(t, size=size, mode="nearest").numpy()[:, 0].astype(np.int64)
