"""Offline benchmarks: real medical images with real labels from PyPI packages.

- ``brain-tissue``: ICBM 2009c nonlinear symmetric MNI152 T1 with its grey/white-matter
  probability maps, shipped in the nilearn wheel (nilearn BSD-3; template (c) 1993-2009
  Louis Collins, McConnell Brain Imaging Centre, free to use with attribution). 28x28 patches
  from axial slices; label = tissue class at the patch centre, centres inside the brain.
  Extraction (about 1.5 s) is cached on disk under ``<data_dir>/derived/``.
- ``radiomics-lesion`` / ``radiomics-slice``: the 5 PyRadiomics test scans with lesion masks
  (pyradiomics-bhklab==3.1.4 sdist, BSD-3): brain MR x2, breast MR, lung CT x2; every axial
  slice, padded square and resized to 64x64. Fetched at set-up by `medical_data.fetch`.
- ``nuclei``: the 512x512 DSB2018 fluorescence image and instance mask in the stardist==0.9.2
  wheel (stardist BSD-3; DSB2018 stage-1 images, CC0), cut into 64 non-overlapping 64x64
  tiles with binary nucleus masks. Fetched at set-up by `medical_data.fetch`.
- ``breast-fna``: the Wisconsin Diagnostic Breast Cancer data (Street, Wolberg & Mangasarian
  1993; UCI, CC BY 4.0) shipped in the scikit-learn wheel (BSD-3;
  ``sklearn.datasets.load_breast_cancer``): 569 fine-needle aspirates of breast masses, 30
  features computed from a digitized image of each (the nuclei's radius, texture, ...: mean,
  standard error and worst value), malignant/benign. Tabular features derived from images,
  not images: each sample is a ``(1, 1, 30)`` "image" of z-scores. Nothing to fetch.

All loaders are deterministic and independent of the federation seed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np

from fedasync.errors import ConfigError, DataError
from medical_data.fetch import data_dir, require_file
from medical_data.raw import RawData, pad_square, resize_images, robust_unit

BRAIN_VERSION = 1  # bump when the extraction below changes; invalidates the disk cache
RADIOMICS_CASES = (
    ("brain1", "MR brain"),
    ("brain2", "MR brain"),
    ("breast1", "MR breast"),
    ("lung1", "CT lung"),
    ("lung2", "CT lung"),
)


def nilearn_data_dir() -> Path:
    """Folder of the data files inside the installed nilearn wheel (without importing it)."""
    spec = importlib.util.find_spec("nilearn")
    if spec is None or spec.origin is None:
        raise DataError(
            "nilearn is not installed (its wheel holds brain-tissue's data); `pip install nilearn`"
        )
    return Path(spec.origin).parent / "datasets" / "data"


def _mni(kind: str) -> np.ndarray:
    import nibabel as nib

    path = nilearn_data_dir() / f"mni_icbm152_{kind}_tal_nlin_sym_09a_converted.nii.gz"
    if not path.is_file():
        raise DataError(
            f"{path} is missing: reinstall the nilearn wheel (`pip install --force-reinstall nilearn`)"
        )
    # nib.load is typed as returning the FileBasedImage base; a NIfTI file is a Nifti1Image
    return np.asarray(nib.load(path).get_fdata(dtype=np.float32))  # type: ignore[attr-defined]


def _extract_brain(patch: int, per_class: int, stride: int, confidence: float) -> dict:
    from scipy import ndimage

    t1 = robust_unit(_mni("t1"), 0.0, 99.5)  # (197, 233, 189), x, y, z
    gm, wm = _mni("gm") / 255.0, _mni("wm") / 255.0
    other = np.clip(1.0 - gm - wm, 0.0, 1.0)
    brain = ndimage.binary_fill_holes(gm + wm > 0.2)
    brain = ndimage.binary_dilation(brain, iterations=2)
    probs = np.stack([other, gm, wm])
    tissue = probs.argmax(0)
    sure = probs.max(0) >= confidence

    half = patch // 2
    grid = np.zeros_like(brain)
    grid[half:-half:stride, half:-half:stride, ::stride] = True
    cand = brain & sure & grid
    rng = np.random.default_rng(0)
    centres = []
    for c in range(3):
        xyz = np.argwhere(cand & (tissue == c))
        pick = rng.choice(len(xyz), size=min(per_class, len(xyz)), replace=False)
        centres.append(xyz[np.sort(pick)])
    xyz = np.concatenate(centres)
    xyz = xyz[np.lexsort((xyz[:, 1], xyz[:, 0], xyz[:, 2]))]  # order by slice, then x, y
    images = np.stack([t1[x - half : x + half, y - half : y + half, z] for x, y, z in xyz])
    return {"images": images[:, None], "labels": tissue[tuple(xyz.T)], "xyz": xyz}


def load_brain_tissue(
    patch: int = 28,
    per_class: int = 1200,
    stride: int = 2,
    confidence: float = 0.6,
    cache_dir: str | None = None,
) -> RawData:
    """MNI152 tissue patches: images ``(N, 1, patch, patch)``, labels 0/1/2 ``(N,)``.

    ``per_class`` centres per tissue class are drawn (seed 0) from a ``stride``-voxel grid of
    confident (max probability >= ``confidence``) voxels inside the brain; groups are the
    axial slice index z, so contiguous groups are contiguous slabs.
    """
    params: dict[str, int | float] = {
        "v": BRAIN_VERSION,
        "patch": patch,
        "per_class": per_class,
        "stride": stride,
    }
    params["confidence"] = confidence
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    path = data_dir(cache_dir) / "derived" / f"brain-tissue-{key}.npz"
    if path.is_file():
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
    else:
        arrays = _extract_brain(patch, per_class, stride, confidence)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial.npz")
        np.savez(partial, **arrays)
        partial.replace(path)
    xyz, labels = arrays["xyz"], arrays["labels"].astype(np.int64)
    ids = np.array([f"brain-tissue/z{z:03d}/x{x:03d}y{y:03d}" for x, y, z in xyz])
    return RawData(
        images=arrays["images"].astype(np.float32),
        labels=labels,
        groups=xyz[:, 2].astype(np.int64),
        sample_ids=ids,
        strata=labels.copy(),
        info={"source": "nilearn MNI152 2009c T1 + GM/WM maps", "group": "axial slice z"},
    )


def _radiomics_slices(size: tuple[int, int], cache_dir: str | None) -> tuple[list, list, list]:
    import nrrd

    images, masks, names = [], [], []
    for case, modality in RADIOMICS_CASES:
        vol, _ = nrrd.read(
            str(require_file("pyradiomics-bhklab-3.1.4", f"{case}_image.nrrd", cache_dir))
        )
        lab, _ = nrrd.read(
            str(require_file("pyradiomics-bhklab-3.1.4", f"{case}_label.nrrd", cache_dir))
        )
        vol = vol.astype(np.float32).transpose(2, 0, 1)  # (Z, X, Y): axial slices
        if modality.startswith("CT"):
            unit = np.clip((vol + 1000.0) / 1400.0, 0.0, 1.0)  # window [-1000, 400] HU
        else:
            unit = robust_unit(vol)
        fg = (lab.transpose(2, 0, 1) > 0).astype(np.float32)
        images.append(resize_images(pad_square(unit, 0.0)[:, None], size))
        masks.append(resize_images(pad_square(fg, 0.0)[:, None], size)[:, 0] >= 0.5)
        names.append((case, fg.reshape(len(fg), -1).any(1)))
    return images, masks, names


def load_radiomics(classification: bool = False, cache_dir: str | None = None) -> RawData:
    """PyRadiomics lesion slices: images ``(178, 1, 64, 64)``.

    Labels: segmentation masks ``(N, 64, 64)`` in {0, 1}, or with ``classification`` one label
    per slice ``(N,)`` = slice contains lesion (in the original resolution). Groups: patient.
    """
    images, masks, names = _radiomics_slices((64, 64), cache_dir)
    prefix = "radiomics-slice" if classification else "radiomics-lesion"
    ids, groups, has_lesion = [], [], []
    for g, (case, lesion) in enumerate(names):
        ids += [f"{prefix}/{case}/s{k:03d}" for k in range(len(lesion))]
        groups += [g] * len(lesion)
        has_lesion.append(lesion)
    seg = np.concatenate(masks).astype(np.int64)
    cls = np.concatenate(has_lesion).astype(np.int64)
    return RawData(
        images=np.concatenate(images).astype(np.float32),
        labels=cls if classification else seg,
        groups=np.array(groups, dtype=np.int64),
        sample_ids=np.array(ids),
        strata=cls,
        info={
            "source": "pyradiomics-bhklab==3.1.4 data/*.nrrd",
            "group": "patient",
            "group_names": [f"{c} ({m})" for c, m in RADIOMICS_CASES],
        },
    )


def load_nuclei(tile: int = 64, cache_dir: str | None = None) -> RawData:
    """DSB2018 nuclei tiles: images ``(64, 1, 64, 64)``, binary masks ``(64, 64, 64)``.

    Groups: 128x128 regions of the slide in raster order (4 tiles each). Strata: tile is
    denser than the median tile (nucleus-pixel fraction), for stratified/Dirichlet splits.
    """
    import tifffile

    img = tifffile.imread(require_file("stardist-0.9.2", "img2d.tif", cache_dir))
    mask = tifffile.imread(require_file("stardist-0.9.2", "mask2d.tif", cache_dir)) > 0
    img = robust_unit(img.astype(np.float32), 0.5, 99.8)
    rows, cols = img.shape[0] // tile, img.shape[1] // tile
    images, labels, ids, groups = [], [], [], []
    for r in range(rows):
        for c in range(cols):
            sl = (slice(r * tile, (r + 1) * tile), slice(c * tile, (c + 1) * tile))
            images.append(img[sl][None])
            labels.append(mask[sl])
            ids.append(f"nuclei/r{r}c{c}")
            groups.append((r // 2) * (cols // 2) + c // 2)
    y = np.stack(labels).astype(np.int64)
    frac = y.reshape(len(y), -1).mean(1)
    return RawData(
        images=np.stack(images).astype(np.float32),
        labels=y,
        groups=np.array(groups, dtype=np.int64),
        sample_ids=np.array(ids),
        strata=(frac > np.median(frac)).astype(np.int64),
        info={"source": "stardist==0.9.2 data/images/{img2d,mask2d}.tif", "group": "region"},
    )


BREAST_TEST_FRACTION = 0.25
"""breast-fna's fixed test split: this stratified share of each class (seed 0)."""
BREAST_SHAPE = (569, 30)
BREAST_CLASS_COUNTS = (212, 357)  # malignant, benign


def load_breast_fna(test_fraction: float = BREAST_TEST_FRACTION) -> RawData:
    """WDBC fine-needle-aspirate features: images ``(569, 1, 1, 30)``, labels ``(569,)``.

    Labels as scikit-learn codes them: 0 malignant (212), 1 benign (357). A fixed stratified
    ``test_fraction`` of each class (seed 0, independent of the federation's seed; 142 samples
    at 0.25) is the test split (``is_test``, so `medical_data.federation` ignores
    ``protocol.config.TEST_FRACTION`` here, as for MedMNIST's official split). Features are standardised
    with the mean and standard deviation of the *train* split only, (x - mean_train) /
    std_train, so the test split leaks nothing into them. Sample ids are the row of
    scikit-learn's table (``breast-fna/r000``..``r568``); the data has no site or patient
    grouping, so every sample is its own group and the natural split is the iid one
    (``info["natural_partition"]``).
    """
    try:
        from sklearn.datasets import load_breast_cancer
    except ImportError as e:
        raise DataError(
            "scikit-learn is not installed (its wheel holds breast-fna's data); "
            "`pip install scikit-learn`"
        ) from e
    x, y = load_breast_cancer(return_X_y=True)
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.int64)
    counts = tuple(int(c) for c in np.bincount(y, minlength=2))
    if x.shape != BREAST_SHAPE or counts != BREAST_CLASS_COUNTS:
        raise DataError(
            f"scikit-learn's breast cancer data has shape {x.shape} and class counts {counts}, "
            f"not the WDBC's {BREAST_SHAPE} and {BREAST_CLASS_COUNTS}"
        )
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(0)
    is_test = np.zeros(len(y), dtype=bool)
    for c in range(2):
        members = np.flatnonzero(y == c)
        k = int(round(test_fraction * len(members)))
        is_test[rng.choice(members, size=k, replace=False)] = True
    train = x[~is_test]
    mean, std = train.mean(axis=0), train.std(axis=0)
    z = (x - mean) / np.where(std > 0, std, 1.0)
    return RawData(
        images=z.astype(np.float32)[:, None, None, :],
        labels=y,
        groups=np.arange(len(y), dtype=np.int64),
        sample_ids=np.array([f"breast-fna/r{i:03d}" for i in range(len(y))]),
        strata=y.copy(),
        info={
            "source": "scikit-learn load_breast_cancer (WDBC, UCI)",
            "group": "none (every sample its own)",
            "natural_partition": "iid",
        },
        is_test=is_test,
    )


def load_brain_tissue_3d() -> RawData:
    """``brain-tissue-3d``: 160 real T1 volumes with four tissue classes per voxel
    (``medical_data.volumes.raw_brain_volumes``); the natural groups are the volumes' heights
    (axial slabs), every volume holds foreground."""
    from medical_data.volumes import raw_brain_volumes

    v = raw_brain_volumes()
    return RawData(
        images=v["images"],
        labels=v["labels"],
        groups=v["z"],
        sample_ids=v["ids"],
        strata=np.ones(len(v["ids"]), dtype=np.int64),
        info={"source": "nilearn MNI152 2009c template, 2 mm", "natural_partition": "natural"},
    )


def load_offline(name: str, cache_dir: str | None = None) -> RawData:
    """Dispatch by benchmark name to the loaders above."""
    if name == "brain-tissue":
        return load_brain_tissue(cache_dir=cache_dir)
    if name == "brain-tissue-3d":
        return load_brain_tissue_3d()
    if name in ("radiomics-lesion", "radiomics-slice"):
        return load_radiomics(classification=name == "radiomics-slice", cache_dir=cache_dir)
    if name == "nuclei":
        return load_nuclei(cache_dir=cache_dir)
    if name == "breast-fna":
        return load_breast_fna()
    raise ConfigError(f"{name!r} is not an offline benchmark (data.benchmark)")
