"""End to end through Flower's simulation engine (Ray): a small network, a few versions."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from fedasync.processes import RAY_TMP_PREFIX, session_pids
from simulations.config import load_config
from simulations.launcher import simulate


def _ray_processes(sessions: list[str]) -> set[int]:
    """Live processes of these private Rays (their temp folders): by their session variable,
    or, for Ray's agents that lost it, by the files they hold there. Not every Ray process on
    the machine: under pytest-xdist other tests' Rays run beside this one."""
    return {p for s in sessions for p in session_pids(s)}


@pytest.mark.slow
def test_simulate_async_and_sync_baseline(tmp_path, monkeypatch):
    # Prepare: the run's Ray temp folders in a folder of this test's (short: Ray's sockets)
    private = Path(tempfile.mkdtemp(prefix="fa-e2e-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    made: list[str] = []
    mkdtemp = tempfile.mkdtemp

    def recorded(*args, **kwargs):
        made.append(mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", recorded)
    cfg = load_config(
        None,
        [
            f"run.out_dir={tmp_path}",
            "run.name=e2e",
            "run.budget_s=60",
            "run.progress=false",
            "silos.count=3",
            "lab.speed.straggler_fraction=0.34",
            "client.local_steps=2",
            "data.max_samples=600",
            "server.eval_every=2",
            "server.checkpoint_every=5",
            "engine.num_cpus=2",
            "lab.compare_sync=true",
        ],
    )
    # Execute
    summary = simulate(cfg)
    # Assert
    run_dir = tmp_path / "e2e"
    for name in (
        "summary.json",
        "metrics.jsonl",
        "config.yaml",
        "accuracy_vs_time.png",
        "staleness_hist.png",
        "silo_contribution.png",
        "checkpoint.pt",
        "baseline-sync/summary.json",
    ):
        assert (run_dir / name).exists(), name
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["mode"] == "fedasync" and on_disk["versions"] == summary["versions"] > 3
    baseline = json.loads((run_dir / "baseline-sync" / "summary.json").read_text())
    assert baseline["mode"] == "sync" and baseline["staleness_max"] == 0
    assert summary["versions"] > baseline["versions"], (
        "async does more versions in the same virtual time"
    )
    assert set(summary["per_silo"]) == {"0", "1", "2"}
    assert all("eval" in s for s in summary["per_silo"].values())
    rays = [d for d in made if Path(d).name.startswith(RAY_TMP_PREFIX)]
    assert len(rays) == 2 and all(Path(d).parent == private for d in rays), made  # run, baseline
    left = _ray_processes(rays)
    for _ in range(50):  # a process killed a moment ago may still be in /proc for a few ticks
        if not left:
            break
        time.sleep(0.1)
        left = _ray_processes(rays)
    assert not left, f"every Ray process the run started is stopped: {left} are not"
    shutil.rmtree(private, ignore_errors=True)
