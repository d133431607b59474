"""breast-fna: the WDBC fine-needle-aspirate features (scikit-learn's copy) as an offline,
tabular benchmark: loading with nothing downloaded, train-only standardisation, the fixed
test split and the iid natural split, mlp-small, the tabular trigger and site shift, and that
a small central training learns it."""

import socket

import numpy as np
import pytest
import torch
from torch import nn

from medical_data.backdoor import TABULAR_TRIGGER_VALUE, add_trigger, poison, triggered_set
from medical_data.federation import build_federation
from medical_data.networks import build_network, network_for
from medical_data.offline import load_breast_fna, load_offline
from medical_data.partition import apply_site_shift
from medical_data.registry import get_spec, is_tabular
from medical_data.tasks import concat, evaluate


@pytest.fixture(scope="module")
def raw():
    return load_breast_fna()


def test_loads_offline_with_the_wdbc_shapes_and_labels(monkeypatch, tmp_path):
    def no_network(*args, **kwargs):
        raise AssertionError("breast-fna tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setenv("SCIKIT_LEARN_DATA", str(tmp_path))  # where a download would land
    data = load_offline("breast-fna")
    assert not any(tmp_path.iterdir())
    assert data.images.shape == (569, 1, 1, 30) and data.images.dtype == np.float32
    assert data.labels.shape == (569,) and data.labels.dtype == np.int64
    assert np.bincount(data.labels).tolist() == [212, 357]  # malignant, benign
    assert np.array_equal(data.strata, data.labels)
    assert np.isfinite(data.images).all()
    assert len(set(data.sample_ids.tolist())) == 569
    assert data.sample_ids[0] == "breast-fna/r000"
    spec = get_spec("breast-fna")
    assert spec.offline and spec.task == "classification" and spec.network == "mlp-small"
    assert (spec.in_channels, *spec.image_size) == data.images.shape[1:]
    assert spec.class_names == ("malignant", "benign") and is_tabular(spec.image_size)
    assert not spec.natural_split.startswith("none")  # partition=natural is allowed


def test_fixed_stratified_test_split(raw):
    assert raw.is_test is not None
    assert np.bincount(raw.labels[raw.is_test]).tolist() == [53, 89]  # 25% of each class
    again = load_breast_fna()
    assert np.array_equal(raw.is_test, again.is_test)  # fixed, not drawn per run
    assert np.array_equal(raw.images, again.images)


def test_standardised_with_train_statistics_only(raw):
    from sklearn.datasets import load_breast_cancer

    x = load_breast_cancer().data
    train, test = x[~raw.is_test], x[raw.is_test]
    z = raw.images[:, 0, 0, :]
    mean, std = train.mean(0), train.std(0)
    np.testing.assert_allclose(z[~raw.is_test].mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(z[~raw.is_test].std(0), 1.0, atol=1e-5)
    np.testing.assert_allclose(z[raw.is_test], (test - mean) / std, rtol=1e-5, atol=1e-5)
    # the test split's own statistics would give other values: they were not used
    assert np.abs(z[raw.is_test].mean(0)).max() > 0.05


def test_federation_split_sizes_and_the_iid_natural_split():
    fed = build_federation("breast-fna", 4, seed=0)
    assert [len(s) for s in fed.silos] == [107, 107, 107, 106]
    assert len(fed.test) == 142 and fed.info["natural_partition"] == "iid"
    assert [s.name for s in fed.silos] == ["silo 0", "silo 1", "silo 2", "silo 3"]
    train_ids = np.concatenate([s.sample_ids for s in fed.silos])
    assert len(set(train_ids.tolist())) == 427
    assert not set(train_ids.tolist()) & set(fed.test.sample_ids.tolist())
    for s in [*fed.silos, fed.test]:
        assert s.images.shape[1:] == (1, 1, 30) and s.images.dtype == np.float32
    assert set(fed.info["test_sites"].tolist()) == {0, 1, 2, 3}
    # natural is the iid split (same seed, same silos); test_fraction does not apply
    iid = build_federation("breast-fna", 4, seed=0, partition="iid")
    assert all(np.array_equal(a.sample_ids, b.sample_ids) for a, b in zip(fed.silos, iid.silos))
    other = build_federation("breast-fna", 4, seed=0, test_fraction=0.5)
    assert len(other.test) == 142
    assert not np.array_equal(
        build_federation("breast-fna", 4, seed=1).silos[0].sample_ids, fed.silos[0].sample_ids
    )
    assert len(fed.table().splitlines()) == 4 + 4


def test_tabular_site_shift_is_a_seeded_affine_measurement_shift(raw):
    x = raw.images[:50]
    a, pa = apply_site_shift(x, 7, 1.0)
    b, pb = apply_site_shift(x, 7, 1.0)
    assert np.array_equal(a, b) and pa == pb and set(pa) == {"gain", "offset", "noise_std"}
    assert not np.array_equal(a, apply_site_shift(x, 8, 1.0)[0])
    assert a.shape == x.shape and a.dtype == np.float32
    assert 0.05 < float(np.abs(a - x).mean()) < 1.0  # moderate, in standard deviations
    same, p0 = apply_site_shift(x, 7, 0.0)
    assert np.array_equal(same, x) and p0["noise_std"] == 0.0


def test_mlp_small_builds_and_runs():
    spec = get_spec("breast-fna")
    net = network_for(spec).eval()
    with torch.no_grad():
        out = net(torch.randn(5, 1, 1, 30))
    assert tuple(out.shape) == (5, 2)
    assert sum(p.numel() for p in net.parameters()) == 30 * 64 + 64 + 64 * 32 + 32 + 32 * 2 + 2
    assert not any(
        isinstance(m, nn.Dropout | nn.modules.batchnorm._BatchNorm) for m in net.modules()
    )
    # any input size: it sees C*H*W features
    assert tuple(build_network("mlp-small", 3, 4, (8, 8))(torch.zeros(2, 3, 8, 8)).shape) == (2, 4)


@pytest.mark.parametrize("size", [1, 3, 5])
def test_trigger_sets_exactly_the_last_features(raw, size):
    x = raw.images[:20]
    solid = add_trigger(x, size=size)
    changed = np.flatnonzero((solid != x).any(axis=(0, 1, 2)))
    assert changed.tolist() == list(range(30 - size, 30))
    assert np.all(solid[..., 30 - size :] == TABULAR_TRIGGER_VALUE)
    assert np.array_equal(solid[..., : 30 - size], x[..., : 30 - size])
    checker = add_trigger(x, size=size, pattern="checker")
    want = [TABULAR_TRIGGER_VALUE * (-1) ** k for k in range(size)]
    assert np.all(checker[..., 30 - size :] == np.array(want, dtype=np.float32))
    assert np.array_equal(checker[..., : 30 - size], x[..., : 30 - size])
    assert np.all(add_trigger(x, size=size, value=2.5)[..., 30 - size :] == 2.5)


def test_trigger_size_is_bounded_by_the_features(raw):
    with pytest.raises(ValueError, match=r"\[1, 30\]"):
        add_trigger(raw.images[:2], size=31)


def test_poison_and_triggered_set_on_a_silo():
    fed = build_federation("breast-fna", 4, seed=0)
    silo = fed.silos[1]
    bad = poison(silo, 1.0, target_label=1, seed=0)
    assert np.all(bad.labels == 1) and np.array_equal(bad.sample_ids, silo.sample_ids)
    assert np.array_equal(bad.images[..., :27], silo.images[..., :27])
    assert np.all(bad.images[..., 27:] == TABULAR_TRIGGER_VALUE)
    trig = triggered_set(fed.test, target_label=1)
    assert len(trig) == 53 and np.all(trig.labels == 0)  # the malignant test samples


def test_a_small_central_training_learns_it():
    fed = build_federation("breast-fna", 4, seed=0)
    data = fed.silos[0]
    for s in fed.silos[1:]:
        data = concat(data, s)
    x, y = data.to_tensors()
    torch.manual_seed(0)
    net = network_for(fed.spec)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 0.1 s; two threads on a busy two-core machine take seconds
    try:
        for _ in range(300):
            i = torch.randint(len(x), (32,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[i]), y[i]).backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    assert evaluate(net, fed.test, task="classification")["score"] > 0.85


def test_a_silo_datalist_round_trips_as_stored_only(tmp_path):
    import json

    from fedasync.errors import DataError
    from medical_data.datalist import load_datalist, write_datalist

    fed = build_federation("breast-fna", 4, seed=0)
    path = write_datalist(tmp_path, {"training": fed.silos[0]}, "classification")
    back = load_datalist(path, fed.spec)
    assert np.array_equal(back.images, fed.silos[0].images)
    assert np.array_equal(back.sample_ids, fed.silos[0].sample_ids)
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "intensity": "auto"}))
    with pytest.raises(DataError, match="as-stored"):
        load_datalist(path, fed.spec)
