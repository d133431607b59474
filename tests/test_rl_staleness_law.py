"""The pure pieces of benchmarks/rl_staleness_law.py: bias estimator, fits, collapse detector."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "rl_staleness_law.py"
_spec = importlib.util.spec_from_file_location("rl_staleness_law", _PATH)
law = importlib.util.module_from_spec(_spec)
sys.modules["rl_staleness_law"] = law
_spec.loader.exec_module(law)


def test_coefficient_of_variation():
    assert law.coefficient_of_variation([2.0, 2.0, 2.0]) == 0.0
    assert law.coefficient_of_variation([1.0, 3.0]) == pytest.approx(0.5)
    assert math.isnan(law.coefficient_of_variation([1.0]))


def test_split_bias_without_noise_is_the_norm():
    v = torch.tensor([3.0, 4.0])
    r = law.split_bias(v, v.clone())
    assert r == {"bias": 5.0, "floor": 0.0, "bias_db": 5.0}


def test_split_bias_removes_the_noise_on_average():
    torch.manual_seed(0)
    bias = torch.zeros(400)
    bias[0] = 1.0
    raw, db = [], []
    for _ in range(200):
        r = law.split_bias(bias + torch.randn(400) * 0.05, bias + torch.randn(400) * 0.05)
        raw.append(r["bias"])
        db.append(r["bias_db"])
    # the raw norm is inflated by the noise (||noise|| ≈ 0.05·sqrt(400/2) = 0.71), the
    # debiased one is not
    assert sum(raw) / len(raw) > 1.15
    assert sum(db) / len(db) == pytest.approx(1.0, abs=0.08)


def test_loglog_fit_recovers_exponents():
    rows = [(s, e, 3.0 * s**0.5 * e**1.0) for s in (1, 2, 4, 8) for e in (1e-4, 1e-3, 1e-2)]
    p, q, c = law.loglog_fit(rows)
    assert p == pytest.approx(0.5)
    assert q == pytest.approx(1.0)
    assert math.exp(c) == pytest.approx(3.0)


def test_grad_spike():
    assert law.grad_spike([1.0, 1.2, 0.9, 1.1, 1.0, 1.0, 1.3]) is None
    assert law.grad_spike([1.0, 1.2, 0.9, 1.1, 1.0, 1.0, 15.0]) == 6
    # zero norms (no learning signal) do not count towards the median
    assert law.grad_spike([1.0, 0.0, 0.0, 0.0, 0.0, 2.0, 15.0]) is None


def test_collapse_flags():
    stable = law.collapse_flags([0.8, 0.82, 0.78, 0.79], [0.3] * 10, [1.0] * 10)
    assert not stable["collapsed"] and not stable["entropy_floor"]
    assert stable["acc_drop"] == pytest.approx(0.82 - 0.785)
    gone = law.collapse_flags([0.8, 0.6, 0.2, 0.1], [0.01] * 10, [1.0] * 9 + [50.0])
    assert gone["collapsed"] and gone["reward_drop"]
    assert gone["entropy_floor"] and gone["grad_spike"] and gone["grad_spike_step"] == 9
    # entropy and spikes do not decide
    assert not law.collapse_flags([0.8, 0.8], [0.0] * 5, [1.0] * 9 + [50.0])["collapsed"]


def test_best_threshold():
    acc, t = law.best_threshold([1, 2, 3, 4], [False, False, True, True])
    assert acc == 1.0 and 2 < t < 3
    # ties cannot be split
    acc, _ = law.best_threshold([0, 0, 1, 1], [False, True, True, True])
    assert acc == 0.75
    acc, t = law.best_threshold([1, 2], [False, False])
    assert acc == 1.0 and t == math.inf


def test_spearman():
    assert law.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert law.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert law.spearman([1, 1, 2], [5, 6, 7]) == pytest.approx(math.sqrt(3) / 2)


def test_stale_gradient_equals_on_policy_gradient_at_zero_staleness():
    from trainers.rl.policy import PolicyConfig, TinyLM
    from trainers.rl.tasks import VOCAB_SIZE, make_task

    torch.manual_seed(0)
    pol = TinyLM(PolicyConfig(vocab_size=VOCAB_SIZE, d_model=16, n_layers=1, n_heads=2))
    task = make_task("sort", max_len=3)
    groups = law.gen_groups(pol, task, 0, range(4), 0, 4)
    for g in groups:  # an untrained policy earns nothing: give the groups a signal
        for i, t in enumerate(g.trajectories):
            t.reward = float(i % 2)
    g = law.surrogate_grads(pol, groups, ("on", "none", "tis"), chunk=2)
    for h in range(2):
        assert torch.equal(g["on"][h], g["none"][h])
        # the behaviour weight min(π/μ, C) is 1 on fresh samples
        assert torch.allclose(g["on"][h], g["tis"][h], atol=1e-6)
    # two chunks of two groups: one per half, and they differ (different prompts)
    assert float(g["on"][0].norm()) > 0 and not torch.equal(g["on"][0], g["on"][1])


def test_loglog_slope():
    assert law.loglog_slope([(x, 2 * x**0.7) for x in (0.1, 1.0, 3.0, 10.0)]) == pytest.approx(0.7)
