"""Online loaders on tiny fixture files in the real formats (random pixels: format tests)."""

import json

import nibabel as nib
import numpy as np
import pytest
from PIL import Image

from medical_data.federation import build_federation
from medical_data.online import load_decathlon_task, load_medmnist_npz, load_mednist_folder


@pytest.fixture
def medmnist_npz(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in [("train", 40), ("val", 10), ("test", 12)]:
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, 28, 28, 3), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 4, (n, 1)).astype(np.uint8)
        arrays[f"{split}_labels"][:4, 0] = np.arange(4)
    path = tmp_path / "pathmnist.npz"
    np.savez(path, **arrays)
    return path


@pytest.fixture
def mednist_folder(tmp_path):
    rng = np.random.default_rng(0)
    for name in ["AbdomenCT", "CXR", "Hand"]:
        (tmp_path / name).mkdir()
        for i in range(6):
            pixels = rng.integers(0, 256, (64, 64), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / name / f"{i:06d}.jpeg")
    return tmp_path


def test_medmnist_npz_reader(medmnist_npz) -> None:
    x, y = load_medmnist_npz(medmnist_npz, "val")
    assert x.shape == (10, 3, 28, 28) and x.dtype == np.float32
    assert y.shape == (10,) and y.dtype == np.int64
    assert 0.0 <= x.min() and x.max() <= 1.0
    with pytest.raises(ValueError, match="split"):
        load_medmnist_npz(medmnist_npz, "dev")


def test_medmnist_federation_uses_official_test(medmnist_npz) -> None:
    fed = build_federation("medmnist", 4, seed=0, partition="dirichlet", data_dir=str(medmnist_npz))
    assert fed.spec.in_channels == 3 and fed.spec.num_classes == 4
    assert len(fed.test) == 12 and sum(len(s) for s in fed.silos) == 50
    assert all(i.startswith("medmnist/pathmnist/test") for i in fed.test.sample_ids)


def test_mednist_folder(mednist_folder) -> None:
    x, y, classes = load_mednist_folder(mednist_folder)
    assert x.shape == (18, 1, 64, 64) and classes == ["AbdomenCT", "CXR", "Hand"]
    assert np.bincount(y).tolist() == [6, 6, 6]
    fed = build_federation("mednist", 3, seed=0, partition="iid", data_dir=str(mednist_folder))
    assert fed.spec.class_names == ("AbdomenCT", "CXR", "Hand")
    ids = [i for s in [*fed.silos, fed.test] for i in s.sample_ids]
    assert len(ids) == len(set(ids)) == 18


def test_decathlon_task(tmp_path) -> None:
    rng = np.random.default_rng(0)
    (tmp_path / "imagesTr").mkdir()
    (tmp_path / "labelsTr").mkdir()
    training = []
    for c in range(3):
        img = rng.normal(size=(32, 32, 5)).astype(np.float32)
        lab = np.zeros((32, 32, 5), np.uint8)
        lab[8:16, 8:16, 1:3] = 1
        nib.save(nib.Nifti1Image(img, np.eye(4)), tmp_path / "imagesTr" / f"case_{c}.nii.gz")
        nib.save(nib.Nifti1Image(lab, np.eye(4)), tmp_path / "labelsTr" / f"case_{c}.nii.gz")
        training.append(
            {"image": f"./imagesTr/case_{c}.nii.gz", "label": f"./labelsTr/case_{c}.nii.gz"}
        )
    meta = {
        "name": "Task99_Toy",
        "labels": {"0": "background", "1": "tumour"},
        "training": training,
    }
    (tmp_path / "dataset.json").write_text(json.dumps(meta))

    x, y, groups, _ = load_decathlon_task(tmp_path, max_cases=2)
    assert x.shape == (10, 1, 64, 64) and y.shape == (10, 64, 64)
    assert groups.tolist() == [0] * 5 + [1] * 5
    assert y[1].sum() == 16 * 16 and y[0].sum() == 0
    fed = build_federation("decathlon", 3, seed=0, data_dir=str(tmp_path))
    assert fed.spec.class_names == ("background", "tumour")
    assert sum(len(s) for s in fed.silos) + len(fed.test) == 15
