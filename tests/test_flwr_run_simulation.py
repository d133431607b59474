"""Flower's own commands: ``flwr run`` of this app on Flower's simulation runtime.

``fedasync simulate`` drives Flower's simulation engine in-process (``run_simulation``); a
Flower user runs the same app with ``flwr run <app> <local SuperLink> --run-config ...``,
where Flower starts a local SuperLink and a ``flwr-simulation`` process that calls the same
engine. The ServerApp then sees Flower's in-memory grid and runs the virtual clock, so the
two must give the same run: the same updates in the same order, the same model. Slow (a
local SuperLink, Ray twice): about a minute and a half on 2 cores.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fedasync.events import read_events
from fedasync.processes import Processes, alive
from server.run_config import run_config_toml
from simulations.app_bundle import stage_app
from simulations.launcher import simulate

pytestmark = pytest.mark.slow


def _updates(run_dir: Path) -> list[tuple[int, int, int]]:
    return [
        (e["silo"], e["version"], e["staleness"])
        for e in read_events(run_dir / "metrics.jsonl")
        if e["event"] == "update"
    ]


def test_flwr_run_on_the_simulation_runtime_gives_fedasync_simulates_run(small_cfg, tmp_path):
    # Prepare: one config, as fedasync simulate takes it and as a --run-config file
    cfg = small_cfg("silos.count=2", "run.max_versions=6", "data.max_samples=300")
    ours = simulate(cfg)
    theirs_dir = tmp_path / "flwr"
    theirs = replace(cfg, run=replace(cfg.run, name="flwr", out_dir=str(tmp_path)))
    (tmp_path / "run-config.toml").write_text(run_config_toml(theirs))
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n'
        "options.num-supernodes = 2\noptions.backend.client-resources.num-cpus = 1\n"
        "options.backend.init-args.num-cpus = 2\n"
    )
    app = stage_app(tmp_path / "app")
    procs = Processes(marker=f"{tmp_path}:flwr-run")
    flwr = str(Path(sys.executable).parent / "flwr")
    try:
        # Execute: Flower's own command (its local SuperLink is detached: stopped by marker)
        run = procs.start(
            "flwr-run",
            [flwr, "run", str(app), "local", "--run-config", str(tmp_path / "run-config.toml")]
            + ["--stream"],
            home,
            env={"RAY_TMPDIR": "/tmp"},
        )
        run.popen.wait(timeout=400)
        assert run.popen.returncode == 0, run.tail(40)
    finally:
        left = procs.stop(grace_s=10.0)
    # Assert: the same run on the virtual clock, nothing left running
    assert left == [] and [p for p in procs.seen if alive(p)] == []
    summary = json.loads((theirs_dir / "summary.json").read_text())
    assert summary["clock"] == "virtual" and summary["versions"] == 6
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    assert _updates(theirs_dir) == _updates(run_dir) and len(_updates(run_dir)) == 6
    assert summary["final_score"] == pytest.approx(ours["final_score"], abs=1e-6)
    assert (theirs_dir / "checkpoint.pt").exists()
