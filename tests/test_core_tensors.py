import pytest
import torch

from fedasync import tensors as T
from fedasync.versions import FutureVersionError, VersionedSnapshots, staleness


def _p(**kw):
    return {k: torch.tensor(v) for k, v in kw.items()}


def test_arithmetic_by_hand_and_inputs_untouched():
    # Prepare
    a = _p(w=[1.0, 2.0], b=[3.0])
    b = _p(w=[0.5, -1.0], b=[1.0])
    a0, b0 = T.clone(a), T.clone(b)

    # Execute
    s, d, c = T.add(a, b), T.sub(a, b), T.scale(a, -2.0)
    y = T.axpy(2.0, a, b)
    ws = T.weighted_sum([a, b], [0.25, 2.0])

    # Assert
    assert s["w"].tolist() == [1.5, 1.0] and s["b"].tolist() == [4.0]
    assert d["w"].tolist() == [0.5, 3.0] and d["b"].tolist() == [2.0]
    assert c["w"].tolist() == [-2.0, -4.0]
    assert y["w"].tolist() == [2.5, 3.0] and y["b"].tolist() == [7.0]
    assert ws["w"].tolist() == [1.25, -1.5] and ws["b"].tolist() == [2.75]
    for orig, copy in ((a, a0), (b, b0)):
        assert all(torch.equal(orig[k], copy[k]) for k in orig)


def test_integer_buffers_copied_from_first_argument():
    # Prepare
    a = {"w": torch.tensor([1.0]), "num_batches_tracked": torch.tensor(7)}
    b = {"w": torch.tensor([2.0]), "num_batches_tracked": torch.tensor(100)}

    # Execute
    results = [
        T.add(a, b),
        T.sub(a, b),
        T.scale(a, 3.0),
        T.axpy(0.5, a, b),
        T.weighted_sum([a, b], [0.5, 0.5]),
        T.zeros_like(a),
    ]

    # Assert
    for r in results:
        assert r["num_batches_tracked"].dtype == torch.int64
        assert r["num_batches_tracked"].item() == 7
    assert T.zeros_like(a)["w"].tolist() == [0.0]


def test_norm_finite_count_cpu():
    # Prepare
    p = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([[12.0]]), "n": torch.tensor(5)}

    # Execute / Assert
    assert T.global_norm(p) == pytest.approx(13.0, abs=1e-12)
    assert T.num_elements(p) == 4
    assert T.is_finite(p)
    assert not T.is_finite({"a": torch.tensor([1.0, float("nan")])})
    assert not T.is_finite({"a": torch.tensor([float("inf")])})
    cpu = T.to_cpu(p)
    assert cpu["a"].device.type == "cpu" and cpu["a"] is not p["a"]


def test_global_norm_uses_float64():
    # Prepare: 1e20**2 overflows float32
    p = {"a": torch.tensor([1e20, 1e20], dtype=torch.float32)}

    # Execute / Assert
    assert T.global_norm(p) == pytest.approx(2**0.5 * 1e20, rel=1e-6)


def test_mismatched_names_raise():
    with pytest.raises(KeyError):
        T.add(_p(a=[1.0]), _p(b=[1.0]))
    with pytest.raises(ValueError):
        T.weighted_sum([_p(a=[1.0])], [1.0, 2.0])


def test_staleness_single_definition():
    assert staleness(5, 2) == 3
    assert staleness(5, 5) == 0
    with pytest.raises(FutureVersionError):
        staleness(5, 6)
    with pytest.raises(ValueError) as err:
        staleness(5, -1)
    assert not isinstance(err.value, FutureVersionError)
    assert issubclass(FutureVersionError, ValueError)


def test_versioned_snapshots_evict_and_detach():
    # Prepare
    snaps = VersionedSnapshots(max_versions=2)
    w = torch.tensor([1.0, 2.0], requires_grad=True)

    # Execute
    snaps.put(0, {"w": w})
    snaps.put(1, {"w": w * 2})
    snaps.put(2, {"w": w * 3})
    with torch.no_grad():
        w.add_(100.0)

    # Assert
    assert snaps.versions() == [1, 2]
    assert 0 not in snaps and 2 in snaps and snaps.get(0) is None
    assert (snaps.oldest, snaps.latest) == (1, 2)
    got = snaps.get(1)
    assert got is not None and got["w"].tolist() == [2.0, 4.0]
    assert not got["w"].requires_grad and got["w"].device.type == "cpu"
    assert VersionedSnapshots(3).oldest is None


def test_versioned_snapshots_round_trip():
    # Prepare
    snaps = VersionedSnapshots(max_versions=3)
    snaps.put(4, {"w": torch.tensor([1.0]), "n": torch.tensor(3)})
    snaps.put(7, {"w": torch.tensor([2.0]), "n": torch.tensor(4)})

    # Execute
    restored = VersionedSnapshots(max_versions=1)
    restored.load_state_dict(snaps.state_dict())

    # Assert
    assert restored.max_versions == 3 and restored.versions() == [4, 7]
    for v in (4, 7):
        a, b = snaps.get(v), restored.get(v)
        assert a is not None and b is not None
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_clip_by_norm_by_hand():
    from fedasync.tensors import clip_by_norm

    p = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0]), "n": torch.tensor([7])}
    out, c = clip_by_norm(p, 2.5)  # norm 5 -> half
    assert c == 0.5 and out["a"].tolist() == [1.5, 0.0] and out["b"].tolist() == [2.0]
    assert out["n"].tolist() == [7] and out["n"].dtype == torch.int64  # integers untouched
    same, c = clip_by_norm(p, 10.0)
    assert c == 1.0 and same["a"].tolist() == [3.0, 0.0] and same["a"] is not p["a"]
    _, c = clip_by_norm(p, 1.0, norm=4.0)  # the caller's norm is used as given
    assert c == 0.25
    with pytest.raises(ValueError):
        clip_by_norm(p, 0.0)


def test_snapshots_default_to_cpu_copies_and_take_a_device():
    w = {"a": torch.ones(2)}
    snaps = VersionedSnapshots(2, device="cpu")
    snaps.put(0, w)
    w["a"].add_(1.0)
    assert snaps.get(0)["a"].tolist() == [1.0, 1.0]  # a copy, not a view of the live weights
    assert snaps.device.type == "cpu" and VersionedSnapshots(1).device.type == "cpu"
