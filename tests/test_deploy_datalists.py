"""Data stays at the hospitals, on Flower's deployment engine (loopback, TLS): each SuperNode
brings its own Decathlon datalist (node config ``datalist``); the coordinator's config names a
data folder that does not exist and no test set of its own, so the silos evaluate the model.

Slow (a real SuperLink, SuperNodes and ServerApp): about a minute and a half on 2 CPU cores.
The same behaviour in-process, and its error cases, are in tests/test_silo_datalists.py.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_deploy_local import _kill_all, _marked

from fedasync.events import read_events
from medical_data.datalist import load_datalist, write_datalist
from medical_data.federation import build_federation
from medical_data.registry import get_spec
from medical_data.verification import subset
from simulations.deploy import deploy_local

pytestmark = pytest.mark.slow


def test_silos_train_on_their_own_datalists_and_the_coordinator_holds_no_data(small_cfg, tmp_path):
    # Prepare: two hospitals' datalists of real MNI152 patches (their training data and a
    # validation list each), written outside the run folder; the coordinator's data folder
    # does not exist
    fed = build_federation("brain-tissue", 2, 0, max_samples=300)
    halves = np.array_split(np.arange(len(fed.test)), 2)
    datalists = {
        s: write_datalist(
            tmp_path / "hospitals" / f"silo-{s}",
            {"training": fed.silos[s], "validation": subset(fed.test, halves[s])},
            "classification",
        )
        for s in range(2)
    }
    cfg = small_cfg(
        "silos.count=2",
        "run.budget_s=150",
        "run.max_versions=2",
        "data.max_samples=300",
        "server.evaluate_silos=false",
    )
    absent = tmp_path / "coordinator-has-no-data"
    cfg = replace(cfg, data=replace(cfg.data, data_dir=str(absent)))
    try:
        # Execute
        summary = deploy_local(cfg, datalists=datalists, echo=lambda line: None)
    finally:
        _kill_all(str(tmp_path))  # only acts if the deployment failed to stop something
    # Assert: trained on the wall clock (by whichever silo answered first: with warm workers
    # one silo can deliver both versions; both take part below)
    assert summary["clock"] == "wall" and summary["versions"] == 2
    assert sum(summary["per_silo"][s]["accepted"] for s in ("0", "1")) == 2
    # ...the ServerApp read no data: no data folder was made, no test set was exported
    assert not absent.exists()
    run_dir = tmp_path / "t"
    assert not (run_dir / "deploy" / "server-test").exists()
    # ...what it knows of the silos' data is what they reported at the roster query
    spec = get_spec("brain-tissue")
    counts = {str(s): np.bincount(fed.silos[s].labels, minlength=3).tolist() for s in range(2)}
    assert {s: v["class_counts"] for s, v in summary["silo_data"].items()} == counts
    assert {s: v["num_samples"] for s, v in summary["silo_data"].items()} == {
        str(s): len(fed.silos[s]) for s in range(2)
    }
    # ...and the model was evaluated by the silos on their validation lists, aggregated
    assert summary["evaluation"]["on"] == "silos (federated)"
    sizes = [len(load_datalist(datalists[s], spec, "validation")) for s in range(2)]
    events = read_events(run_dir / "metrics.jsonl")
    [final] = [e for e in events if e["event"] == "eval"]
    assert final["version"] == 2 and final["eval_samples"] == sum(sizes)
    assert 0.0 <= summary["final_score"] <= 1.0
    assert {summary["per_silo"][str(s)]["eval"]["num_samples"] for s in range(2)} == set(sizes)
    # ...and every process it started is gone
    assert summary["deployment"]["left_running"] == []
    assert _marked(str(tmp_path)) == []
