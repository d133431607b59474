"""Central (server-side) DP: clip-then-noise in both aggregators, per-silo accounting against
opacus, and the server loop's ledger, budget and summary (real ClientApp, in-process grid)."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
import torch
from inprocess import InProcessGrid

from clients.app import app as client_app
from fedasync import FedAsyncAggregator, FedBuffAggregator, GaussianMechanism, Update
from fedasync import gaussian_epsilon as eps_of
from fedasync.events import read_events
from fedasync.staleness import make_weight_fn
from fedasync.tensors import global_norm
from server.app import run_server
from server.config import from_container
from server.privacy import CENTRAL_BUDGET

N = 200_000  # coordinates: enough for the noise's std to be measured within 1%


def _params(value: float = 0.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((N,), value), "n": torch.tensor(7)}


def _delta(silo: str, scale: float, seed: int) -> Update:
    g = torch.Generator().manual_seed(seed)
    t = {"w": torch.randn(N, generator=g) * scale, "n": torch.tensor(99)}
    return Update(silo=silo, base_version=0, tensors=t, num_samples=10, kind="delta")


# ---------------------------------------------------------------- accounting
def test_epsilon_equals_opacus_rdp_accountant_at_sample_rate_one():
    # Prepare: an accountant fed every release as a full-batch step of its noise multiplier
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for sigma, n in ((1.3, 30), (2.0, 10)):
        for _ in range(n):
            acc.step(noise_multiplier=sigma, sample_rate=1.0)
    # Execute
    ours = eps_of({1.3: 30, 2.0: 10}, 1e-5)
    # Assert
    assert ours == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    assert eps_of({}, 1e-5) == 0.0
    assert eps_of({1.0: 1}, 1e-5) < eps_of({1.0: 2}, 1e-5) < eps_of({0.5: 2}, 1e-5)


# ---------------------------------------------------------------- the mechanism in the aggregators
def test_fedasync_fold_is_params_plus_s_times_clipped_delta_plus_noise():
    # Prepare: a delta of norm ~ 2*sqrt(N) >> C, so it is clipped to C
    sigma, c, alpha = 0.5, 3.0, 0.4
    mech = GaussianMechanism(c, sigma, seed=11)
    agg = FedAsyncAggregator(alpha, make_weight_fn("constant"), mechanism=mech)
    upd = _delta("s0", 2.0, seed=1)
    # Execute
    res = agg.fold(_params(1.0), upd, tau=0)
    # Assert: clipped delta reproduced; the noise has std sigma*C in delta space
    assert res.params is not None and res.released == ["s0"] and res.flushed == 1
    clipped = upd.tensors["w"] * (c / global_norm({"w": upd.tensors["w"]}))
    noise = (res.params["w"] - 1.0) / alpha - clipped
    assert float(noise.std()) == pytest.approx(sigma * c, rel=0.01)
    assert abs(float(noise.mean())) < 0.01 * sigma * c
    assert res.noise_std == pytest.approx(alpha * sigma * c)
    replay = GaussianMechanism(c, sigma, seed=11).noise({"w": torch.zeros(N)}, 1.0)[0]["w"]
    assert torch.allclose(noise, replay, atol=1e-4)  # exactly one draw, from the mechanism
    assert int(res.params["n"]) == 7  # integer buffers are neither folded nor noised


def test_fedasync_with_central_dp_refuses_whole_models():
    agg = FedAsyncAggregator(0.5, make_weight_fn("constant"), GaussianMechanism(1.0, 1.0))
    upd = _delta("s0", 1.0, seed=1)
    upd.kind = "model"
    with pytest.raises(ValueError, match="kind='delta'"):
        agg.fold(_params(), upd, tau=0)


def test_fedbuff_noises_the_flush_by_the_largest_silo_share():
    # Prepare: silo a has two of the three buffered updates (share 2/3 of the mean)
    sigma, c = 2.0, 1.0
    agg = FedBuffAggregator(
        3, make_weight_fn("constant"), mechanism=GaussianMechanism(c, sigma, seed=3)
    )
    ups = [_delta("a", 1.0, 1), _delta("b", 1.0, 2), _delta("a", 1.0, 3)]
    # Execute
    first = [agg.fold(_params(), u, tau=0) for u in ups[:2]]
    res = agg.fold(_params(), ups[2], tau=0)
    # Assert
    assert all(r.params is None and r.released == [] for r in first)  # nothing released yet
    assert res.released == ["a", "b"] and res.flushed == 3
    mean_clipped = sum(u.tensors["w"] / global_norm({"w": u.tensors["w"]}) for u in ups) / 3
    noise = res.params["w"] - mean_clipped
    assert res.noise_std == pytest.approx(sigma * c * 2 / 3)
    assert float(noise.std()) == pytest.approx(sigma * c * 2 / 3, rel=0.01)


def test_fedbuff_checkpoints_clipped_deltas():
    agg = FedBuffAggregator(2, make_weight_fn("constant"), mechanism=GaussianMechanism(0.5, 1.0))
    agg.fold(_params(), _delta("a", 1.0, 1), tau=0)
    (buffered,) = agg.state_dict()["deltas"]
    assert global_norm({"w": buffered["w"]}) == pytest.approx(0.5, rel=1e-5)


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"server": {"dp": {"noise_multiplier": 1.0}}}, "needs server.clip_norm"),
        ({"server": {"clip_norm": 1.0, "dp": {"noise_multiplier": 0.0}}}, "must be > 0"),
        (
            {"server": {"mode": "fedbuff", "clip_norm": 1.0, "dp": {"noise_multiplier": 1.0}}},
            "sample_weighting=false",
        ),
        (
            {"server": {"clip_norm": 1.0, "dp": {"noise_multiplier": 1.0, "delta": 1.0}}},
            "delta",
        ),
    ],
)
def test_config_refuses_central_dp_that_would_not_hold(overrides, message):
    with pytest.raises(ValueError, match=message):
        from_container(overrides)


# ---------------------------------------------------------------- the server loop
DP = ("server.clip_norm=1.0", "server.dp.noise_multiplier=1.0")


def _run(cfg):
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    return run_server(InProcessGrid(client_app, cfg.silos.count), cfg, run_dir), run_dir


def _ledger_counts(path: Path) -> dict[int, int]:
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT silo, COUNT(*) FROM releases GROUP BY silo").fetchall()
    return {int(s): int(n) for s, n in rows}


def test_every_fold_is_accounted_to_its_silo(small_cfg):
    # Execute
    cfg = small_cfg("run.max_versions=8", *DP)
    summary, run_dir = _run(cfg)
    # Assert: one release per accepted update, epsilon of exactly that many at sigma
    counts = _ledger_counts(run_dir / "privacy" / "central.sqlite")
    events = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "update"]
    assert sum(counts.values()) == summary["versions"] == 8
    for silo in range(3):
        stats = summary["per_silo"][str(silo)]
        assert counts.get(silo, 0) == stats["accepted"]
        expected = eps_of({1.0: stats["accepted"]}, 1e-5)
        assert summary["central_dp"]["epsilon"][str(silo)] == pytest.approx(expected)
        eps = [e["central_epsilon"] for e in events if e["silo"] == silo]
        assert eps and eps == sorted(eps) and eps[-1] == pytest.approx(expected)


def test_sync_rounds_release_every_silo_once_per_round(small_cfg):
    cfg = small_cfg("run.max_versions=3", "server.mode=sync", "server.sample_weighting=false", *DP)
    summary, run_dir = _run(cfg)
    counts = _ledger_counts(run_dir / "privacy" / "central.sqlite")
    assert summary["versions"] == 3 and counts == {0: 3, 1: 3, 2: 3}


def test_silo_out_of_central_budget_is_stopped_and_the_ledger_outlives_the_run(
    small_cfg, tmp_path, caplog
):
    # Prepare: a budget that affords k releases per silo, on a ledger shared by two runs
    budget = 10.0  # 3 releases at sigma 1 (user-level DP is expensive with few silos)
    k = max(n for n in range(1, 100) if eps_of({1.0: n}, 1e-5) <= budget)
    ledger = tmp_path / "central.sqlite"
    dp = (*DP, f"server.dp.epsilon_budget={budget}", f"server.dp.ledger={ledger}")
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedasync.server"):
        summary, run_dir = _run(small_cfg("run.max_versions=100", *dp))
        again, _ = _run(small_cfg("run.max_versions=100", "run.name=t2", *dp))
    # Assert
    events = read_events(run_dir / "metrics.jsonl")
    for silo in range(3):
        stats = summary["per_silo"][str(silo)]
        assert stats["stopped"] == CENTRAL_BUDGET and stats["accepted"] == k
        assert stats["central_epsilon"] <= budget and stats["rejected"] == 0
        (stop,) = [e for e in events if e["event"] == "silo_stopped" and e["silo"] == silo]
        assert stop["reason"] == CENTRAL_BUDGET
        assert again["per_silo"][str(silo)]["accepted"] == 0  # the second run finds it spent
    assert summary["versions"] == 3 * k  # the run ended: nobody left in budget
    assert _ledger_counts(ledger) == {0: k, 1: k, 2: k}
    lines = [r.message for r in caplog.records if CENTRAL_BUDGET in r.message]
    assert len(lines) == 6 and "one more release would take it to" in lines[0]
