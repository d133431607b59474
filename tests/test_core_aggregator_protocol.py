"""The Aggregator protocol and what a FoldResult says was applied, worked out by hand."""

import pytest
import torch

from fedasync.aggregators import Aggregator, FedAsyncAggregator, FedBuffAggregator, FoldResult
from fedasync.optim import ServerOptimizer
from fedasync.privacy import GaussianMechanism
from fedasync.staleness import constant, make_weight_fn
from fedasync.types import Params, Update


def _x(*v: float) -> Params:
    return {"w": torch.tensor(list(v), dtype=torch.float64)}


def _lists(p: dict[str, Params]) -> dict[str, list[float]]:
    return {silo: t["w"].tolist() for silo, t in p.items()}


def _fold_all(agg: Aggregator, params: Params, ups: list[Update], tau: int = 0) -> list[FoldResult]:
    """Typed with the protocol: mypy checks that both aggregators fit it."""
    return [agg.fold(params, u, tau) for u in ups]


def _check_sums(res: FoldResult, old: Params) -> None:
    """applied = new − old = Σ contributions + unattributed, per arithmetic tensor."""
    assert res.params is not None and res.applied is not None
    for k, a in res.applied.items():
        torch.testing.assert_close(a, res.params[k] - old[k], rtol=0, atol=1e-6)
        total = sum((c[k] for c in res.contributions.values()), torch.zeros_like(a))
        if res.unattributed is not None:
            total = total + res.unattributed[k]
        torch.testing.assert_close(total, a, rtol=1e-6, atol=1e-6)


def _both() -> tuple[Aggregator, Aggregator]:
    """Typed: mypy checks that both classes are Aggregators (statically)."""
    return FedAsyncAggregator(alpha=0.5, weight_fn=constant), FedBuffAggregator(2, constant)


def test_both_aggregators_satisfy_the_protocol():
    # Prepare
    fa, fb = _both()

    # Execute
    ra = _fold_all(fa, _x(0.0), [Update("a", 0, _x(2.0))])
    rb = _fold_all(fb, _x(0.0), [Update("a", 0, _x(2.0))])

    # Assert: FedAsync applies at once, has nothing pending and an empty flush; FedBuff buffers
    assert isinstance(fa, Aggregator) and isinstance(fb, Aggregator)
    assert not isinstance(object(), Aggregator)
    assert fa.pending == 0 and ra[0].flushed == 1
    empty = fa.flush(_x(1.0))
    assert (empty.params, empty.flushed, empty.applied, empty.contributions) == (None, 0, None, {})
    assert fb.pending == 1 and rb[0].flushed == 0


def test_fedasync_delta_applied_and_contribution_by_hand():
    # Prepare: s = alpha * (3+1)^-0.5 = 0.5 * 0.5 = 0.25; the integer buffer is never applied
    agg = FedAsyncAggregator(alpha=0.5, weight_fn=make_weight_fn("polynomial", a=0.5))
    x = {**_x(1.0, 2.0), "n": torch.tensor(10)}
    up = Update("a", 0, {**_x(2.0, -4.0), "n": torch.tensor(99)})

    # Execute
    res = agg.fold(x, up, tau=3)

    # Assert: x + 0.25*[2,-4] = [1.5, 1.0]; applied = 0.25*[2,-4] = [0.5, -1.0], all silo a's
    assert res.params is not None and res.params["w"].tolist() == [1.5, 1.0]
    assert res.applied is not None and set(res.applied) == {"w"}
    assert res.applied["w"].tolist() == [0.5, -1.0]
    assert _lists(res.contributions) == {"a": [0.5, -1.0]}
    assert res.unattributed is None
    _check_sums(res, x)


def test_fedasync_model_applied_is_s_times_silo_minus_x():
    # Prepare: s = 0.25 as above, x = [1, 2], silo model [3, -2]
    agg = FedAsyncAggregator(alpha=0.5, weight_fn=make_weight_fn("polynomial", a=0.5))
    x = _x(1.0, 2.0)

    # Execute
    res = agg.fold(x, Update("a", 0, _x(3.0, -2.0), kind="model"), tau=3)

    # Assert: 0.25 * ([3,-2] - [1,2]) = [0.5, -1.0]
    assert res.applied is not None and res.applied["w"].tolist() == [0.5, -1.0]
    assert _lists(res.contributions) == {"a": [0.5, -1.0]}
    _check_sums(res, x)


def test_fedasync_central_dp_noise_is_unattributed():
    # Prepare: s = 0.5; delta [3, 4] has norm 5, clipped to C = 1: [0.6, 0.8]
    agg = FedAsyncAggregator(0.5, constant, mechanism=GaussianMechanism(1.0, 1.0, seed=0))
    x = _x(0.0, 0.0)

    # Execute
    res = agg.fold(x, Update("a", 0, _x(3.0, 4.0)), tau=0)

    # Assert: silo a's part is 0.5*[0.6, 0.8] = [0.3, 0.4]; the noise (std 0.5) is the rest
    torch.testing.assert_close(res.contributions["a"]["w"], _x(0.3, 0.4)["w"])
    assert res.unattributed is not None and res.unattributed["w"].abs().sum() > 0
    _check_sums(res, x)


def test_fedbuff_sgd_k2_by_hand():
    # Prepare: weights (0+1)^-0.5 = 1 and (3+1)^-0.5 = 0.5; K = 2 so c = [0.5, 0.25]; lr 0.5
    poly = make_weight_fn("polynomial", a=0.5)
    agg = FedBuffAggregator(2, poly, optimizer=ServerOptimizer("sgd", lr=0.5))
    x = _x(1.0, 1.0)

    # Execute
    r1 = agg.fold(x, Update("a", 0, _x(4.0, 0.0)), tau=0)
    r2 = agg.fold(x, Update("b", 0, _x(0.0, 8.0)), tau=3)

    # Assert: buffered only: nothing applied
    assert (r1.params, r1.applied, r1.contributions, r1.unattributed) == (None, None, {}, None)
    # g_a = 0.5*[4,0] = [2,0], g_b = 0.25*[0,8] = [0,2]; step 0.5*[2,2] = [1,1] -> [2,2]
    assert r2.params is not None and r2.params["w"].tolist() == [2.0, 2.0]
    assert r2.applied is not None and r2.applied["w"].tolist() == [1.0, 1.0]
    assert _lists(r2.contributions) == {"a": [1.0, 0.0], "b": [0.0, 1.0]}
    assert r2.unattributed is None
    _check_sums(r2, x)


def test_fedbuff_same_silo_twice_and_sample_weighting():
    # Prepare: K = 3, samples 1, 3, 4 (total 8), constant weights, lr 1
    agg = FedBuffAggregator(3, constant, weight_by_samples=True)
    x = _x(0.0, 0.0)
    ups = [
        Update("a", 0, _x(8.0, 0.0), num_samples=1),
        Update("b", 0, _x(0.0, 8.0), num_samples=3),
        Update("a", 0, _x(2.0, 2.0), num_samples=4),
    ]

    # Execute
    res = _fold_all(agg, x, ups)[-1]

    # Assert: c = [1/8, 3/8, 4/8]; a: [1,0] + [1,1] = [2,1]; b: [0,3]; applied [2,4]
    assert res.applied is not None and res.applied["w"].tolist() == [2.0, 4.0]
    assert _lists(res.contributions) == {"a": [2.0, 1.0], "b": [0.0, 3.0]}
    _check_sums(res, x)


def test_fedbuff_partial_flush_divides_by_the_number_buffered():
    # Prepare: K = 3 but only two buffered (a sync round's close): c = [1/2, 1/2]
    agg = FedBuffAggregator(3, constant)
    x = _x(0.0)
    _fold_all(agg, x, [Update("a", 0, _x(2.0)), Update("b", 0, _x(4.0))])

    # Execute
    res = agg.flush(x)

    # Assert: a: [1], b: [2], applied [3]
    assert res.applied is not None and res.applied["w"].tolist() == [3.0]
    assert _lists(res.contributions) == {"a": [1.0], "b": [2.0]}


def _momentum_first_flush(agg: FedBuffAggregator) -> Params:
    # c = [0.5, 0.5]: g_a = [1,0], g_b = [0,2]; m = [1,2]; step lr*m = [1,2]
    x0 = _x(0.0, 0.0)
    res = _fold_all(agg, x0, [Update("a", 0, _x(2.0, 0.0)), Update("b", 0, _x(0.0, 4.0))])[-1]
    assert res.params is not None and res.applied is not None
    assert res.applied["w"].tolist() == [1.0, 2.0]
    assert _lists(res.contributions) == {"a": [1.0, 0.0], "b": [0.0, 2.0]}
    return res.params


def _momentum_second_flush(agg: FedBuffAggregator, x1: Params) -> FoldResult:
    # g_a = [2,2], g_c = [0,-1]; m = 0.5*[1,2] + [2,1] = [2.5, 2]
    ups = [Update("a", 1, _x(4.0, 4.0)), Update("c", 1, _x(0.0, -2.0))]
    return _fold_all(agg, x1, ups)[-1]


def test_fedbuff_momentum_velocity_stays_with_its_silos():
    # Prepare: mu = 0.5, lr = 1, K = 2, constant weights
    agg = FedBuffAggregator(2, constant, optimizer=ServerOptimizer("momentum", momentum=0.5))
    x1 = _momentum_first_flush(agg)

    # Execute
    res = _momentum_second_flush(agg, x1)

    # Assert: m_a = 0.5*[1,0] + [2,2] = [2.5,2]; m_b = 0.5*[0,2] = [0,1] (b sent nothing this
    # time: its velocity); m_c = [0,-1]; applied = m = [2.5, 2], x2 = [1,2] + [2.5,2] = [3.5, 4]
    assert res.params is not None and res.params["w"].tolist() == [3.5, 4.0]
    assert res.applied is not None and res.applied["w"].tolist() == [2.5, 2.0]
    assert _lists(res.contributions) == {"a": [2.5, 2.0], "b": [0.0, 1.0], "c": [0.0, -1.0]}
    assert res.unattributed is None
    _check_sums(res, x1)


def test_fedbuff_adam_shares_the_denominator_per_coordinate():
    # Prepare: beta1 = 0.5, beta2 = 0.75, eps = 0.5, lr = 1, K = 2, c = [0.5, 0.5]
    opt = ServerOptimizer("adam", lr=1.0, betas=(0.5, 0.75), eps=0.5)
    agg = FedBuffAggregator(2, constant, optimizer=opt)
    x0 = _x(0.0, 0.0)

    # Execute: flush 1 from a and b, flush 2 from c twice
    r1 = _fold_all(agg, x0, [Update("a", 0, _x(2.0, 2.0)), Update("b", 0, _x(0.0, 4.0))])[-1]
    assert r1.params is not None
    x1 = r1.params
    r2 = _fold_all(agg, x1, [Update("c", 1, _x(0.5, 1.5)), Update("c", 1, _x(0.5, 1.5))])[-1]

    # Assert flush 1: g_a = [1,1], g_b = [0,2], Δ̄ = [1,3]; m = 0.5*[1,3] = [0.5,1.5];
    # v = 0.25*[1,9] = [0.25,2.25], √v + ε = [1,2]; step [0.5, 0.75].
    # m_a = [0.5,0.5] -> [0.5, 0.25]; m_b = [0,1] -> [0, 0.5]
    assert r1.applied is not None and r1.applied["w"].tolist() == [0.5, 0.75]
    assert _lists(r1.contributions) == {"a": [0.5, 0.25], "b": [0.0, 0.5]}
    _check_sums(r1, x0)
    # flush 2: g_c = [0.5,1.5]; m = 0.5*[0.5,1.5] + 0.5*[0.5,1.5] = [0.5,1.5];
    # v = 0.75*[0.25,2.25] + 0.25*[0.25,2.25] = [0.25,2.25], √v + ε = [1,2]; step [0.5, 0.75].
    # m_a = 0.5*[0.5,0.5] = [0.25,0.25] -> [0.25, 0.125]; m_b = [0,0.5] -> [0, 0.25];
    # m_c = 0.5*[0.5,1.5] = [0.25,0.75] -> [0.25, 0.375]
    assert r2.params is not None and r2.params["w"].tolist() == [1.0, 1.5]
    assert r2.applied is not None and r2.applied["w"].tolist() == [0.5, 0.75]
    assert _lists(r2.contributions) == {
        "a": [0.25, 0.125],
        "b": [0.0, 0.25],
        "c": [0.25, 0.375],
    }
    _check_sums(r2, x1)


def test_fedbuff_central_dp_noise_is_unattributed():
    # Prepare: C = 10 (no clipping), c = [0.5, 0.5], sgd lr 1
    agg = FedBuffAggregator(2, constant, mechanism=GaussianMechanism(10.0, 1.0, seed=0))
    x = _x(0.0, 0.0)

    # Execute
    res = _fold_all(agg, x, [Update("a", 0, _x(2.0, 0.0)), Update("b", 0, _x(0.0, 4.0))])[-1]

    # Assert: the silos get exactly their parts, the noise is the rest
    assert _lists(res.contributions) == {"a": [1.0, 0.0], "b": [0.0, 2.0]}
    assert res.unattributed is not None and res.unattributed["w"].abs().sum() > 0
    _check_sums(res, x)


def test_fedbuff_restored_shares_continue_the_attribution():
    # Prepare: one momentum flush, then the state goes through state_dict
    def make() -> FedBuffAggregator:
        return FedBuffAggregator(2, constant, optimizer=ServerOptimizer("momentum", momentum=0.5))

    a = make()
    x1 = _momentum_first_flush(a)
    b = make()
    b.load_state_dict(a.state_dict())

    # Execute
    res = _momentum_second_flush(b, x1)

    # Assert: as uninterrupted (test above)
    assert _lists(res.contributions) == {"a": [2.5, 2.0], "b": [0.0, 1.0], "c": [0.0, -1.0]}


def test_fedbuff_state_without_shares_makes_old_velocity_unattributed():
    # Prepare: a checkpoint written before attribution existed has no shares
    def make() -> FedBuffAggregator:
        return FedBuffAggregator(2, constant, optimizer=ServerOptimizer("momentum", momentum=0.5))

    a = make()
    x1 = _momentum_first_flush(a)
    old = {k: v for k, v in a.state_dict().items() if k not in ("attribute", "moment_shares")}
    b = make()
    b.load_state_dict(old)

    # Execute
    res = _momentum_second_flush(b, x1)

    # Assert: the carried velocity 0.5*[1,2] = [0.5,1] is no one's; a: [2,2], c: [0,-1]
    assert _lists(res.contributions) == {"a": [2.0, 2.0], "c": [0.0, -1.0]}
    assert res.unattributed is not None and res.unattributed["w"].tolist() == [0.5, 1.0]
    _check_sums(res, x1)


def test_fedbuff_attribution_off_keeps_no_shares():
    # Prepare
    opt = ServerOptimizer("momentum", momentum=0.5)
    agg = FedBuffAggregator(1, constant, optimizer=opt, attribute=False)
    x = _x(0.0)

    # Execute
    res = agg.fold(x, Update("a", 0, _x(2.0)), tau=0)

    # Assert: the change is reported, its split is not
    assert res.applied is not None and res.applied["w"].tolist() == [2.0]
    assert (res.contributions, res.unattributed) == ({}, None)
    assert agg.state_dict()["moment_shares"] == {"shares": {}, "rest": None}


@pytest.mark.parametrize("kind", ["sgd", "momentum", "adam"])
def test_fedbuff_contributions_sum_to_applied_over_many_flushes(kind):
    # Prepare: float32, two tensors and an integer buffer, staleness and sample weighting,
    # a silo twice in one buffer, three flushes so momentum carries
    gen = torch.Generator().manual_seed(3)
    x: Params = {"w": torch.randn(3, 2, generator=gen), "b": torch.randn(2, generator=gen)}
    x["n"] = torch.tensor(5)
    opt = ServerOptimizer(kind, lr=0.3)  # type: ignore[arg-type]
    agg = FedBuffAggregator(3, make_weight_fn("polynomial"), weight_by_samples=True, optimizer=opt)
    silos = ["a", "b", "a", "c", "b", "d", "a", "a", "e"]

    # Execute / Assert
    flushes = 0
    for i, silo in enumerate(silos):
        d = {k: torch.randn(v.shape, generator=gen) for k, v in x.items() if k != "n"}
        res = agg.fold(x, Update(silo, 0, {**d, "n": torch.tensor(0)}, 1 + i), tau=i % 3)
        if res.params is None:
            assert res.applied is None and res.contributions == {}
            continue
        flushes += 1
        assert set(res.applied or {}) == {"w", "b"}
        _check_sums(res, x)
        x = res.params
    assert flushes == 3
