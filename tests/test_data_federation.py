"""build_federation on the real offline benchmarks, and the fetch/missing-data contract.

Fetched benchmarks (radiomics, nuclei) are skipped when their files are missing, unless the
environment variable CI is set: `make test` fetches first, so there a missing file fails.
"""

import os
import shutil

import numpy as np
import pytest

from medical_data import fetch
from medical_data.federation import _build, build_federation
from medical_data.registry import get_spec


def _require_fetched(source: str, name: str) -> None:
    try:
        fetch.require_file(source, name)
    except FileNotFoundError as err:
        if os.environ.get("CI"):
            pytest.fail(f"fetched data missing under CI: {err}")
        pytest.skip(f"fetched data missing ({source}); run `python -m medical_data.fetch`")


def _all_ids(fed) -> list[str]:
    return [i for s in fed.silos for i in s.sample_ids.tolist()]


def _check_federation(fed, num_silos: int) -> None:
    spec = fed.spec
    assert len(fed.silos) == num_silos
    for s in [*fed.silos, fed.test]:
        assert len(s) > 0
        assert s.images.dtype == np.float32 and s.labels.dtype == np.int64
        assert s.images.shape[1:] == (spec.in_channels, *spec.image_size)
        if spec.task == "classification":
            assert s.labels.shape == (len(s),)
        else:
            assert s.labels.shape == (len(s), *spec.image_size)
        assert s.labels.min() >= 0 and s.labels.max() < spec.num_classes
        assert np.isfinite(s.images).all()
    train_ids = _all_ids(fed)
    assert len(set(train_ids)) == len(train_ids)  # silos never share samples
    assert not set(train_ids) & set(fed.test.sample_ids.tolist())  # test held out
    assert set(fed.info["test_sites"].tolist()) <= set(range(num_silos))
    assert len(fed.table().splitlines()) == num_silos + 4  # title, header, rule, silos, test


def test_brain_tissue_default_federation() -> None:
    fed = build_federation("brain-tissue", 10, seed=0)
    _check_federation(fed, 10)
    assert fed.spec.image_size == (28, 28) and fed.spec.num_classes == 3
    counts = np.bincount(np.concatenate([s.labels for s in fed.silos]), minlength=3)
    assert counts.min() / counts.max() > 0.9  # classes roughly balanced overall
    assert set(fed.info["test_sites"].tolist()) == set(range(10))  # test covers every site
    # natural split: silos are disjoint, ordered axial slabs
    ranges = [(int(s.sample_ids[0][14:17]), int(s.sample_ids[-1][14:17])) for s in fed.silos]
    assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))


def test_build_is_deterministic_and_seeded() -> None:
    kwargs = {"partition": "dirichlet", "max_samples": 600}
    a = _build.__wrapped__("brain-tissue", 4, 1, "dirichlet", 0.5, 1.0, 0.2, 600, None)
    b = build_federation("brain-tissue", 4, seed=1, **kwargs)
    c = build_federation("brain-tissue", 4, seed=2, **kwargs)
    assert build_federation("brain-tissue", 4, seed=1, **kwargs) is b  # cached
    for x, y in zip([*a.silos, a.test], [*b.silos, b.test]):
        assert np.array_equal(x.images, y.images) and np.array_equal(x.sample_ids, y.sample_ids)
    assert _all_ids(b) != _all_ids(c)
    assert not b.silos[0].images.flags.writeable  # callers treat it as read-only
    _check_federation(b, 4)


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_brain_tissue_other_partitions(partition: str) -> None:
    fed = build_federation("brain-tissue", 5, seed=0, partition=partition, max_samples=900)
    _check_federation(fed, 5)
    assert sum(len(s) for s in fed.silos) + len(fed.test) == 900


def test_to_tensors() -> None:
    fed = build_federation("brain-tissue", 10, seed=0)
    x, y = fed.silos[0].to_tensors()
    assert tuple(x.shape) == (len(fed.silos[0]), 1, 28, 28) and str(y.dtype) == "torch.int64"


def test_validation_errors() -> None:
    with pytest.raises(ValueError, match="num_silos"):
        build_federation("brain-tissue", 0, seed=0)
    with pytest.raises(ValueError, match="at most"):
        build_federation("brain-tissue", 5000, seed=0)
    with pytest.raises(ValueError, match="unknown benchmark.*brain-tissue"):
        build_federation("mnist", 2, seed=0)
    with pytest.raises(ValueError, match="unknown partition"):
        build_federation("brain-tissue", 2, seed=0, partition="random")
    with pytest.raises(ValueError, match="no natural split"):
        build_federation("medmnist", 2, seed=0, data_dir="x.npz")


@pytest.mark.parametrize(("name", "silos"), [("radiomics-lesion", 5), ("radiomics-slice", 10)])
def test_radiomics(name: str, silos: int) -> None:
    _require_fetched("pyradiomics-bhklab-3.1.4", "lung2_label.nrrd")
    fed = build_federation(name, silos, seed=0)
    _check_federation(fed, silos)
    total = sum(len(s) for s in fed.silos) + len(fed.test)
    assert total == 178
    if silos == 5:
        assert [s.name.split()[0] for s in fed.silos] == [
            "brain1",
            "brain2",
            "breast1",
            "lung1",
            "lung2",
        ]


def test_nuclei() -> None:
    _require_fetched("stardist-0.9.2", "mask2d.tif")
    fed = build_federation("nuclei", 10, seed=0)
    _check_federation(fed, 10)
    fg = np.concatenate([s.labels for s in fed.silos]).mean()
    assert 0.1 < fg < 0.3


def test_missing_file_names_the_command(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"python -m medical_data\.fetch"):
        fetch.require_file("stardist-0.9.2", "img2d.tif", cache_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="make data"):
        build_federation("nuclei", 2, seed=0, data_dir=str(tmp_path))
    bad = tmp_path / "stardist-0.9.2" / "img2d.tif"
    bad.parent.mkdir()
    bad.write_bytes(b"not a tiff")
    with pytest.raises(OSError, match="sha256"):
        fetch.require_file("stardist-0.9.2", "img2d.tif", cache_dir=str(tmp_path))


def test_fetch_is_idempotent(tmp_path, monkeypatch) -> None:
    _require_fetched("stardist-0.9.2", "mask2d.tif")
    _require_fetched("pyradiomics-bhklab-3.1.4", "lung2_label.nrrd")
    for source in fetch.SOURCES:
        shutil.copytree(fetch.data_dir() / source.name, tmp_path / source.name)

    def no_download(*args, **kwargs):
        raise AssertionError("a second fetch must only verify")

    import fedasync.fetch

    monkeypatch.setattr(fedasync.fetch, "download", no_download)
    manifest = fetch.fetch_all(str(tmp_path))
    assert "img2d.tif" in manifest.read_text()


def test_spec_lookup() -> None:
    assert get_spec("brain-tissue").task == "classification"
