import pytest
import torch

from fedasync.checkpoint import load_checkpoint, save_checkpoint
from fedasync.optim import ServerOptimizer


def _x(*v):
    return {"w": torch.tensor(list(v), dtype=torch.float64)}


def test_sgd_step():
    out = ServerOptimizer("sgd", lr=0.5).step(_x(1.0, 2.0), _x(2.0, -4.0))
    assert out["w"].tolist() == [2.0, 0.0]


def test_momentum_two_steps_by_hand():
    # Prepare
    opt = ServerOptimizer("momentum", lr=0.5, momentum=0.9)

    # Execute
    x1 = opt.step(_x(1.0), _x(2.0))  # m = 2;               x = 1 + 0.5*2 = 2
    x2 = opt.step(x1, _x(-1.0))  # m = 0.9*2 - 1 = 0.8;  x = 2 + 0.5*0.8 = 2.4

    # Assert
    assert x1["w"].tolist() == [2.0]
    assert x2["w"].item() == pytest.approx(2.4, abs=1e-12)
    assert opt.state_dict()["m"]["w"].item() == pytest.approx(0.8, abs=1e-12)


def test_fedadam_one_step_by_hand():
    # Prepare
    opt = ServerOptimizer("adam", lr=0.1, betas=(0.9, 0.99), eps=1e-3)

    # Execute
    out = opt.step(_x(0.0, 1.0), _x(0.5, -2.0))

    # Assert: m = 0.1*Δ = [0.05, -0.2]; v = 0.01*Δ² = [0.0025, 0.04]; sqrt(v) = [0.05, 0.2]
    # no bias correction: x + 0.1 * m / (sqrt(v) + 1e-3)
    expected = [0.0 + 0.1 * 0.05 / 0.051, 1.0 + 0.1 * -0.2 / 0.201]
    assert out["w"].tolist() == pytest.approx(expected, abs=1e-12)
    sd = opt.state_dict()
    assert sd["m"]["w"].tolist() == pytest.approx([0.05, -0.2], abs=1e-12)
    assert sd["v"]["w"].tolist() == pytest.approx([0.0025, 0.04], abs=1e-12)


def test_optimizer_keeps_integer_buffers_and_does_not_mutate():
    # Prepare
    x = {"w": torch.tensor([1.0]), "n": torch.tensor(3)}
    d = {"w": torch.tensor([1.0]), "n": torch.tensor(50)}

    # Execute
    out = ServerOptimizer("adam").step(x, d)

    # Assert
    assert out["n"].item() == 3 and x["w"].item() == 1.0


def test_optimizer_round_trip(tmp_path):
    # Prepare
    gen = torch.Generator().manual_seed(0)
    x = {"a": torch.randn(3, generator=gen), "b": torch.randn(2, 2, generator=gen)}
    ds = [{k: torch.randn(v.shape, generator=gen) for k, v in x.items()} for _ in range(3)]
    opt = ServerOptimizer("adam", lr=0.05, betas=(0.8, 0.95), eps=1e-4)
    x1 = opt.step(x, ds[0])

    # Execute
    save_checkpoint(tmp_path / "opt.pt", opt.state_dict())
    restored = ServerOptimizer()
    restored.load_state_dict(load_checkpoint(tmp_path / "opt.pt"))

    # Assert
    assert (restored.kind, restored.lr, restored.betas, restored.eps) == (
        "adam",
        0.05,
        (0.8, 0.95),
        1e-4,
    )
    assert restored.steps == 1
    ya, yb = opt.step(x1, ds[1]), restored.step(x1, ds[1])
    assert all(torch.equal(ya[k], yb[k]) for k in x)


@pytest.mark.parametrize("kw", [{"kind": "rmsprop"}, {"lr": 0.0}, {"momentum": 1.0}, {"eps": 0.0}])
def test_optimizer_rejects_bad_config(kw):
    with pytest.raises(ValueError):
        ServerOptimizer(**kw)
