"""A hospital's own data: a datalist in MONAI's Decathlon format, read only where it lives.

In deployment a silo brings its data as the JSON file MONAI users already have
(``monai.data.load_decathlon_datalist``; the Medical Segmentation Decathlon's
``dataset.json``)::

    {"training":   [{"image": "imagesTr/case_001.nii.gz", "label": "labelsTr/case_001.nii.gz"},
                    {"image": "img/0001.png", "label": 2, "id": "opaque-id-0001"}, ...],
     "validation": [...],                       # optional: what the silo evaluates on
     "intensity":  "auto"}                      # optional: "auto" (default) or "as-stored"

Paths are relative to the datalist's folder (or absolute). ``image`` is one file or a list of
files (one channel each); ``label`` is a mask file for segmentation benchmarks and an integer
class for classification ones. Every file is read with MONAI's ``LoadImage`` (NIfTI, NRRD,
PNG/JPEG, NumPy...). What the run's benchmark says (``medical_data.registry``: task, channels,
classes, image size) is what the files must fit; nothing is taken from the coordinator.

- A 2D image is one sample; a 3D volume gives one sample per slice along its last axis (as
  the ``decathlon`` benchmark slices axially). Images of another size than the benchmark's
  are padded square and resized (area/bilinear; masks nearest-neighbour), as its loaders do.
- Intensities (a tabular benchmark's feature vectors, breast-fna: ``"as-stored"`` only):
  ``"auto"`` maps 8-bit images to [0, 1] by /255 and anything else per image (per
  volume for 3D) from its 0.5-99.5 percentiles to [0, 1], as the benchmark loaders do;
  ``"as-stored"`` keeps the values (what :func:`write_datalist` writes: already in [0, 1]).
- Sample ids: the entry's ``id`` when it has one, else the image path relative to the
  datalist's folder; a volume's slices are ``<id>/s<k>`` (k: three digits). They must be
  unique. Erasure requests name them; the coordinator sees them only as salted digests
  (``protocol.ids``), so ids that must stay secret should be opaque (e.g. an ``id`` UUID).

Every problem is a ``DataError`` naming the datalist, the list, the entry and what is wrong.
:func:`write_datalist` writes a ``SiloData`` (a benchmark silo, or its pooled test set) as
NIfTI files and a datalist, for tests and for a coordinator's held-out set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from fedasync.errors import DataError
from medical_data.federation import SiloData
from medical_data.raw import pad_square, resize_images, resize_masks, robust_unit
from medical_data.registry import BenchmarkSpec, is_tabular

INTENSITIES = ("auto", "as-stored")
"""How a datalist's intensities become [0, 1] (its top-level ``intensity`` key)."""
MAX_ENTRIES = 1_000_000
"""The most entries one list may hold (a bound on what a silo reads, not a target)."""


def _fail(where: str, what: str) -> DataError:
    return DataError(f"{where}: {what}")


def _load(path: str) -> np.ndarray:
    """The file at ``path``, channel first, in its stored dtype (MONAI ``LoadImage``)."""
    from monai.transforms import LoadImage

    return np.asarray(LoadImage(image_only=True, ensure_channel_first=True, dtype=None)(path))


def _unit(x: np.ndarray, intensity: str) -> np.ndarray:
    """``x`` (one image or volume, channel first) on [0, 1] as ``intensity`` says; float32."""
    if intensity == "as-stored":
        return x.astype(np.float32)
    if x.dtype == np.uint8:
        return x.astype(np.float32) / 255.0
    return np.stack([robust_unit(c.astype(np.float32)) for c in x])


def _slices(x: np.ndarray) -> np.ndarray:
    """``(C, H, W)`` -> ``(1, C, H, W)``; a volume ``(C, H, W, D)`` -> ``(D, C, H, W)``."""
    return x[None] if x.ndim == 3 else np.moveaxis(x, 3, 0)


def _entry_id(raw: Any, image: Any, base: Path, where: str) -> str:
    if isinstance(raw, dict) and "id" in raw:
        if not isinstance(raw["id"], str | int) or not str(raw["id"]):
            raise _fail(where, "'id' must be a non-empty string")
        return str(raw["id"])
    first = image[0] if isinstance(image, list) else image
    rel = os.path.relpath(str(first), base)
    return Path(rel).as_posix()


def _class_label(value: Any, spec: BenchmarkSpec, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise _fail(where, f"'label' must be an integer class for {spec.name}, got {value!r}"[:300])
    if not 0 <= int(value) < spec.num_classes:
        raise _fail(
            where, f"label {int(value)} is not a class of {spec.name} (0..{spec.num_classes - 1})"
        )
    return int(value)


def _read_entry(
    item: dict[str, Any], raw: Any, spec: BenchmarkSpec, intensity: str, base: Path, where: str
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(images ``(n, C, H, W)``, labels, ids) of one entry."""
    if "image" not in item:
        raise _fail(where, "no 'image'")
    if "label" not in item:
        raise _fail(where, "no 'label'")
    image = item["image"]
    sid = _entry_id(raw, image, base, where)
    try:
        files = image if isinstance(image, list) else [image]
        x = np.concatenate([_load(str(f)) for f in files]) if len(files) > 1 else _load(str(image))
    except Exception as e:  # noqa: BLE001 - any reader failure names the entry
        raise _fail(where, f"cannot read image {image!r}: {e}"[:400]) from e
    if x.ndim not in (3, 4):
        raise _fail(where, f"image has shape {tuple(x.shape)}: 2D or 3D images only")
    if x.shape[0] != spec.in_channels:
        raise _fail(
            where, f"image has {x.shape[0]} channel(s), {spec.name} needs {spec.in_channels}"
        )
    seg = spec.task == "segmentation"
    if seg:
        try:
            y = _load(str(item["label"]))
        except Exception as e:  # noqa: BLE001
            raise _fail(where, f"cannot read label {item['label']!r}: {e}"[:400]) from e
        if y.shape[0] != 1 or y.shape[1:] != x.shape[1:]:
            raise _fail(
                where,
                f"label has shape {tuple(y.shape[1:])}, the image {tuple(x.shape[1:])} "
                "(one channel, the same size)",
            )
        if not np.array_equal(y, np.round(y)) or y.min() < 0 or y.max() >= spec.num_classes:
            raise _fail(
                where,
                f"label values must be integers in 0..{spec.num_classes - 1} for {spec.name}",
            )
        masks = _slices(y.astype(np.int64))[:, 0]  # (n, H, W)
    else:
        if x.ndim == 4:
            raise _fail(where, f"a 3D volume, but {spec.name} classifies 2D images")
        label = _class_label(item["label"], spec, where)
    images = _slices(_unit(x, intensity))
    size = tuple(spec.image_size)
    if tuple(images.shape[2:]) != size and is_tabular(size):
        raise _fail(where, f"has {images.shape[2:]} values, {spec.name} needs {size} features")
    if tuple(images.shape[2:]) != size:  # padded square (as the benchmark loaders), resized
        images = resize_images(pad_square(images, 0.0), size)  # type: ignore[arg-type]
        if seg:
            masks = resize_masks(pad_square(masks, 0), size)  # type: ignore[arg-type]
    labels = masks if seg else np.full(len(images), label, dtype=np.int64)
    ids = [sid] if x.ndim == 3 else [f"{sid}/s{k:03d}" for k in range(len(images))]
    return images.astype(np.float32), labels, ids


def load_datalist(
    path: str | os.PathLike[str], spec: BenchmarkSpec, key: str = "training", *, silo: int = 0
) -> SiloData:
    """The ``key`` list of the Decathlon datalist at ``path`` as one ``SiloData`` fitting
    ``spec`` (images float32 ``(N, C, H, W)`` on [0, 1], labels int64, unique ids). DataError
    (naming the file, the list and the entry) for anything that does not fit."""
    from monai.data import load_decathlon_datalist

    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"datalist {path} does not exist (node config 'datalist')")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"datalist {path} is not JSON: {e}"[:300]) from e
    if not isinstance(doc, dict) or key not in doc:
        raise DataError(f"datalist {path} has no {key!r} list")
    raw = doc[key]
    if not isinstance(raw, list) or not raw:
        raise DataError(f"datalist {path}: {key!r} must be a non-empty list")
    if len(raw) > MAX_ENTRIES:
        raise DataError(f"datalist {path}: {key!r} has {len(raw)} entries (at most {MAX_ENTRIES})")
    intensity = doc.get("intensity", "auto")
    if intensity not in INTENSITIES:
        raise DataError(f"datalist {path}: 'intensity' must be one of {INTENSITIES}")
    if is_tabular(spec.image_size) and intensity != "as-stored":
        raise DataError(
            f"datalist {path}: {spec.name} samples are feature vectors (standardised "
            "z-scores), not images: set 'intensity' to 'as-stored' (rescaling each sample to "
            "[0, 1] would destroy them)"
        )
    for i, item in enumerate(raw):
        if not isinstance(item, dict) and not (key == "test" and isinstance(item, str)):
            raise DataError(f"datalist {path}: {key}[{i}] is not an object")
    try:
        items = load_decathlon_datalist(
            path, is_segmentation=spec.task == "segmentation", data_list_key=key
        )
    except (TypeError, ValueError) as e:
        raise DataError(f"datalist {path}: {e}"[:300]) from e
    base = path.parent
    images, labels, ids = [], [], []
    first: dict[str, int] = {}  # sample id -> the entry that gave it
    for i, (item, entry) in enumerate(zip(items, raw)):
        where = f"datalist {path}, {key}[{i}]"
        x, y, sid = _read_entry(item, entry, spec, str(intensity), base, where)
        for s in sid:
            if first.setdefault(s, i) != i:
                raise _fail(where, f"repeats the sample id {s!r} of {key}[{first[s]}]"[:300])
        images.append(x)
        labels.append(y)
        ids += sid
    return SiloData(
        silo_id=silo,
        name=f"{path.name} ({key})",
        images=np.concatenate(images),
        labels=np.concatenate(labels),
        sample_ids=np.array(ids),
    )


def has_list(path: str | os.PathLike[str], key: str) -> bool:
    """Whether the datalist at ``path`` has a non-empty ``key`` list."""
    try:
        doc = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"datalist {path} cannot be read: {e}"[:300]) from e
    return isinstance(doc, dict) and bool(doc.get(key))


def class_counts(data: SiloData, num_classes: int) -> list[int]:
    """Per class: how many samples have that label (classification) or contain it anywhere
    (segmentation), ``num_classes`` integers."""
    if data.labels.ndim == 1:
        return [int(c) for c in np.bincount(data.labels, minlength=num_classes)[:num_classes]]
    flat = data.labels.reshape(len(data), -1)
    return [int((flat == c).any(axis=1).sum()) for c in range(num_classes)]


def write_datalist(folder: str | os.PathLike[str], lists: dict[str, SiloData], task: str) -> Path:
    """Write each ``SiloData`` of ``lists`` (key -> data, e.g. ``{"training": silo}``) as 2D
    NIfTI files under ``folder`` (one file per channel: an entry's ``image`` is then the list
    of them) and a ``dataset.json`` naming them (``intensity``: ``as-stored``; each entry's
    ``id`` its sample id, so the ids survive the export). Returns the datalist's path."""
    import nibabel as nib

    root = Path(folder)
    doc: dict[str, Any] = {"name": root.name, "intensity": "as-stored"}
    for key, data in lists.items():
        (root / key / "images").mkdir(parents=True, exist_ok=True)
        if task == "segmentation":
            (root / key / "labels").mkdir(parents=True, exist_ok=True)
        channels = data.images.shape[1]
        entries = []
        for i in range(len(data)):
            files = []
            for c in range(channels):
                suffix = "" if channels == 1 else f"_c{c}"
                files.append(f"{key}/images/{i:06d}{suffix}.nii.gz")
                pixels = np.asarray(data.images[i, c], dtype=np.float32)
                nib.save(nib.Nifti1Image(pixels, np.eye(4)), root / files[-1])
            entry: dict[str, Any] = {
                "image": files[0] if channels == 1 else files,
                "id": str(data.sample_ids[i]),
            }
            if task == "segmentation":
                label = f"{key}/labels/{i:06d}.nii.gz"
                mask = np.asarray(data.labels[i], dtype=np.uint8)
                nib.save(nib.Nifti1Image(mask, np.eye(4)), root / label)
                entry["label"] = label
            else:
                entry["label"] = int(data.labels[i])
            entries.append(entry)
        doc[key] = entries
    path = root / "dataset.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
