"""A fold that makes the global model non-finite is refused: the model stays where it was and
no honest silo is blamed (issue 9: a NaN model made every later update ``non_finite``).

In-process (real ServerApp loop, real ClientApp); the aggregator is made to return a NaN model
once, which no checked update can do, to reach the server's own guard.
"""

from __future__ import annotations

import math
from pathlib import Path

from inprocess import InProcessGrid

from clients.app import app as client_app
from fedasync import FedAsyncAggregator
from fedasync.events import read_events
from server.app import run_server


def test_a_non_finite_fold_is_refused_and_no_silo_is_blamed(small_cfg, monkeypatch):
    # Prepare: the 3rd fold of the run returns a model with one NaN
    cfg = small_cfg("run.max_versions=8")
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    fold, calls = FedAsyncAggregator.fold, []

    def poisoned(self, params, update, tau, **kw):
        res = fold(self, params, update, tau, **kw)
        calls.append(len(calls))
        if len(calls) == 3 and res.params is not None:
            name = next(k for k, v in res.params.items() if v.is_floating_point())
            bad = res.params[name].clone()
            bad.view(-1)[0] = math.nan
            res.params = {**res.params, name: bad}  # (a new model: models are read-only)
        return res

    monkeypatch.setattr(FedAsyncAggregator, "fold", poisoned)

    # Execute
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)

    # Assert: one refused version, the run went on to its versions, nobody was blamed
    events = read_events(run_dir / "metrics.jsonl")
    (refused,) = [e for e in events if e["event"] == "version_refused"]
    assert refused["reason"] == "non_finite_model" and refused["version"] == 2
    assert summary["versions_refused"] == 1
    assert summary["versions"] == 8
    assert summary["updates_rejected"].get("non_finite", 0) == 0
    assert math.isfinite(summary["final_loss"])
