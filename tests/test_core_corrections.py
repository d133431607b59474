import pytest
import torch

from fedasync.checkpoint import load_checkpoint, save_checkpoint
from fedasync.corrections import (
    ErrorFeedback,
    delay_compensate,
    delay_compensate_delta,
    identity,
    topk,
)


def _x(*v):
    return {"w": torch.tensor(list(v), dtype=torch.float64)}


def test_delay_compensate_by_hand():
    # Prepare
    g, w_now, w_base = _x(1.0, -2.0), _x(0.5, 1.0), _x(0.0, 2.0)

    # Execute
    out = delay_compensate(g, w_now, w_base, lam=0.5)

    # Assert: g² = [1, 4]; w_now - w_base = [0.5, -1]; 0.5 * g² * diff = [0.25, -2]
    assert out["w"].tolist() == [1.25, -4.0]
    assert g["w"].tolist() == [1.0, -2.0]


def test_delay_compensate_delta_by_hand():
    # Prepare: Δ = -lr*g with lr = 0.1 and g = [1, -2]
    delta, w_now, w_base = _x(-0.1, 0.2), _x(0.5, 1.0), _x(0.0, 2.0)

    # Execute
    out = delay_compensate_delta(delta, w_now, w_base, lam=0.5, lr=0.1)

    # Assert: -lr * [1.25, -4] = [-0.125, 0.4]
    #       = Δ - (λ/lr)·Δ²·diff = [-0.1 - 5*0.01*0.5, 0.2 - 5*0.04*(-1)]
    assert out["w"].tolist() == pytest.approx([-0.125, 0.4], abs=1e-12)
    assert torch.allclose(out["w"], -0.1 * delay_compensate(_x(1.0, -2.0), w_now, w_base, 0.5)["w"])


def test_delay_compensation_is_identity_without_staleness_or_lambda():
    d, w = _x(0.3, -0.7), _x(1.0, 2.0)
    assert torch.equal(delay_compensate_delta(d, w, w, lam=1.0, lr=0.1)["w"], d["w"])
    assert torch.equal(delay_compensate(d, w, _x(0.0, 0.0), lam=0.0)["w"], d["w"])


def test_delay_compensation_keeps_integer_buffers():
    g = {"w": torch.tensor([1.0]), "n": torch.tensor(4)}
    w1 = {"w": torch.tensor([2.0]), "n": torch.tensor(9)}
    w0 = {"w": torch.tensor([1.0]), "n": torch.tensor(8)}
    assert delay_compensate(g, w1, w0, 1.0)["n"].item() == 4
    assert delay_compensate_delta(g, w1, w0, 1.0, 0.5)["n"].item() == 4


def test_topk_keeps_largest_and_breaks_ties_by_index():
    # Prepare
    t = torch.tensor([[1.0, -3.0], [2.0, 0.5]])

    # Execute / Assert
    assert topk(t, 0.5).tolist() == [[0.0, -3.0], [2.0, 0.0]]
    assert topk(t, 0.1).tolist() == [[0.0, -3.0], [0.0, 0.0]]  # ceil(0.4) = 1
    assert topk(torch.tensor([1.0, -1.0, 1.0, -1.0]), 0.5).tolist() == [1.0, -1.0, 0.0, 0.0]
    assert int((topk(torch.arange(1.0, 11.0), 0.3) != 0).sum()) == 3  # 0.3*10 is not 4
    assert torch.equal(topk(t, 1.0), t) and torch.equal(identity(t), t)
    with pytest.raises(ValueError):
        topk(t, 0.0)


def test_error_feedback_two_steps_by_hand():
    # Prepare
    ef = ErrorFeedback(ratio=0.5)

    # Execute / Assert step 1: keep -3 and 2; residual [1, 0, 0, 0.5]
    s1 = ef.apply("silo", _x(1.0, -3.0, 2.0, 0.5))
    r1 = ef.residual("silo")
    assert s1["w"].tolist() == [0.0, -3.0, 2.0, 0.0]
    assert r1 is not None and r1["w"].tolist() == [1.0, 0.0, 0.0, 0.5]

    # step 2: corrected = [1,1,-0.5,0.25] + [1,0,0,0.5] = [2, 1, -0.5, 0.75]; keep 2 and 1
    s2 = ef.apply("silo", _x(1.0, 1.0, -0.5, 0.25))
    r2 = ef.residual("silo")
    assert s2["w"].tolist() == [2.0, 1.0, 0.0, 0.0]
    assert r2 is not None and r2["w"].tolist() == [0.0, 0.0, -0.5, 0.75]

    # keys are independent; reset forgets
    assert ef.residual("other") is None
    ef.reset("silo")
    assert ef.residual("silo") is None


def test_error_feedback_ratio_one_is_lossless():
    # Prepare
    ef = ErrorFeedback(ratio=1.0)
    x = {"w": torch.tensor([0.1, -0.2, 0.3]), "n": torch.tensor(2)}

    # Execute
    sent = [ef.apply("a", x) for _ in range(3)]

    # Assert
    r = ef.residual("a")
    assert r is not None and torch.equal(r["w"], torch.zeros(3))
    assert all(torch.equal(s["w"], x["w"]) and s["n"].item() == 2 for s in sent)


def test_error_feedback_round_trip(tmp_path):
    # Prepare
    ef = ErrorFeedback(ratio=0.25)
    gen = torch.Generator().manual_seed(0)
    for key in ("a", "b"):
        ef.apply(key, {"w": torch.randn(8, generator=gen)})
    nxt = {"w": torch.randn(8, generator=gen)}

    # Execute
    save_checkpoint(tmp_path / "ef.pt", ef.state_dict())
    ef2 = ErrorFeedback(ratio=1.0)
    ef2.load_state_dict(load_checkpoint(tmp_path / "ef.pt"))

    # Assert
    assert ef2.ratio == 0.25 and ef2.keys() == ["a", "b"]
    assert torch.equal(ef.apply("a", nxt)["w"], ef2.apply("a", nxt)["w"])
    r, r2 = ef.residual("a"), ef2.residual("a")
    assert r is not None and r2 is not None and torch.equal(r["w"], r2["w"])


def test_delay_error_feedback_by_hand():
    from fedasync.corrections import DelayErrorFeedback

    ef = DelayErrorFeedback(beta=0.5)
    g1 = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor([3])}
    g2 = {"w": torch.tensor([3.0, 0.0]), "n": torch.tensor([4])}
    first = ef.apply("stage0", g1)
    assert torch.equal(first["w"], g1["w"])  # nothing to feed back at the first step
    assert ef.residual("stage0", g2)["w"].tolist() == [2.0, -2.0]
    out = ef.apply("stage0", g2)
    # g2 + 0.5·(g2 − g1) = [3 + 1, 0 − 1]
    assert out["w"].tolist() == [4.0, -1.0]
    assert out["n"].tolist() == [4]  # integer tensors pass through
    assert g2["w"].tolist() == [3.0, 0.0]  # inputs not mutated
    # keys are independent; beta 0 is no correction
    assert torch.equal(ef.apply("stage1", g2)["w"], g2["w"])
    zero = DelayErrorFeedback(beta=0.0)
    zero.apply("k", g1)
    assert torch.equal(zero.apply("k", g2)["w"], g2["w"])


def test_delay_error_feedback_state_round_trip_and_bad_input():
    from fedasync.corrections import DelayErrorFeedback

    ef = DelayErrorFeedback(beta=1.0)
    ef.apply("a", {"w": torch.tensor([1.0])})
    other = DelayErrorFeedback()
    other.load_state_dict(ef.state_dict())
    g = {"w": torch.tensor([2.0])}
    assert torch.equal(other.apply("a", g)["w"], ef.apply("a", g)["w"])
    with pytest.raises(KeyError):
        ef.apply("a", {"v": torch.tensor([1.0])})
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError):
            DelayErrorFeedback(beta=bad)
    ef.reset("a")
    assert ef.residual("a", g) is None


def test_error_feedback_takes_a_compression_function():
    from fedasync.corrections import ErrorFeedback

    def sign_of(t, ratio):  # keep only the sign, scaled to the mean magnitude (1-bit SGD)
        return t.sign() * t.abs().mean()

    ef = ErrorFeedback(0.5, compress=sign_of)
    x = {"w": torch.tensor([3.0, -1.0])}
    sent = ef.apply("silo", x)
    assert sent["w"].tolist() == [2.0, -2.0]
    assert ef.residual("silo")["w"].tolist() == [1.0, 1.0]  # x − C(x), fed back next time
    assert ErrorFeedback(0.5).compress is not sign_of  # top-k by default
