"""DP-SGD in the server loop (real ClientApp, in-process grid): every reply reports the silo's
epsilon, a silo out of budget refuses work and is stopped, the ledger outlives the run."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from inprocess import InProcessGrid

from clients.app import app as client_app
from clients.dp import sample_rate
from clients.privacy import PrivacyLedger, epsilon_of
from fedasync.events import read_events
from protocol.config import build_silos
from server.app import run_server

DP = ("client.dp.enabled=true", "client.dp.noise_multiplier=1.0")


def _run(cfg):
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    return run_server(InProcessGrid(client_app, cfg.silos.count), cfg, run_dir), run_dir


def _messages_within(cfg, silo: int, budget: float) -> int:
    """How many train messages silo ``silo`` can afford, worked out from its sample rate."""
    n = len(build_silos(cfg.data, cfg.silos.count, cfg.run.seed).silos[silo])
    one = (1.0, sample_rate(n, cfg.client.batch_size), cfg.client.local_steps)
    k = 0
    while epsilon_of([one] * (k + 1), cfg.client.dp.delta, "rdp") <= budget:
        k += 1
    return k


def test_every_reply_reports_the_silos_epsilon(small_cfg):
    # Prepare
    cfg = small_cfg("run.max_versions=6", *DP)
    # Execute
    summary, run_dir = _run(cfg)
    # Assert
    assert summary["versions"] == 6 and summary["updates_rejected_total"] == 0  # same names
    updates = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "update"]
    for silo in range(3):
        eps = [e["dp_epsilon"] for e in updates if e["silo"] == silo]
        assert eps and eps == sorted(eps) and eps[0] > 0
        with PrivacyLedger(run_dir / "privacy" / f"silo-{silo}.sqlite") as ledger:
            rows = ledger.history()  # one row a message; the last may still have been in flight
        assert len(eps) <= len(rows) <= len(eps) + 1 and all(n == 2 for _, _, n in rows)
        assert epsilon_of(rows[: len(eps)], cfg.client.dp.delta, "rdp") == pytest.approx(eps[-1])
        assert summary["per_silo"][str(silo)]["dp_epsilon"] == eps[-1]


@pytest.mark.parametrize("mode", ["fedasync", "sync"])
def test_silo_out_of_budget_refuses_and_is_stopped(small_cfg, caplog, mode):
    # Prepare: 3.0 affords silo 0 (162 samples, q = 1/11) 3 messages, silos 1 and 2 (q = 0.1) 2
    budget = 3.0
    cfg = small_cfg(
        "run.max_versions=100", f"server.mode={mode}", *DP, f"client.dp.epsilon_budget={budget}"
    )
    expected = {s: _messages_within(cfg, s, budget) for s in range(3)}
    assert min(expected.values()) >= 1
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedasync.server"):
        summary, run_dir = _run(cfg)
    # Assert
    events = read_events(run_dir / "metrics.jsonl")
    for silo in range(3):
        stats = summary["per_silo"][str(silo)]
        assert stats["stopped"] == "privacy_budget_exhausted"
        assert stats["accepted"] == expected[silo] and stats["rejected"] == 0
        assert stats["dp_epsilon"] <= budget
        (stop,) = [e for e in events if e["event"] == "silo_stopped" and e["silo"] == silo]
        after = [e for e in events if e["event"] == "update" and e["silo"] == silo]
        assert all(e["t"] <= stop["t"] for e in after)
        stopped_lines = [r for r in caplog.records if f"silo {silo} stopped training" in r.message]
        assert len(stopped_lines) == 1 and "budget exhausted" in stopped_lines[0].message
    assert summary["updates_rejected_total"] == 0  # a refusal is not a fault
    assert summary["versions"] < 100  # the run ended: nobody left to train


def test_ledger_carries_epsilon_into_the_next_run(small_cfg):
    # Prepare: a first run of the same name leaves the silos' ledgers in <run>/privacy/
    first, run_dir = _run(small_cfg("run.max_versions=3", *DP))
    spent = {s: v["dp_epsilon"] for s, v in first["per_silo"].items() if "dp_epsilon" in v}
    # Execute: a fresh run (not a resume) of the same name, same data
    _run(small_cfg("run.max_versions=3", *DP))
    # Assert: each silo's first reply already counts the first run's steps
    updates = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "update"]
    for silo, eps in spent.items():
        first_again = next(e["dp_epsilon"] for e in updates if e["silo"] == int(silo))
        assert first_again > eps


def test_dp_config_is_validated(small_cfg):
    with pytest.raises(ValueError, match="client.dp.max_grad_norm"):
        small_cfg(*DP, "client.dp.max_grad_norm=0")
    with pytest.raises(ValueError, match="client.dp.accountant"):
        small_cfg(*DP, "client.dp.accountant=moments")
