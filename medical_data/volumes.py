"""Brain tissue in 3D: real MR volumes with real labels, written as NIfTI files, a Decathlon
datalist and a MONAI bundle that trains on them.

Source: the ICBM 2009c nonlinear symmetric T1 template and its grey- and white-matter
probability maps (nilearn wheel, as ``brain-tissue`` in 2D), taken at 2 mm. Each volume is a
``size``-voxel cube of the T1 at a seeded place inside the brain; its label map has four
classes per voxel: 0 outside the brain, 1 other brain tissue (CSF and the rest), 2 grey
matter, 3 white matter (the most probable tissue of the maps). Volumes are grouped into
``sites`` natural silos by height (axial slabs of the brain, each site's centres in its own
slab) and carry their site's scanner shift (gain, bias field, Rician-like noise and gamma,
seeded per site), so silos differ as hospitals do. Every file's name is its sample id.

``write_brain_volumes`` writes ``images/`` and ``labels/`` and ``dataset.json`` (``training``
and ``validation`` lists; every entry has its ``site``). ``write_bundle`` writes a MONAI
bundle in the model zoo's layout that trains a 3D BasicUNet with DiceCE on random 32^3 crops
and validates by sliding-window inference: ``configs/train.json``, ``configs/metadata.json``,
``models/``. Its ``train#trainer`` is an ignite ``SupervisedTrainer`` as in the zoo; fedasync
never builds it.

    python -m medical_data.volumes runs/brain3d --volumes 48     # data/ and bundle/
    fedasync simulate task.bundle=runs/brain3d/bundle
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from fedasync import seeds

CLASSES = ("outside", "other brain", "grey matter", "white matter")
SIZE = 40
"""Edge of a volume in voxels (2 mm)."""
CROP = 32
"""Edge of the bundle's random training crops and of its sliding window."""


def _brain_2mm() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """T1 scaled to [0, 1], the four-class label map and the brain mask, at 2 mm."""
    from scipy import ndimage

    from medical_data.offline import _mni
    from medical_data.raw import robust_unit

    t1 = robust_unit(_mni("t1"), 0.0, 99.5)
    gm, wm = _mni("gm") / 255.0, _mni("wm") / 255.0
    brain = ndimage.binary_dilation(ndimage.binary_fill_holes(gm + wm > 0.2), iterations=2)
    other = np.clip(1.0 - gm - wm, 0.0, 1.0)
    tissue = np.stack([other, gm, wm]).argmax(0) + 1
    labels = np.where(brain, tissue, 0).astype(np.uint8)
    s = (slice(None, None, 2),) * 3
    return t1[s].astype(np.float32), labels[s], brain[s]


def _site_shift(vol: np.ndarray, site: int, seed: int) -> np.ndarray:
    """``vol`` as site ``site``'s scanner sees it: gain, smooth bias field, noise, gamma."""
    rng = seeds.rng(seed, f"volumes.site{site}")
    gain, gamma, noise = rng.uniform(0.8, 1.2), rng.uniform(0.8, 1.25), rng.uniform(0.01, 0.05)
    axes = np.meshgrid(*(np.linspace(-1, 1, n) for n in vol.shape), indexing="ij")
    coef = rng.normal(0.0, 0.15, size=3)
    bias = np.exp(sum(c * a for c, a in zip(coef, axes)))
    out = np.clip(vol * gain * bias, 0.0, None) ** gamma
    out = out + rng.normal(0.0, noise, size=vol.shape)
    return np.clip(out, 0.0, 1.5).astype(np.float32)


def _centres(
    brain: np.ndarray, n: int, half: int, slabs: int, seed: int
) -> list[tuple[int, np.ndarray]]:
    """``n`` seeded ``(slab, centre)``: centres inside the brain, ``half`` voxels from every
    edge, the i-th in axial slab ``i % slabs`` (slabs of equal brain-voxel counts by height)."""
    inside = np.argwhere(brain)
    ok = np.all((inside >= half) & (inside < np.array(brain.shape) - half), axis=1)
    inside = inside[ok]
    z_edges = np.quantile(inside[:, 2], np.linspace(0, 1, slabs + 1))
    rng = seeds.rng(seed, "volumes.centres")
    out = []
    for i in range(n):
        slab = i % slabs
        lo, hi = z_edges[slab], z_edges[slab + 1]
        pool = inside[(inside[:, 2] >= lo) & (inside[:, 2] <= hi)]
        out.append((slab, pool[rng.integers(len(pool))]))
    return out


def brain_volumes(
    n: int, *, sites: int = 4, seed: int = 0, size: int = SIZE
) -> list[dict[str, Any]]:
    """``n`` volumes: dicts with ``id``, ``site``, ``image`` ``(size,)*3`` float32 and
    ``label`` uint8, centres seeded inside the brain, site ``i``'s in the i-th axial slab,
    each with its site's scanner shift."""
    t1, labels, brain = _brain_2mm()
    half = size // 2
    out = []
    for i, (site, (x, y, z)) in enumerate(_centres(brain, n, half, sites, seed)):
        box = (slice(x - half, x + half), slice(y - half, y + half), slice(z - half, z + half))
        out.append(
            {
                "id": f"brain3d-s{site}-{i:04d}",
                "site": site,
                "image": _site_shift(t1[box], site, seed),
                "label": labels[box].copy(),
            }
        )
    return out


def raw_brain_volumes(n: int = 160, *, size: int = SIZE, seed: int = 0) -> dict[str, np.ndarray]:
    """The built-in ``brain-tissue-3d`` benchmark's samples, before any site shift: ``n``
    volumes at seeded places inside the brain, ordered by height. ``images`` ``(n, 1, size,
    size, size)`` float32, ``labels`` ``(n, size, size, size)`` int64, ``z`` the centre's
    height (the natural groups: neighbouring ids are neighbouring slabs), ``ids``."""
    t1, labels, brain = _brain_2mm()
    half = size // 2
    picked = sorted(_centres(brain, n, half, 1, seed), key=lambda c: tuple(c[1][::-1]))
    images, masks, zs, ids = [], [], [], []
    for _, (x, y, z) in picked:
        box = (slice(x - half, x + half), slice(y - half, y + half), slice(z - half, z + half))
        images.append(t1[box][None])
        masks.append(labels[box].astype(np.int64))
        zs.append(int(z))
        ids.append(f"brain-tissue-3d/z{z:03d}/x{x:03d}y{y:03d}")
    return {
        "images": np.stack(images).astype(np.float32),
        "labels": np.stack(masks),
        "z": np.asarray(zs, dtype=np.int64),
        "ids": np.asarray(ids),
    }


def write_brain_volumes(
    folder: Path, n: int, *, validation: int = 8, sites: int = 4, seed: int = 0
) -> Path:
    """Write ``n`` training and ``validation`` held-out volumes (NIfTI, 2 mm voxels) and
    their ``dataset.json``; returns its path."""
    import nibabel as nib

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    (folder / "labels").mkdir(parents=True, exist_ok=True)
    vols = brain_volumes(n + validation, sites=sites, seed=seed)
    affine = np.diag([2.0, 2.0, 2.0, 1.0])
    lists: dict[str, list[dict[str, Any]]] = {"training": [], "validation": []}
    for k, v in enumerate(vols):
        name = f"{v['id']}.nii.gz"
        nib.save(nib.Nifti1Image(v["image"], affine), folder / "images" / name)
        nib.save(nib.Nifti1Image(v["label"], affine), folder / "labels" / name)
        entry = {"image": f"images/{name}", "label": f"labels/{name}", "site": v["site"]}
        lists["training" if k < n else "validation"].append(entry)
    meta = {
        "name": "brain-tissue-3d",
        "description": __doc__.split("\n\n")[1].replace("\n", " "),
        "labels": {str(i): c for i, c in enumerate(CLASSES)},
        "modality": {"0": "MR T1"},
        "tensorImageSize": "3D",
        "numTraining": n,
        **lists,
    }
    path = folder / "dataset.json"
    path.write_text(json.dumps(meta, indent=1))
    return path


def bundle_config(dataset_dir: str) -> dict[str, Any]:
    """A model-zoo style ``train.json``: 3D BasicUNet, DiceCE, SGD, random crops, sliding
    window; ``dataset_dir`` is where ``dataset.json`` is."""
    load = [
        {"_target_": "LoadImaged", "keys": ["image", "label"], "image_only": True},
        {"_target_": "EnsureChannelFirstd", "keys": ["image", "label"]},
        {"_target_": "EnsureTyped", "keys": ["image", "label"], "dtype": ["float32", "int64"]},
    ]
    crop = [
        {
            "_target_": "RandSpatialCropd",
            "keys": ["image", "label"],
            "roi_size": [CROP] * 3,
            "random_size": False,
        },
        {"_target_": "RandFlipd", "keys": ["image", "label"], "prob": 0.5, "spatial_axis": 0},
    ]
    datalist = "$os.path.join(@dataset_dir, 'dataset.json')"
    return {
        "imports": ["$import os", "$import monai"],
        "bundle_root": ".",
        "device": "$torch.device('cuda' if torch.cuda.is_available() else 'cpu')",
        "dataset_dir": dataset_dir,
        "train_datalist": f"$monai.data.load_decathlon_datalist({datalist[1:]}, True, 'training')",
        "val_datalist": f"$monai.data.load_decathlon_datalist({datalist[1:]}, True, 'validation')",
        "network_def": {
            "_target_": "BasicUNet",
            "spatial_dims": 3,
            "in_channels": 1,
            "out_channels": len(CLASSES),
            "features": [8, 8, 16, 32, 64, 8],
            "norm": ["group", {"num_groups": 4}],
        },
        "network": "$@network_def.to(@device)",
        "loss": {"_target_": "DiceCELoss", "to_onehot_y": True, "softmax": True},
        "optimizer": {
            "_target_": "torch.optim.SGD",
            "params": "$@network.parameters()",
            "lr": 0.05,
            "momentum": 0.9,
        },
        "train": {
            "deterministic_transforms": load,
            "random_transforms": crop,
            "preprocessing": {
                "_target_": "Compose",
                "transforms": "$@train#deterministic_transforms + @train#random_transforms",
            },
            "dataset": {
                "_target_": "CacheDataset",
                "data": "@train_datalist",
                "transform": "@train#preprocessing",
                "cache_rate": 1.0,
            },
            "dataloader": {
                "_target_": "DataLoader",
                "dataset": "@train#dataset",
                "batch_size": 2,
                "shuffle": True,
                "num_workers": 0,
            },
            "inferer": {"_target_": "SimpleInferer"},
            "key_metric": {
                "train_mean_dice": {
                    "_target_": "MeanDice",
                    "output_transform": "$monai.handlers.from_engine(['pred', 'label'])",
                }
            },
            "trainer": {
                "_target_": "SupervisedTrainer",
                "max_epochs": 20,
                "device": "@device",
                "train_data_loader": "@train#dataloader",
                "network": "@network",
                "loss_function": "@loss",
                "optimizer": "@optimizer",
                "inferer": "@train#inferer",
                "key_train_metric": "@train#key_metric",
            },
        },
        "validate": {
            "preprocessing": {
                "_target_": "Compose",
                "transforms": "$@train#deterministic_transforms",
            },
            "dataset": {
                "_target_": "Dataset",
                "data": "@val_datalist",
                "transform": "@validate#preprocessing",
            },
            "inferer": {
                "_target_": "SlidingWindowInferer",
                "roi_size": [CROP] * 3,
                "sw_batch_size": 4,
                "overlap": 0.25,
            },
        },
        "run": ["$@train#trainer.run()"],
    }


def write_bundle(folder: Path, dataset_dir: Path) -> Path:
    """Write the bundle (``configs/train.json``, ``configs/metadata.json``, ``models/``) for
    the volumes in ``dataset_dir``; returns the bundle's folder."""
    folder = Path(folder)
    (folder / "configs").mkdir(parents=True, exist_ok=True)
    (folder / "models").mkdir(exist_ok=True)
    config = bundle_config(str(Path(dataset_dir).resolve()))
    (folder / "configs" / "train.json").write_text(json.dumps(config, indent=2))
    metadata = {
        "schema": "https://github.com/Project-MONAI/MONAI-extra-test-data/releases/download/"
        "0.8.1/meta_schema_20220324.json",
        "version": "0.1.0",
        "changelog": {"0.1.0": "brain tissue in 3D, written by medical_data.volumes"},
        "monai_version": "1.6.1",
        "name": "Brain tissue 3D segmentation",
        "task": "Segmentation of brain tissue (grey, white, other) in T1 MR volumes",
        "description": "A 3D BasicUNet on the MNI152 2009c template at 2 mm.",
        "authors": "fedasync",
        "license": "BSD-3-Clause (data: nilearn, McConnell Brain Imaging Centre)",
        "network_data_format": {
            "inputs": {
                "image": {
                    "type": "image",
                    "format": "magnitude",
                    "modality": "MR",
                    "num_channels": 1,
                    "spatial_shape": [CROP] * 3,
                    "dtype": "float32",
                    "value_range": [0, 1],
                    "is_patch_data": True,
                }
            },
            "outputs": {
                "pred": {
                    "type": "image",
                    "format": "segmentation",
                    "num_channels": len(CLASSES),
                    "spatial_shape": [CROP] * 3,
                    "dtype": "float32",
                    "is_patch_data": True,
                    "channel_def": {str(i): c for i, c in enumerate(CLASSES)},
                }
            },
        },
    }
    (folder / "configs" / "metadata.json").write_text(json.dumps(metadata, indent=2))
    return folder


def main(argv: list[str] | None = None) -> None:
    """``python -m medical_data.volumes FOLDER``: the volumes and the bundle."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--volumes", type=int, default=48, help="training volumes")
    ap.add_argument("--validation", type=int, default=8, help="held-out volumes")
    ap.add_argument("--sites", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    datalist = write_brain_volumes(
        args.folder / "data",
        args.volumes,
        validation=args.validation,
        sites=args.sites,
        seed=args.seed,
    )
    bundle = write_bundle(args.folder / "bundle", datalist.parent)
    print(f"{args.volumes}+{args.validation} volumes in {datalist.parent}; bundle {bundle}")


if __name__ == "__main__":
    main()
