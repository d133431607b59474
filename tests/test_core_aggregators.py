import pytest
import torch

from fedasync.aggregators import FedAsyncAggregator, FedBuffAggregator, fedavg
from fedasync.checkpoint import load_checkpoint, save_checkpoint
from fedasync.optim import ServerOptimizer
from fedasync.staleness import constant, make_weight_fn
from fedasync.tensors import add
from fedasync.types import Update


def _x(*v):
    return {"w": torch.tensor(list(v), dtype=torch.float64)}


def test_fedavg_weighted_and_plain():
    # Prepare
    ups = [Update("a", 0, _x(1.0, 0.0), num_samples=1), Update("b", 0, _x(5.0, 4.0), num_samples=3)]

    # Execute / Assert: (1*[1,0] + 3*[5,4]) / 4 = [4, 3]; plain mean = [3, 2]
    assert fedavg(ups)["w"].tolist() == [4.0, 3.0]
    assert fedavg(ups, weight_by_samples=False)["w"].tolist() == [3.0, 2.0]


def test_fedasync_model_mixing_by_hand():
    # Prepare: s = alpha * (3+1)^-0.5 = 0.5 * 0.5 = 0.25
    agg = FedAsyncAggregator(alpha=0.5, weight_fn=make_weight_fn("polynomial", a=0.5))
    x = _x(1.0, 2.0)
    up = Update("a", base_version=7, tensors=_x(3.0, -2.0), kind="model")

    # Execute
    res = agg.fold(x, up, tau=3)

    # Assert: 0.75*[1,2] + 0.25*[3,-2] = [1.5, 1.0]
    assert res.weight == 0.25 and res.flushed == 1
    assert res.params is not None and res.params["w"].tolist() == [1.5, 1.0]
    assert x["w"].tolist() == [1.0, 2.0]


def test_fedasync_delta_vs_model_form_differ_by_s_times_base_minus_x():
    # Prepare: s = 0.25 as above; stale base [0,0], current x [1,2], delta [2,-4]
    agg = FedAsyncAggregator(alpha=0.5, weight_fn=make_weight_fn("polynomial", a=0.5))
    x, base, delta = _x(1.0, 2.0), _x(0.0, 0.0), _x(2.0, -4.0)

    # Execute
    d = agg.fold(x, Update("a", 0, delta, kind="delta"), tau=3).params
    m = agg.fold(x, Update("a", 0, add(base, delta), kind="model"), tau=3).params

    # Assert: delta form x + 0.25*[2,-4] = [1.5, 1.0]; model 0.75*[1,2] + 0.25*[2,-4] = [1.25, 0.5]
    assert d is not None and m is not None
    assert d["w"].tolist() == [1.5, 1.0]
    assert m["w"].tolist() == [1.25, 0.5]
    assert (m["w"] - d["w"]).tolist() == [-0.25, -0.5]  # 0.25 * (base - x)


def test_fedasync_factor_multiplies_weight():
    agg = FedAsyncAggregator(alpha=0.5, weight_fn=constant)
    res = agg.fold(_x(0.0), Update("a", 0, _x(4.0)), tau=0, factor=0.5)
    assert res.weight == 0.25 and res.params is not None and res.params["w"].tolist() == [1.0]


def test_parity_fedasync_alpha1_tau0_model_returns_silo_model():
    # Prepare
    agg = FedAsyncAggregator(alpha=1.0, weight_fn=make_weight_fn("polynomial"))
    silo = {"w": torch.randn(3, 4, generator=torch.Generator().manual_seed(0))}

    # Execute
    res = agg.fold({"w": torch.zeros(3, 4)}, Update("a", 0, silo, kind="model"), tau=0)

    # Assert
    assert res.params is not None
    torch.testing.assert_close(res.params["w"], silo["w"])


def test_parity_fedbuff_equals_fedavg_of_models():
    # Prepare
    gen = torch.Generator().manual_seed(1)
    n = 4
    base = {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    deltas = [{k: torch.randn(v.shape, generator=gen) for k, v in base.items()} for _ in range(n)]
    samples = [3, 10, 1, 6]
    agg = FedBuffAggregator(buffer_size=n, weight_fn=constant, weight_by_samples=True)

    # Execute
    results = [
        agg.fold(base, Update(f"s{i}", 0, d, num_samples=ns), tau=0)
        for i, (d, ns) in enumerate(zip(deltas, samples))
    ]
    models = [
        Update(f"s{i}", 0, add(base, d), ns, "model")
        for i, (d, ns) in enumerate(zip(deltas, samples))
    ]
    expected = fedavg(models, weight_by_samples=True)

    # Assert
    assert [r.flushed for r in results] == [0, 0, 0, n]
    assert all(r.params is None for r in results[:-1])
    final = results[-1].params
    assert final is not None and agg.pending == 0
    for k in base:
        torch.testing.assert_close(final[k], expected[k], rtol=1e-6, atol=1e-6)


def test_fedbuff_k2_by_hand():
    # Prepare: weights w = (0+1)^-0.5 = 1 and (3+1)^-0.5 = 0.5; samples 1 and 3
    poly = make_weight_fn("polynomial", a=0.5)
    x = _x(1.0, 1.0)
    u1 = Update("a", 5, _x(4.0, 0.0), num_samples=1)
    u2 = Update("b", 2, _x(0.0, 8.0), num_samples=3)
    by_samples = FedBuffAggregator(buffer_size=2, weight_fn=poly, weight_by_samples=True)
    plain = FedBuffAggregator(buffer_size=2, weight_fn=poly)

    # Execute
    r1 = by_samples.fold(x, u1, tau=0)
    r2 = by_samples.fold(x, u2, tau=3)
    plain.fold(x, u1, tau=0)
    p2 = plain.fold(x, u2, tau=3)

    # Assert: (1*1*[4,0] + 0.5*3*[0,8]) / 4 = [1, 3]  ->  [1,1] + [1,3] = [2, 4]
    assert (r1.params, r1.weight, r1.flushed) == (None, 1.0, 0)
    assert r2.weight == 0.5 and r2.flushed == 2
    assert r2.params is not None and r2.params["w"].tolist() == [2.0, 4.0]
    # plain: (1*[4,0] + 0.5*[0,8]) / 2 = [2, 2]  ->  [3, 3]
    assert p2.params is not None and p2.params["w"].tolist() == [3.0, 3.0]


def test_fedbuff_partial_flush_and_model_kind_rejected():
    # Prepare
    agg = FedBuffAggregator(buffer_size=3, weight_fn=constant)
    x = _x(0.0)

    # Execute
    agg.fold(x, Update("a", 0, _x(2.0)), tau=0)
    agg.fold(x, Update("b", 0, _x(4.0)), tau=0)
    res = agg.flush(x)

    # Assert: ([2] + [4]) / 2 = [3]
    assert res.flushed == 2 and res.params is not None and res.params["w"].tolist() == [3.0]
    assert agg.pending == 0 and agg.flush(x).flushed == 0
    with pytest.raises(ValueError, match="deltas"):
        agg.fold(x, Update("a", 0, _x(1.0), kind="model"), tau=0)


def test_integer_buffers_pass_through_aggregators():
    # Prepare
    x = {"w": torch.tensor([1.0]), "num_batches_tracked": torch.tensor(10)}
    d = {"w": torch.tensor([2.0]), "num_batches_tracked": torch.tensor(99)}
    fa = FedAsyncAggregator(alpha=0.5, weight_fn=constant)
    fb = FedBuffAggregator(buffer_size=1, weight_fn=constant)

    # Execute
    outs = [
        fa.fold(x, Update("a", 0, d), tau=0).params,
        fa.fold(x, Update("a", 0, d, kind="model"), tau=0).params,
        fb.fold(x, Update("a", 0, d), tau=0).params,
    ]

    # Assert
    for out in outs:
        assert out is not None
        assert out["num_batches_tracked"].dtype == torch.int64
        assert out["num_batches_tracked"].item() == 10


def test_fedbuff_restored_half_full_buffer_matches_uninterrupted(tmp_path):
    # Prepare
    gen = torch.Generator().manual_seed(2)
    x0 = {"w": torch.randn(4, generator=gen), "n": torch.tensor(0)}
    ups = [
        Update(f"s{i}", 0, {"w": torch.randn(4, generator=gen), "n": torch.tensor(0)}, 2 + i)
        for i in range(6)
    ]
    taus = [0, 1, 3, 0, 2, 5]

    def make():
        opt = ServerOptimizer("adam", lr=0.1)
        return FedBuffAggregator(4, make_weight_fn("hinge"), weight_by_samples=True, optimizer=opt)

    # Execute: uninterrupted
    a = make()
    xa = x0
    for u, t in zip(ups, taus):
        r = a.fold(xa, u, t)
        xa = r.params if r.params is not None else xa
    final_a = a.flush(xa).params

    # Execute: interrupted after 5 updates (one flush done, buffer half full)
    b = make()
    xb = x0
    for u, t in zip(ups[:5], taus[:5]):
        r = b.fold(xb, u, t)
        xb = r.params if r.params is not None else xb
    assert b.pending == 1
    save_checkpoint(tmp_path / "agg.pt", b.state_dict())
    c = make()
    c.load_state_dict(load_checkpoint(tmp_path / "agg.pt"))
    r = c.fold(xb, ups[5], taus[5])
    assert r.params is None and c.pending == 2
    final_c = c.flush(xb).params

    # Assert
    assert final_a is not None and final_c is not None
    assert torch.equal(final_a["w"], final_c["w"])
    assert c.buffered_silos == []


def test_aggregator_state_dict_round_trip(tmp_path):
    # Prepare
    agg = FedBuffAggregator(3, constant, weight_by_samples=True)
    agg.fold(_x(0.0), Update("a", 0, _x(1.0), 4), tau=1, factor=0.5)
    fa = FedAsyncAggregator(alpha=0.3, weight_fn=constant)

    # Execute
    save_checkpoint(tmp_path / "s.pt", {"buff": agg.state_dict(), "async": fa.state_dict()})
    loaded = load_checkpoint(tmp_path / "s.pt")
    agg2 = FedBuffAggregator(1, constant)
    agg2.load_state_dict(loaded["buff"])
    fa2 = FedAsyncAggregator(alpha=1.0, weight_fn=constant)
    fa2.load_state_dict(loaded["async"])

    # Assert
    s1, s2 = agg.state_dict(), agg2.state_dict()
    assert s1["weights"] == s2["weights"] == [0.5]
    assert s1["num_samples"] == s2["num_samples"] == [4] and s2["silos"] == ["a"]
    assert torch.equal(s1["deltas"][0]["w"], s2["deltas"][0]["w"])
    assert (agg2.buffer_size, agg2.weight_by_samples) == (3, True)
    assert fa2.alpha == 0.3
