"""End to end through Flower's simulation engine (Ray): a small network, a few versions."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from simulations.config import load_config
from simulations.launcher import simulate


def _ray_processes() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "raylet|gcs_server|ray::"], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


@pytest.mark.slow
def test_simulate_async_and_sync_baseline(tmp_path):
    # Prepare
    before = _ray_processes()
    cfg = load_config(
        None,
        [
            f"run.out_dir={tmp_path}",
            "run.name=e2e",
            "run.budget_s=60",
            "run.progress=false",
            "silos.count=3",
            "silos.straggler_fraction=0.34",
            "client.local_steps=2",
            "data.max_samples=600",
            "server.eval_every=2",
            "server.checkpoint_every=5",
            "engine.num_cpus=2",
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
    left = _ray_processes() - before
    for _ in range(50):  # a process killed a moment ago may still be in /proc for a few ticks
        if not left:
            break
        time.sleep(0.1)
        left = _ray_processes() - before
    assert not left, f"every Ray process the run started is stopped: {left} are not"
