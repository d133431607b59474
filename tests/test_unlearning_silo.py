import numpy as np
import pytest
import torch

from clients import verify
from clients.local import evaluate, train_local
from clients.unlearn import erase_pga, erase_relabel, forget_signature
from fedasync import tensors as T
from fedasync.unlearning import l2_distance
from medical_data.federation import SiloData, build_federation
from medical_data.networks import build_network

TASK = "classification"


@pytest.fixture(scope="module")
def trained():
    """cnn-small trained on silo 0 (the forget set) of a small real brain-tissue federation."""
    fed = build_federation("brain-tissue", 3, 0, max_samples=300)
    torch.manual_seed(0)
    model = build_network("cnn-small", 1, 3, (28, 28))
    train_local(
        model, fed.silos[0], task=TASK, steps=100, batch_size=32, lr=0.1, momentum=0.9, seed=0
    )
    return fed, T.clone(model.state_dict())


def _model(state):
    model = build_network("cnn-small", 1, 3, (28, 28))
    model.load_state_dict(state)
    return model


def test_erase_pga_raises_forget_loss_within_radius(trained):
    # Prepare
    fed, state = trained
    model, forget = _model(state), fed.silos[0]
    loss_before = evaluate(model, forget, task=TASK)["loss"]

    # Execute
    m = erase_pga(
        model, forget, reference=state, radius=0.25, steps=20, lr=0.03, batch_size=32,
        task=TASK, seed=0,
    )  # fmt: skip

    # Assert
    assert m["forget_loss_before"] == pytest.approx(loss_before)
    assert m["forget_loss"] > loss_before + 0.2
    assert l2_distance(model.state_dict(), state) <= 0.25 + 1e-5
    assert m["distance"] == pytest.approx(0.25, rel=1e-4)  # the ball was binding
    assert m["steps"] == 20 and m["stopped_early"] == 0.0


def test_erase_pga_stops_at_loss_cap(trained):
    # Prepare
    fed, state = trained
    model = _model(state)

    # Execute
    m = erase_pga(
        model, fed.silos[0], reference=state, radius=10.0, steps=50, lr=0.05, batch_size=32,
        task=TASK, seed=0, loss_cap=1.5,
    )  # fmt: skip

    # Assert
    assert m["stopped_early"] == 1.0 and m["steps"] < 50


def test_erase_relabel_lowers_forget_accuracy(trained):
    # Prepare
    fed, state = trained
    model, forget = _model(state), fed.silos[0]

    # Execute
    m = erase_relabel(
        model, forget, retain=None, steps=30, lr=0.05, batch_size=32, num_classes=3,
        task=TASK, seed=0,
    )  # fmt: skip

    # Assert
    assert m["forget_score"] < m["forget_score_before"] - 0.2
    assert m["forget_score"] == pytest.approx(evaluate(model, forget, task=TASK)["score"])


def test_forget_signature_is_orthonormal_over_trainable_parameters(trained):
    # Prepare
    fed, state = trained
    model = _model(state)
    names = [n for n, _ in model.named_parameters()]
    d = sum(p.numel() for p in model.parameters())

    # Execute
    sig = forget_signature(model, fed.silos[0], task=TASK, batches=6, rank=4, seed=0)

    # Assert
    assert sig.names == [n for n in model.state_dict() if n in names]
    assert sig.basis.shape[0] == d and 1 <= sig.rank <= 4
    assert torch.allclose(sig.basis.T @ sig.basis, torch.eye(sig.rank), atol=1e-5)
    assert all(p.grad is None for p in model.parameters())


def test_calibration_removes_relearning_direction(trained):
    # Prepare: a relearning update (training on the forget set again) at the erased model
    fed, state = trained
    model, forget = _model(state), fed.silos[0]
    erase_pga(
        model, forget, reference=state, radius=0.25, steps=20, lr=0.03, batch_size=32,
        task=TASK, seed=0,
    )  # fmt: skip
    erased = T.clone(model.state_dict())
    sig = forget_signature(model, forget, task=TASK, energy=0.999)
    train_local(model, forget, task=TASK, steps=5, batch_size=32, lr=0.02, seed=1)
    delta = T.sub(model.state_dict(), erased)

    # Execute
    projected = sig.project_out(delta)

    # Assert
    assert sig.overlap(delta) > 0.5
    assert sig.overlap(projected) < 1e-3
    relearned = evaluate(_model(T.add(erased, delta)), forget, task=TASK)["loss"]
    calibrated = evaluate(_model(T.add(erased, projected)), forget, task=TASK)["loss"]
    baseline = evaluate(_model(erased), forget, task=TASK)["loss"]
    assert baseline - calibrated < 0.2 * (baseline - relearned)


def _data(n):
    return SiloData(
        0, "x", np.zeros((n, 1, 4, 4), np.float32), np.zeros(n, np.int64), np.array(["i"] * n)
    )


def test_mia_auc_by_hand(monkeypatch):
    # Prepare: losses keyed by set size (members 2, non-members 3)
    losses = {}
    monkeypatch.setattr(verify, "predict_losses", lambda model, data, task, **kw: losses[len(data)])

    # Execute
    losses.update({2: np.array([0.1, 0.2]), 3: np.array([0.3, 0.4, 0.5])})
    memorised = verify.mia_auc(None, _data(2), _data(3), TASK)
    losses.update({2: np.array([0.1, 0.3]), 3: np.array([0.1, 0.3, 0.2])})
    # pairs (member wins = lower loss): 0.1: tie .5, win, win; 0.3: lose, tie .5, lose -> 3/6
    same = verify.mia_auc(None, _data(2), _data(3), TASK)

    # Assert
    assert memorised == pytest.approx(1.0)
    assert same == pytest.approx(0.5)


def test_verification_report_on_trained_model(trained):
    # Prepare
    from medical_data.backdoor import triggered_set

    fed, state = trained
    model = _model(state)
    trig = triggered_set(fed.test, target_label=0)

    # Execute
    r = verify.verification_report(
        model, forget=fed.silos[0], test=fed.test, triggered=trig, target_label=0, task=TASK
    )
    losses = verify.predict_losses(model, fed.silos[0], TASK)

    # Assert
    assert set(r) == {"forget_accuracy", "test_accuracy", "asr", "mia_auc"}
    assert r["forget_accuracy"] > r["test_accuracy"]  # trained on the forget silo only
    assert r["mia_auc"] > 0.5
    assert 0.0 <= r["asr"] <= 1.0
    assert losses.shape == (len(fed.silos[0]),)
    assert losses.mean() == pytest.approx(evaluate(model, fed.silos[0], task=TASK)["loss"])
