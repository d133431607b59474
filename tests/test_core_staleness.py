import math

import pytest

from fedasync.staleness import (
    WEIGHT_FUNCTIONS,
    StalenessBound,
    constant,
    exponential,
    hinge,
    make_weight_fn,
    polynomial,
)


def test_weight_functions_by_hand():
    assert constant(0) == 1.0 and constant(9) == 1.0
    assert polynomial(0, 0.5) == 1.0
    assert polynomial(3, 0.5) == 0.5  # (3+1)^-0.5
    assert polynomial(1, 1.0) == 0.5  # (1+1)^-1
    assert hinge(4, a=0.5, b=4) == 1.0  # tau <= b
    assert hinge(6, a=0.5, b=4) == 0.5  # 1 / (0.5*2 + 1)
    assert hinge(14, a=0.1, b=4) == 0.5  # 1 / (0.1*10 + 1)
    assert exponential(0, 0.3) == 1.0
    assert exponential(1, math.log(2)) == pytest.approx(0.5)
    assert exponential(2, math.log(2)) == pytest.approx(0.25)


@pytest.mark.parametrize("fn", [constant, lambda t: polynomial(t, 0.5), lambda t: hinge(t, 1, 2)])
def test_negative_staleness_raises(fn):
    with pytest.raises(ValueError):
        fn(-1)
    with pytest.raises(ValueError):
        exponential(-1, 1.0)


def test_make_weight_fn():
    # Execute
    poly = make_weight_fn("polynomial", a=0.5)
    hin = make_weight_fn("hinge", a=0.5, b=4)
    expo = make_weight_fn("exponential", a=math.log(2))

    # Assert
    assert set(WEIGHT_FUNCTIONS) == {"constant", "polynomial", "hinge", "exponential"}
    assert make_weight_fn("constant")(5) == 1.0
    assert poly(3) == 0.5
    assert hin(6) == 0.5 and hin(3) == 1.0
    assert expo(1) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="polynomial"):
        make_weight_fn("linear")


def test_bound_decisions():
    # Prepare
    bound = StalenessBound(max_staleness=10, soft_staleness=4, soft_factor=0.5)

    # Execute
    reject, down, edge, accept = bound.check(12), bound.check(10), bound.check(5), bound.check(4)

    # Assert
    assert (reject.action, reject.factor) == ("reject", 0.0)
    assert reject.reason == "staleness 12 > max_staleness 10"
    assert (down.action, down.factor) == ("downweight", 0.5)
    assert (edge.action, edge.factor) == ("downweight", 0.5)
    assert (accept.action, accept.factor) == ("accept", 1.0)


def test_bound_defaults_accept_everything():
    assert StalenessBound().check(10_000).action == "accept"
    assert StalenessBound(max_staleness=3).check(3).action == "accept"
    assert StalenessBound(max_staleness=3).check(4).action == "reject"


@pytest.mark.parametrize(
    "kw",
    [
        {"max_staleness": 3, "soft_staleness": 5},
        {"soft_factor": 0.0},
        {"soft_factor": 1.5},
        {"max_staleness": -1},
    ],
)
def test_bound_rejects_bad_config(kw):
    with pytest.raises(ValueError):
        StalenessBound(**kw)


def test_bound_rejects_negative_tau():
    with pytest.raises(ValueError):
        StalenessBound(max_staleness=3).check(-1)


@pytest.mark.parametrize("name", ["constant", "polynomial", "hinge", "exponential"])
def test_weights_over_a_tensor_equal_the_scalar_functions(name):
    import torch

    from fedasync.staleness import make_weight_fn, weights_of

    taus = torch.tensor([0, 1, 3, 4, 5, 9, 40])
    scalar = make_weight_fn(name, a=0.5, b=4)
    got = weights_of(name, taus, a=0.5, b=4)
    assert got.shape == taus.shape
    assert got.tolist() == pytest.approx([scalar(int(t)) for t in taus], rel=1e-6)


def test_weights_over_a_tensor_by_hand_and_bad_input():
    import torch

    from fedasync.errors import ConfigError
    from fedasync.staleness import weights_of

    # polynomial a = 1: 1/(τ+1); hinge a = 1, b = 2: 1, 1, 1, 1/2, 1/3
    assert weights_of("polynomial", torch.tensor([0, 1, 3]), a=1.0).tolist() == [1.0, 0.5, 0.25]
    hinge = weights_of("hinge", torch.arange(5), a=1.0, b=2)
    assert hinge.tolist() == pytest.approx([1.0, 1.0, 1.0, 0.5, 1 / 3])
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        weights_of("constant", torch.tensor([0, -1]))
    with pytest.raises(ConfigError, match="unknown staleness weight function"):
        weights_of("linear", torch.tensor([1]))


def test_the_bound_over_a_tensor_matches_check():
    import torch

    bound = StalenessBound(max_staleness=4, soft_staleness=2, soft_factor=0.25)
    taus = torch.tensor([0, 2, 3, 4, 5, 7])
    f = bound.factors(taus)
    assert f.tolist() == [bound.check(int(t)).factor for t in taus] == [1, 1, 0.25, 0.25, 0, 0]
    assert (f > 0).tolist() == [True, True, True, True, False, False]
    assert StalenessBound().factors(torch.tensor([100])).tolist() == [1.0]
