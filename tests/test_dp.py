"""DP-SGD on a silo (clients/dp.py) and its persistent accountant ledger (clients/privacy.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from clients.dp import make_compatible, sample_rate, train_local_dp
from clients.privacy import BudgetExhausted, PrivacyLedger, epsilon_of, ledger_path, merge
from medical_data.federation import SiloData
from medical_data.networks import build_network

ROOT = Path(__file__).parent.parent


def _data(n: int = 8, seed: int = 0) -> SiloData:
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(n, 1, 28, 28)).astype(np.float32)
    labels = rng.integers(0, 3, size=n).astype(np.int64)
    return SiloData(0, "s", images, labels, np.array([f"s{i}" for i in range(n)]))


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_network("cnn-small", 1, 3, (28, 28))


def _delta(model: torch.nn.Module, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach() - base[k] for k, v in model.state_dict().items()}


def _train_dp(model, data, **kw):
    """``train_local_dp`` on a classification silo; batch 16, lr 0.05, noise 1, clipping 1 and
    seed 0 unless ``kw`` says otherwise (``seed=None``: from the OS's entropy)."""
    args = dict(
        task="classification",
        batch_size=16,
        lr=0.05,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
    )
    return train_local_dp(model, data, **{**args, **kw})


def _clipped_mean_grad(base: dict[str, torch.Tensor], data: SiloData, clip: float) -> dict:
    """By hand: each sample's own gradient, clipped to L2 norm ``clip``, averaged."""
    model = _net()
    model.load_state_dict(base)
    names = [n for n, _ in model.named_parameters()]
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    x, y = torch.tensor(data.images), torch.tensor(data.labels)
    for i in range(len(data)):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        norm = torch.sqrt(sum((g**2).sum() for g in grads))
        factor = min(1.0, clip / (float(norm) + 1e-6))
        for n, g in zip(names, grads):
            total[n] += factor * g
    return {n: t / len(data) for n, t in total.items()}


def test_make_compatible_keeps_the_networks_and_their_names():
    for name, size in (("cnn-small", (28, 28)), ("resnet18", (64, 64))):
        net = build_network(name, 1, 3, size)
        assert make_compatible(net) is net  # GroupNorm already: nothing to replace


def test_make_compatible_refuses_a_fix_that_renames_parameters():
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
    with pytest.raises(ValueError, match="GroupNorm"):
        make_compatible(net)


def test_sample_rate_is_opacus_poisson_rate():
    assert sample_rate(160, 16) == 0.1
    assert sample_rate(150, 16) == 0.1  # 1/ceil(150/16)
    assert sample_rate(8, 32) == 1.0


def test_dp_training_keeps_state_dict_names_and_removes_hooks():
    # Prepare
    model, data = _net(), _data(40)
    names = list(model.state_dict())
    # Execute
    stats, history = _train_dp(model, data, steps=3)
    # Assert
    assert list(model.state_dict()) == names
    assert not any(k.startswith("_module.") for k in model.state_dict())
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    assert history == [(1.0, 1 / 3, 3)]  # q = 1/ceil(40/16)
    assert np.isfinite(stats["train_loss"]) and stats["train_dp_noise_multiplier"] == 1.0


def test_update_is_the_mean_of_per_sample_gradients_clipped_by_hand():
    """No noise, batch >= N (q = 1: every sample in the one step's batch), one SGD step of
    lr 1: the update must be minus the mean of each sample's gradient clipped to C."""
    # Prepare
    data, clip = _data(8), 0.01
    model = _net()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    expected = _clipped_mean_grad(base, data, clip)
    # Execute
    _train_dp(model, data, steps=1, batch_size=32, lr=1.0, noise_multiplier=0.0, max_grad_norm=clip)
    # Assert
    delta = _delta(model, base)
    for n, g in expected.items():
        torch.testing.assert_close(delta[n], -g, atol=1e-6, rtol=1e-4)
    norm = float(torch.sqrt(sum((d**2).sum() for d in delta.values())))
    assert norm <= clip * (1 + 1e-5)
    # without DP the same step moves far more than the clipping bound allows
    plain = _net()
    plain.load_state_dict(base)
    F.cross_entropy(plain(torch.tensor(data.images)), torch.tensor(data.labels)).backward()
    raw = float(torch.sqrt(sum((p.grad**2).sum() for p in plain.parameters())))
    assert raw > 10 * clip


def test_noise_has_the_dp_sgd_scale():
    """Same step with noise multiplier 1: update - clipped update ~ N(0, (lr sigma C / B)^2)
    in every coordinate (B = 8, the expected batch size)."""
    data, clip, sigma = _data(8), 0.01, 1.0
    model = _net()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    expected = _clipped_mean_grad(base, data, clip)
    runs = []
    for seed in (1, 2):
        model.load_state_dict(base)
        _train_dp(
            model,
            data,
            steps=1,
            batch_size=32,
            lr=1.0,
            noise_multiplier=sigma,
            max_grad_norm=clip,
            seed=seed,
        )
        d = _delta(model, base)
        runs.append(torch.cat([(d[n] + g).flatten() for n, g in expected.items()]))
    for noise in runs:
        assert float(noise.std()) == pytest.approx(sigma * clip / len(data), rel=0.05)
        assert abs(float(noise.mean())) < 3 * sigma * clip / len(data) / noise.numel() ** 0.5
    assert not torch.allclose(runs[0], runs[1])  # fresh noise per message


def test_unseeded_dp_training_differs_each_time():
    """In the ClientApp no seed is passed: sampling and noise come from the OS's entropy."""
    data = _data(40)
    deltas = []
    for _ in range(2):
        model = _net()
        base = {k: v.clone() for k, v in model.state_dict().items()}
        _train_dp(model, data, steps=2, seed=None)
        deltas.append(_delta(model, base)["head.weight"])
    assert not torch.allclose(deltas[0], deltas[1])


def test_ledger_across_messages_equals_one_accountant_of_every_step(tmp_path):
    """Messages of varying noise and sample rate, each recorded by a fresh ledger object (a
    fresh process per message in deployment) = opacus's RDPAccountant stepped once per step."""
    from opacus.accountants import RDPAccountant

    # Prepare
    messages = [[(1.0, 0.1, 10)], [(1.0, 0.1, 10)], [(1.3, 0.125, 4)], [(0.8, 0.1, 1)]]
    messages.append(_train_dp(_net(), _data(40), steps=5, noise_multiplier=1.1)[1])
    reference = RDPAccountant()
    for entries in messages:
        for sigma, q, n in entries:
            for _ in range(n):
                reference.step(noise_multiplier=sigma, sample_rate=q)
    # Execute
    path = tmp_path / "privacy" / "silo-0.sqlite"
    for job, entries in enumerate(messages):
        with PrivacyLedger(path) as ledger:
            ledger.record(entries, silo=0, job_id=job, delta=1e-5, mechanism="rdp", budget=None)
    # Assert
    with PrivacyLedger(path) as ledger:
        eps = ledger.epsilon(1e-5, "rdp")
        assert eps == pytest.approx(reference.get_epsilon(delta=1e-5), rel=1e-12)
        assert sum(n for _, _, n in ledger.history()) == 10 + 10 + 4 + 1 + 5
        mode = ledger._db.execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_merge_sums_steps_of_equal_noise_and_rate():
    assert merge([(1.0, 0.1, 2), (2.0, 0.1, 1), (1.0, 0.1, 3)]) == [(1.0, 0.1, 5), (2.0, 0.1, 1)]


def test_gdp_refuses_a_mixed_ledger():
    assert epsilon_of([(1.0, 0.1, 5), (1.0, 0.1, 5)], 1e-5, "gdp") > 0
    with pytest.raises(ValueError, match="rdp or prv"):
        epsilon_of([(1.0, 0.1, 5), (2.0, 0.1, 5)], 1e-5, "gdp")


def test_ledger_refuses_past_the_budget_and_writes_nothing(tmp_path):
    # Prepare
    msg = [(1.0, 0.1, 10)]
    one = epsilon_of(msg, 1e-5, "rdp")
    two = epsilon_of(msg * 2, 1e-5, "rdp")
    budget = (one + two) / 2  # room for one message, not two
    # Execute
    with PrivacyLedger(tmp_path / "l.sqlite") as ledger:
        assert ledger.check(msg, delta=1e-5, mechanism="rdp", budget=budget) == 0.0
        spent = ledger.record(msg, silo=0, job_id=0, delta=1e-5, mechanism="rdp", budget=budget)
        with pytest.raises(BudgetExhausted) as before:
            ledger.check(msg, delta=1e-5, mechanism="rdp", budget=budget)
        with pytest.raises(BudgetExhausted):
            ledger.record(msg, silo=0, job_id=1, delta=1e-5, mechanism="rdp", budget=budget)
        # Assert
        assert spent == pytest.approx(one)
        assert ledger.history() == msg  # the refused message left no trace
        assert before.value.spent == pytest.approx(one) and before.value.would_be > budget
        assert "budget exhausted" in str(before.value)


def test_ledger_survives_a_crash_between_and_during_messages(tmp_path):
    """A process records message 0, then dies inside message 1's transaction: after a
    restart the ledger holds message 0 exactly and nothing of message 1."""
    path = tmp_path / "silo-1.sqlite"
    script = f"""
import os
from clients.privacy import PrivacyLedger
ledger = PrivacyLedger({str(path)!r})
ledger.record([(1.0, 0.1, 10)], silo=1, job_id=0, delta=1e-5, mechanism="rdp", budget=None)
ledger._db.execute("BEGIN IMMEDIATE")
ledger._db.execute("INSERT INTO steps (noise_multiplier, sample_rate, steps, silo, job_id, "
                   "recorded_at) VALUES (1.0, 0.1, 10, 1, 1, 0)")
os._exit(9)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=120)
    assert proc.returncode == 9
    with PrivacyLedger(path) as ledger:
        assert ledger.history() == [(1.0, 0.1, 10)]
        assert ledger.epsilon(1e-5) == pytest.approx(epsilon_of([(1.0, 0.1, 10)], 1e-5, "rdp"))


def test_ledger_path_from_node_config_first(tmp_path):
    node = {"partition-id": 2, "privacy-db": str(tmp_path / "node.sqlite")}
    assert ledger_path(node, {"privacy-dir": "/x"}, 2) == tmp_path / "node.sqlite"
    assert ledger_path({}, {"privacy-dir": str(tmp_path)}, 2) == tmp_path / "silo-2.sqlite"
    with pytest.raises(ValueError, match="privacy-db"):
        ledger_path({}, {}, 2)


def test_dp_and_plain_training_take_the_same_training_arguments():
    """The ClientApp builds the arguments both trainers share once; each must accept all."""
    import inspect

    from clients.app import training_kwargs
    from clients.dp import train_private
    from clients.local import train_local
    from protocol.config import ClientConfig

    common = training_kwargs(ClientConfig(), task="classification", steps=3, device=None)
    inspect.signature(train_local).bind(None, None, seed=0, **common)
    inspect.signature(train_private).bind(None, None, None, ledger=None, silo=0, job_id=0, **common)
    shared = set(inspect.signature(train_local).parameters) & set(
        inspect.signature(train_private).parameters
    )
    assert shared - {"model", "data"} == set(common), "a shared argument is passed one way only"
