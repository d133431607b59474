"""Loaders for data sets a user downloaded (they need the internet; nothing here fetches).

Same output as the offline benchmarks: images float32 ``(N, C, H, W)`` in ``[0, 1]``, labels
int64. Used by ``build_federation("medmnist" | "mednist" | "decathlon", data_dir=...)``.

- MedMNIST v2 (Yang et al. 2023, CC BY 4.0): one ``xxxmnist.npz`` from Zenodo with keys
  ``{train,val,test}_{images,labels}``; images ``(N, H, W)`` or ``(N, H, W, 3)`` uint8, labels
  ``(N, 1)``. Read with numpy only: the ``medmnist`` package pulls torchvision (and with it a
  CUDA torch).
- MONAI MedNIST (from the MedNIST tutorial, CC BY-SA 4.0 sources): a folder with one
  sub-folder of ``.jpeg`` per class, read with PIL.
- Medical Segmentation Decathlon (Antonelli et al. 2022, CC BY-SA 4.0): ``dataset.json`` and
  ``imagesTr``/``labelsTr`` NIfTI, read with nibabel; 2D axial slices resized to 64x64.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from medical_data.raw import RawData, resize_images, resize_masks, robust_unit


def load_medmnist_npz(path: str | Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """One split of a MedMNIST .npz: images float32 ``(N, C, H, W)`` in [0, 1], labels ``(N,)``.

    Multi-label files (labels ``(N, L)`` with L > 1, ChestMNIST) are rejected.
    """
    if split not in ("train", "val", "test"):
        raise ValueError(f"split must be 'train', 'val' or 'test', got {split!r}")
    with np.load(path) as z:
        images, labels = z[f"{split}_images"], z[f"{split}_labels"]
    if images.ndim == 3:
        images = images[:, None]
    elif images.ndim == 4:
        images = images.transpose(0, 3, 1, 2)
    else:
        raise ValueError(f"{path}: {split}_images has shape {images.shape}")
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] != 1:
        raise ValueError(f"{path}: multi-label files ({labels.shape}) are not supported")
    return (images.astype(np.float32) / 255.0), labels.reshape(-1).astype(np.int64)


def load_mednist_folder(root: str | Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """MedNIST folder: images float32 ``(N, 1, H, W)``, labels ``(N,)``, sorted class names."""
    from PIL import Image

    root = Path(root)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise FileNotFoundError(f"{root} has no class sub-folders (expected MedNIST layout)")
    images, labels = [], []
    for k, name in enumerate(classes):
        for f in sorted((root / name).glob("*.jp*g")):
            with Image.open(f) as im:
                images.append(np.asarray(im.convert("L"), dtype=np.float32) / 255.0)
            labels.append(k)
    return np.stack(images)[:, None], np.array(labels, dtype=np.int64), classes


def load_decathlon_task(
    root: str | Path, max_cases: int | None = None, size: tuple[int, int] = (64, 64)
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """Decathlon task folder as 2D axial slices.

    Returns images float32 ``(N, C, *size)`` (C = modalities), label masks int64
    ``(N, *size)``, case index per slice ``(N,)``, and the parsed dataset.json.
    """
    import nibabel as nib

    root = Path(root)
    meta = json.loads((root / "dataset.json").read_text())
    cases = meta["training"][:max_cases] if max_cases else meta["training"]
    images, labels, groups = [], [], []
    for g, case in enumerate(cases):
        # nib.load is typed as returning the FileBasedImage base; a NIfTI file is a Nifti1Image
        img = np.asarray(nib.load(root / case["image"]).get_fdata(dtype=np.float32))  # type: ignore[attr-defined]
        lab = np.asarray(nib.load(root / case["label"]).dataobj).astype(np.int64)  # type: ignore[attr-defined]
        if img.ndim == 3:
            img = img[..., None]
        img = np.moveaxis(img, (2, 3), (0, 1))  # (Z, C, X, Y)
        img = np.stack([robust_unit(img[:, c]) for c in range(img.shape[1])], axis=1)
        images.append(resize_images(img, size))
        labels.append(resize_masks(np.moveaxis(lab, 2, 0), size))
        groups.append(np.full(len(img), g, dtype=np.int64))
    return np.concatenate(images), np.concatenate(labels), np.concatenate(groups), meta


def _class_info(num_classes: int, image_shape: tuple[int, ...], names: list[str]) -> dict:
    return {
        "in_channels": int(image_shape[0]),
        "num_classes": int(num_classes),
        "image_size": (int(image_shape[1]), int(image_shape[2])),
        "class_names": tuple(names),
    }


def load_online(name: str, data_dir: str) -> RawData:
    """A downloaded data set as `RawData`; ``info`` carries the derived spec fields."""
    path = Path(data_dir)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (download {name} there first)")
    if name == "medmnist":
        parts = [load_medmnist_npz(path, s) for s in ("train", "val", "test")]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        split = np.concatenate(
            [np.full(len(p[1]), s) for p, s in zip(parts, ("train", "val", "test"))]
        )
        k = int(y.max()) + 1
        ids = np.array([f"medmnist/{path.stem}/{s}{i:06d}" for s, i in zip(split, _running(split))])
        info = _class_info(k, x.shape[1:], [f"class {i}" for i in range(k)])
        return RawData(
            x,
            y,
            np.zeros(len(y), np.int64),
            ids,
            y.copy(),
            {**info, "source": str(path)},
            split == "test",
        )
    if name == "mednist":
        x, y, classes = load_mednist_folder(path)
        ids = np.array([f"mednist/{classes[c]}/{i:06d}" for c, i in zip(y, _running(y))])
        info = _class_info(len(classes), x.shape[1:], classes)
        return RawData(
            x, y, np.zeros(len(y), np.int64), ids, y.copy(), {**info, "source": str(path)}
        )
    if name == "decathlon":
        x, y, g, meta = load_decathlon_task(path)
        names = [str(v) for _, v in sorted(meta["labels"].items(), key=lambda kv: int(kv[0]))]
        ids = np.array(
            [
                f"decathlon/{meta.get('name', path.name)}/c{c:03d}s{i:03d}"
                for c, i in zip(g, _running(g))
            ]
        )
        strata = np.asarray((y.reshape(len(y), -1) > 0).any(1), dtype=np.int64)
        info = _class_info(len(names), x.shape[1:], names)
        return RawData(x, y, g, ids, strata, {**info, "source": str(path), "group": "case"})
    raise ValueError(f"{name!r} is not an online benchmark")


def _running(keys: np.ndarray) -> np.ndarray:
    """Index of each element among the elements with the same key, ``(N,)``."""
    out = np.zeros(len(keys), dtype=np.int64)
    seen: dict = {}
    for i, k in enumerate(keys.tolist()):
        out[i] = seen.get(k, 0)
        seen[k] = out[i] + 1
    return out
