"""The asynchronous loop, driven through the real ClientApp on an in-process grid."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from inprocess import InProcessGrid

from clients.app import app as client_app
from fedasync.events import read_events
from server.app import run_server


def _run(cfg):
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    grid = InProcessGrid(client_app, cfg.silos.count)
    summary = run_server(grid, cfg, run_dir)
    return summary, run_dir, grid


def _final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    from server.checkpoint import load_state

    return load_state(run_dir / "checkpoint.pt").params


def test_fedasync_loop_versions_and_summary(small_cfg):
    # Prepare
    cfg = small_cfg(
        "run.max_versions=8", "lab.speed.profile=stragglers", "lab.speed.straggler_fraction=0.34"
    )
    # Execute
    summary, run_dir, _ = _run(cfg)
    # Assert
    assert summary["versions"] == 8
    assert summary["updates_applied"] == 8  # fedasync: one version per update
    for key in (
        "mode",
        "final_score",
        "best_score",
        "final_loss",
        "virtual_time_s",
        "time_to_target_s",
        "updates_applied",
        "updates_rejected",
        "staleness_mean",
        "staleness_max",
    ):
        assert key in summary
    events = read_events(run_dir / "metrics.jsonl")
    times = [e["t"] for e in events if e["event"] == "update"]
    assert times == sorted(times), "replies must be taken in virtual-time order"
    assert summary["staleness_max"] >= 1  # the straggler's work arrives stale


def test_same_seed_same_model(small_cfg, tmp_path):
    a = small_cfg("run.max_versions=5", "run.name=a")
    b = small_cfg("run.max_versions=5", "run.name=b")
    _run(a)
    _run(b)
    pa, pb = _final_params(tmp_path / "a"), _final_params(tmp_path / "b")
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_fedbuff_with_all_silos_equals_sync(small_cfg, tmp_path):
    """Parity: FedBuff, K = number of silos, equal speeds, no jitter, sample weighting == FedAvg."""
    common = (
        "run.max_versions=3",
        "lab.speed.jitter=0",
        "server.staleness.fn=constant",
        "server.sample_weighting=true",
    )
    buff = small_cfg(*common, "server.mode=fedbuff", "server.buffer_size=3", "run.name=buff")
    sync = small_cfg(*common, "server.mode=sync", "run.name=sync")
    _run(buff)
    _run(sync)
    pa, pb = _final_params(tmp_path / "buff"), _final_params(tmp_path / "sync")
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=1e-6, atol=1e-7)


def test_sync_waits_for_the_straggler(small_cfg):
    cfg = small_cfg(
        "server.mode=sync",
        "run.max_versions=2",
        "lab.speed.profile=stragglers",
        "lab.speed.straggler_fraction=0.34",
        "lab.speed.straggler_slowdown=10",
        "lab.speed.jitter=0",
    )
    summary, _, _ = _run(cfg)
    # a round lasts as long as the straggler's job: 2 steps x 1 s x 10 + 0.5 s latency
    assert summary["virtual_time_s"] == pytest.approx(2 * (2 * 10 + 0.5))
    assert summary["staleness_max"] == 0
    assert summary["updates_applied"] == 2 * 3  # every silo in each of the 2 rounds


def test_resume_continues_exactly(small_cfg, tmp_path):
    straight = small_cfg(
        "run.max_versions=8",
        "run.name=straight",
        "server.mode=fedbuff",
        "server.buffer_size=2",
        "lab.speed.profile=lognormal",
    )
    _run(straight)
    first = small_cfg(
        "run.max_versions=4",
        "run.name=resumed",
        "server.mode=fedbuff",
        "server.buffer_size=2",
        "lab.speed.profile=lognormal",
        "server.checkpoint_every=4",
    )
    _run(first)
    second = small_cfg(
        "run.max_versions=8",
        "run.name=resumed",
        "server.mode=fedbuff",
        "server.buffer_size=2",
        "lab.speed.profile=lognormal",
        "run.resume=true",
    )
    summary, run_dir, _ = _run(second)
    pa, pb = _final_params(tmp_path / "straight"), _final_params(tmp_path / "resumed")
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    versions = [
        e["version"] for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "version"
    ]
    assert versions == list(range(1, 9)), "no version is reported twice after a resume"
    assert summary["versions"] == 8


def test_wall_clock_takes_replies_in_arrival_order(small_cfg):
    """Deployment mode: no virtual clock, replies are taken as they arrive."""
    cfg = small_cfg("run.max_versions=6", "run.budget_s=600")
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir, wall_clock=True)
    assert summary["clock"] == "wall" and summary["virtual_time_s"] is None
    assert summary["versions"] == 6
    assert summary["wall_time_s"] > 0


def test_server_side_clipping_bounds_every_update(small_cfg):
    """With server.clip_norm every accepted update is scaled to the bound before it is folded,
    and says so: its logged clip factor is bound / its norm."""
    cfg = small_cfg("run.max_versions=8", "server.clip_norm=0.01")
    _, run_dir, _ = _run(cfg)
    ups = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "update"]
    assert ups and all(e["norm"] > 0.01 for e in ups)  # this bound binds every update
    for e in ups:
        assert e["clip_factor"] == pytest.approx(0.01 / e["norm"], rel=1e-6)
    with pytest.raises(ValueError, match="clip_norm"):
        small_cfg("server.clip_norm=0")


def test_emulated_speed_makes_stragglers_wait(small_cfg):
    """lab.emulate_speed: a silo of speed 1/2 waits as long again as it trained; the others
    do not wait (what makes a one-machine deployment heterogeneous)."""
    from server.clock import silo_speeds

    cfg = small_cfg(
        "run.max_versions=6",
        "lab.speed.profile=stragglers",
        "lab.speed.straggler_fraction=0.34",
        "lab.speed.straggler_slowdown=2",
        "lab.emulate_speed=true",
    )
    _, run_dir, _ = _run(cfg)
    speeds = silo_speeds(cfg.silos, cfg.lab.speed, cfg.run.seed)
    ups = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "update"]
    for e in ups:
        if speeds[e["silo"]] < 1.0:
            assert e["train_emulated_wait_s"] == pytest.approx(e["train_seconds"], rel=1e-6)
        else:
            assert e["train_emulated_wait_s"] == 0.0
    assert any(speeds[e["silo"]] < 1.0 for e in ups)


def test_max_versions_is_exact_when_replies_arrive_together(small_cfg):
    # Three equal silos without jitter finish every job at the same instant: the cap falls
    # inside a batch of simultaneous replies (CI saw 7 versions for a cap of 6 on the wall clock)
    cfg = small_cfg("run.max_versions=4", "lab.speed.jitter=0", "lab.speed.profile=uniform")
    summary, run_dir, _ = _run(cfg)
    assert summary["versions"] == 4
    events = read_events(run_dir / "metrics.jsonl")
    assert [e["version"] for e in events if e["event"] == "version"] == [1, 2, 3, 4]
    assert summary["updates_applied"] == 4
