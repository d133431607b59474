import numpy as np
import pytest
import torch

from clients.local import train_local
from clients.unlearn import erase_pga, erase_relabel, forget_signature
from fedasync import tensors as T
from fedasync.unlearning import l2_distance
from medical_data import verification as verify
from medical_data.federation import SiloData, build_federation
from medical_data.networks import build_network
from medical_data.tasks import evaluate

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
    # per-sample losses and evaluate's batch means: two summation orders, so a tolerance
    assert losses.mean() == pytest.approx(
        evaluate(model, fed.silos[0], task=TASK)["loss"], rel=1e-4
    )


class _Constant(torch.nn.Module):
    """Predicts ``label`` everywhere: logits ``(b, classes)`` or ``(b, classes, H, W)``."""

    def __init__(self, label, classes=2, segmentation=True):
        super().__init__()
        self.label, self.classes, self.segmentation = label, classes, segmentation

    def forward(self, x):
        shape = (
            (len(x), self.classes, *x.shape[2:]) if self.segmentation else (len(x), self.classes)
        )
        out = torch.zeros(shape)
        out[:, self.label] = 1.0
        return out


class _Threshold(torch.nn.Module):
    """Foreground where the image is above 0.5, except in columns ``blind`` and beyond."""

    def __init__(self, blind=None):
        super().__init__()
        self.blind = blind

    def forward(self, x):
        fg = (x[:, 0] > 0.5).float()
        if self.blind is not None:
            fg[:, :, self.blind :] = 0.0
        return torch.stack([1.0 - fg, fg], dim=1)


def _masks_as_images():
    """Three 4x4 images that show their own mask (1.0 on nucleus pixels); masks: 3 nucleus
    pixels (2 in columns 2-3), 2 (1 in columns 2-3), none."""
    masks = np.zeros((3, 4, 4), np.int64)
    masks[0, 0, 0] = masks[0, 0, 3] = masks[0, 1, 3] = 1
    masks[1, 2, 1] = masks[1, 3, 2] = 1
    images = masks[:, None].astype(np.float32)
    return SiloData(0, "seg", images, masks, np.array(["a", "b", "c"]))


def test_asr_segmentation_by_hand():
    # Prepare
    data = _masks_as_images()

    # Execute
    erased = verify.attack_success_rate(_Constant(0), data, 0, task="segmentation", batch_size=2)
    clean = verify.attack_success_rate(_Threshold(), data, 0, task="segmentation", batch_size=2)
    half = verify.attack_success_rate(
        _Threshold(blind=2), data, 0, task="segmentation", batch_size=2
    )
    flood = verify.attack_success_rate(_Constant(1), data, 1, task="segmentation")

    # Assert
    assert erased == pytest.approx(1.0)  # every nucleus pixel vanished
    assert clean == pytest.approx(0.0)  # the true masks
    assert half == pytest.approx(3 / 5)  # pooled pixels, not the mean of 2/3 and 1/2
    assert flood == pytest.approx(1.0)  # of the 43 background pixels, all predicted nucleus


def test_asr_classification_unchanged_by_default():
    # Prepare: labels are ignored, as before (a triggered set holds no target labels)
    data = _data(5)

    # Execute
    hit = verify.attack_success_rate(_Constant(2, classes=3, segmentation=False), data, 2)
    miss = verify.attack_success_rate(_Constant(2, classes=3, segmentation=False), data, 0)

    # Assert
    assert hit == pytest.approx(1.0)
    assert miss == pytest.approx(0.0)


def test_asr_rejects_unknown_task_and_nothing_to_flip():
    # Prepare
    data = _masks_as_images()
    empty = verify.subset(data, np.array([2]))  # no nucleus pixel

    # Execute / Assert
    with pytest.raises(ValueError, match="task"):
        verify.attack_success_rate(_Constant(0), data, 0, task="detection")
    with pytest.raises(ValueError, match="other than 0"):
        verify.attack_success_rate(_Constant(0), empty, 0, task="segmentation")


def test_verification_report_segmentation_asr_per_pixel():
    # Prepare
    data = _masks_as_images()

    # Execute
    r = verify.verification_report(
        _Constant(0), forget=data, test=data, triggered=data, target_label=0, task="segmentation"
    )

    # Assert
    assert r["asr"] == pytest.approx(1.0)  # per pixel (counted per image: 48 hits / 3 = 16)
    assert r["test_accuracy"] == pytest.approx(0.0)  # no nucleus predicted: Dice 0
