"""The pricing-market runs (trainers.market.run, .cli, .config): seeded reproducibility,
corrupted runs left out of the averages, the deviation test's mechanics, the intervals, the
parallel pool giving what one process gives, and ``fedasync market`` end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedasync.errors import ConfigError
from trainers.market.config import load_market_config
from trainers.market.run import (
    aggregate,
    confidence_interval,
    run_settings,
    setting_label,
    sweep_settings,
)
from trainers.market.seed import MarketRun, run_seed

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "run.horizon=40",
    "run.window=10",
    "run.deviation_span=8",
    "run.seeds=2",
    "run.workers=1",
    "run.progress=false",
    "run.plots=false",
    "agent.hidden=8",
    "agent.warmup=8",
    "agent.batch_size=8",
]


def tiny(*more: str):
    return load_market_config(None, [*TINY, *more])


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="market.clock"):
        load_market_config(None, ["market.clock=sometimes"])
    with pytest.raises(ConfigError, match="market.firms"):
        load_market_config(None, ["market.firms=1"])
    with pytest.raises(ConfigError, match="sweep.rates and sweep.latencies"):
        load_market_config(None, ["sweep.rates=[1,2]"])
    with pytest.raises(ConfigError, match="sweep.latencies"):
        load_market_config(None, ["sweep.rates=[1]", "sweep.latencies=[-1]"])
    with pytest.raises(ConfigError, match="revisions"):
        load_market_config(None, ["market.rate=1000", "run.horizon=100000"])


def test_a_seeded_run_is_reproducible_and_seeds_differ(tmp_path):
    cfg = tiny("run.deviation=true")
    a = run_seed(cfg, 3, tmp_path / "a")
    b = run_seed(cfg, 3, tmp_path / "b")
    c = run_seed(cfg, 4)
    for r in (a, b):
        r.pop("seconds")
    c.pop("seconds")
    assert a == b
    assert a["delta"] != c["delta"]
    with np.load(tmp_path / "a" / "trace.npz") as x, np.load(tmp_path / "b" / "trace.npz") as y:
        assert np.array_equal(x["prices"], y["prices"]) and np.array_equal(x["times"], y["times"])
    events = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").open()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("window") >= 3
    assert events[0]["p_nash"] == pytest.approx(1.473, abs=1e-3)


def test_the_index_is_measured_on_the_profit_earned(tmp_path):
    """Delta from the run equals Delta recomputed from its own trace: the time-average
    profit of the piecewise-constant prices over the measured window."""
    cfg = tiny("run.deviation=false", "run.measure_fraction=0.5")
    run = MarketRun(cfg, 1)
    r = run.train(None)
    t, p = run.trace.arrays(limit=10**9)
    t0, t1 = r["measured"]
    profit = np.zeros(run.market.n)
    for k in range(len(t)):
        lo, hi = max(t[k], t0), min(t[k + 1] if k + 1 < len(t) else t1, t1)
        if hi > lo:
            profit += run.market.profits(p[k]) * (hi - lo)
    profit /= t1 - t0
    assert np.allclose(profit, r["profit"], rtol=1e-9)
    assert r["delta"] == pytest.approx(
        (profit.mean() - run.bench["profit_nash"])
        / (run.bench["profit_monopoly"] - run.bench["profit_nash"])
    )


def test_synchronous_movers_all_move_and_see_the_old_prices():
    cfg = tiny("market.clock=sync", "run.deviation=false")
    run = MarketRun(cfg, 0)
    seen = []
    real = run.env.observe

    def spy(i):
        obs = real(i)
        seen.append((i, obs.copy(), run.env.prices.copy()))
        return obs

    run.env.observe = spy  # type: ignore[method-assign]
    before = run.env.prices
    _, movers, _ = run.step()
    assert movers == (0, 1)
    for _, obs, posted in seen:  # nobody saw a price set at this event
        assert np.array_equal(obs, before) and np.array_equal(posted, before)


def test_a_diverged_critic_corrupts_the_run_and_is_left_out(tmp_path):
    cfg = tiny("agent.q_bound=0.0001")
    r = run_seed(cfg, 0, tmp_path)
    assert r["status"] == "corrupted" and "delta" not in r and "deviation" not in r
    assert "Q" in r["corrupted"]["reason"] or "q" in r["corrupted"]["reason"].lower()
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [e for e in events if e["event"] == "diverged"]
    ok = run_seed(tiny(), 1)
    agg = aggregate([r, ok])
    assert agg["corrupted"] == 1 and agg["ok"] == 1 and agg["deltas"] == [ok["delta"]]
    assert agg["delta"] == ok["delta"] and math.isnan(agg["delta_ci95"])


def test_the_deviation_is_the_static_best_response(tmp_path):
    cfg = tiny("run.deviation=false")
    run = MarketRun(cfg, 2)
    run.train(None)
    d = run.deviation_test(span=6.0)
    times = np.asarray(d["times"])
    assert times[0] < 0 and times[-1] >= 6.0 and 0.0 in d["times"]
    # the deviation price maximises the deviator's profit against what it saw (a grid check)
    k = d["times"].index(0.0)
    prices = np.asarray(d["prices"])
    rival = prices[k - 1][1]  # latency 0: the deviator saw the rival's posted price
    grid = np.linspace(run.lo, run.hi, 4001)
    profit = run.market.profits(np.stack([grid, np.full_like(grid, rival)], axis=1))[:, 0]
    best = grid[int(np.argmax(profit))]
    assert d["deviation_price"] == pytest.approx(best, abs=(run.hi - run.lo) / 1000)
    assert d["recovered"] == (d["recovery_time"] is not None)


def test_the_best_response_to_nash_is_nash():
    run = MarketRun(tiny(), 0)
    p_n = run.bench["p_nash"]
    br = run.best_response(0, np.array([p_n, p_n]))
    assert br == pytest.approx(p_n, abs=(run.hi - run.lo) / 1000)
    # against monopoly prices the best response undercuts
    p_m = run.bench["p_monopoly"]
    assert run.best_response(0, np.array([p_m, p_m])) < p_m - 0.05


def test_confidence_interval_by_hand():
    mean, half = confidence_interval([0.2, 0.4, 0.6])
    # t(0.975, 2) = 4.3027; sd = 0.2; half = 4.3027 * 0.2 / sqrt(3)
    assert mean == pytest.approx(0.4)
    assert half == pytest.approx(4.302653 * 0.2 / math.sqrt(3), rel=1e-5)
    assert math.isnan(confidence_interval([0.5])[1])


def test_a_sweep_is_one_setting_per_cell():
    cfg = tiny("sweep.rates=[1,2]", "sweep.latencies=[0,0.5,1]")
    labels = [setting_label(c) for c in sweep_settings(cfg)]
    assert labels == [
        "async-r1-d0",
        "async-r1-d0.5",
        "async-r1-d1",
        "async-r2-d0",
        "async-r2-d0.5",
        "async-r2-d1",
    ]
    assert [setting_label(c) for c in sweep_settings(tiny())] == ["async-r1-d0"]


def test_the_pool_gives_what_one_process_gives(tmp_path):
    cfg = tiny("run.deviation=false", "run.seeds=2")
    one = run_settings([cfg], tmp_path / "one")
    two = run_settings(
        [load_market_config(None, [*TINY, "run.deviation=false", "run.workers=2"])],
        tmp_path / "two",
    )
    a, b = one["async-r1-d0"], two["async-r1-d0"]
    assert a["deltas"] == b["deltas"] and a["seeds"] == b["seeds"] == [0, 1]


@pytest.mark.slow
def test_fedasync_market_cli(tmp_path):
    cmd = [sys.executable, "-m", "simulations.cli", "market", *TINY, "run.plots=true"]
    cmd += ["run.seeds=1"]
    cmd += [f"run.out_dir={tmp_path}", "run.name=m", "sweep.rates=[1]", "sweep.latencies=[0,1]"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("Delta") == 2 and "p_N=1.473 p_M=1.925" in p.stdout
    s = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert set(s["settings"]) == {"async-r1-d0", "async-r1-d1"}
    for name in ("prices.png", "deviation.png", "collusion_index.png", "phase_diagram.png"):
        assert (tmp_path / "m" / name).stat().st_size > 1000
    bad = subprocess.run(
        [sys.executable, "-m", "simulations.cli", "market", "market.rate=x" * 1000],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and len(bad.stderr) < 2000


def test_a_rate_reward_is_the_transitions_mean_profit_per_time_unit():
    """market.reward=rate gives integral / elapsed (undiscounted, rho = 0 here): compared on
    the transitions before learning starts (warmup), where both runs take the same prices."""

    def rewards(kind: str) -> list[tuple[float, float]]:
        run = MarketRun(tiny(f"market.reward={kind}", "market.discount_rate=0"), 5)
        elapsed = {}
        settle = run.env.settle

        def spy(i):
            out = settle(i)
            elapsed[i] = out[2]
            return out

        run.env.settle = spy  # type: ignore[method-assign]
        seen = []
        remember = run.agents[0].remember

        def keep(state, action, reward, discount, next_state):
            seen.append((reward, elapsed[0]))
            remember(state, action, reward, discount, next_state)

        run.agents[0].remember = keep  # type: ignore[method-assign]
        while len(seen) < 5:
            run.step()
        return seen

    integral, rate = rewards("integral"), rewards("rate")
    for (r_int, elapsed), (r_rate, elapsed_too) in zip(integral, rate):
        assert elapsed == elapsed_too > 0
        assert r_rate == pytest.approx(r_int / elapsed, rel=1e-9)


def test_a_horizon_in_revisions_is_the_same_work_at_every_rate():
    slow = tiny("run.revisions=30", "market.rate=0.5", "run.window=5", "run.deviation=false")
    fast = tiny("run.revisions=30", "market.rate=3", "run.window=5", "run.deviation=false")
    assert slow.horizon == 60.0 and fast.horizon == 10.0
    assert tiny().horizon == 40.0  # run.horizon when no revisions are given
    a, b = run_seed(slow, 0), run_seed(fast, 0)
    # two firms, 30 expected revisions each: Poisson counts, seeded (sd about 8)
    for r in (a, b):
        assert 30 <= r["revisions"] <= 90


@pytest.mark.parametrize("stop_after", [1, 37])
def test_a_seed_stopped_mid_run_resumes_to_the_result_of_one_never_stopped(tmp_path, stop_after):
    cfg = tiny("run.deviation=true", "market.latency=0.5")
    whole = run_seed(cfg, 3, tmp_path / "whole")
    asked = iter(range(10**6))

    stopped = run_seed(cfg, 3, tmp_path / "cut", should_stop=lambda: next(asked) >= stop_after)
    assert stopped == {"seed": 3, "status": "stopped"}
    assert (tmp_path / "cut" / "checkpoint.pt").is_file()
    assert not (tmp_path / "cut" / "result.json").exists()
    resumed = run_seed(replace(cfg, run=replace(cfg.run, resume=True)), 3, tmp_path / "cut")

    for r in (whole, resumed):
        r.pop("seconds")
    assert resumed == whole
    assert not (tmp_path / "cut" / "checkpoint.pt").exists()  # result.json stands for it
    with (
        np.load(tmp_path / "whole" / "trace.npz") as x,
        np.load(tmp_path / "cut" / "trace.npz") as y,
    ):
        assert np.array_equal(x["prices"], y["prices"]) and np.array_equal(x["times"], y["times"])

    def windows(folder):
        events = [json.loads(line) for line in (folder / "metrics.jsonl").open()]
        return [e for e in events if e["event"] == "window"], [e["event"] for e in events]

    (w_whole, _), (w_cut, kinds) = windows(tmp_path / "whole"), windows(tmp_path / "cut")
    assert w_cut == w_whole and kinds.count("resume") == 1  # no window twice, none lost


def test_a_seed_checkpoint_of_another_config_is_refused_by_name(tmp_path):
    from fedasync.errors import CheckpointError

    cfg = tiny()
    run_seed(cfg, 0, tmp_path / "s", should_stop=lambda: True)
    other = tiny("run.resume=true", "agent.hidden=16")
    with pytest.raises(CheckpointError, match="agent.hidden"):
        run_seed(other, 0, tmp_path / "s")
