"""End to end over Flower's deployment engine: an erasure request cancels the erasing silo's
training job, its node stops that job at its next local step (told by its watch on the erasure
service, clients/preempt.py), and the erasure runs at once instead of behind the job.

Slow: a SuperLink, two SuperNodes with warm workers and the ServerApp, over TLS.
"""

from __future__ import annotations

import pytest

from fedasync.events import read_events

pytestmark = pytest.mark.slow


def test_a_deployed_erasure_stops_its_silos_training_job_and_runs_at_once(small_cfg, tmp_path):
    # Prepare: 2 silos over TLS with warm workers; each training job is 4000 local steps (tens
    # of seconds here), so silo 1's first job is surely in flight when its erasure is due at 4 s
    import simulations.deploy as deploy

    cfg = small_cfg(
        "silos.count=2",
        "client.local_steps=4000",
        "run.budget_s=30",
        "server.eval_every=1000",
        "unlearning.service=true",
        "unlearning.address=127.0.0.1:0",
        "unlearning.steps=2",
        "unlearning.signature_batches=1",
        "erasures=[{silo: 1, at_s: 4}]",
    )
    # Execute
    summary = deploy.deploy_local(cfg, echo=lambda line: None)
    # Assert: the job in flight was cancelled at the request and stopped on the node: its
    # reply came back as the "stopped" error, long before 4000 steps could have run
    run = tmp_path / "t"
    events = read_events(run / "metrics.jsonl")
    cancels = [e for e in events if e["event"] == "job_cancelled"]
    assert [c["silo"] for c in cancels] == [1]
    (dropped,) = [e for e in events if e["event"] == "reply_discarded"]
    assert dropped["job"] == cancels[0]["job"] and dropped["error"] is True
    # ...no reply of the cancelled job was folded, and one silo held one job at a time
    folded = [e for e in events if e["event"] == "update" and e.get("job") == dropped["job"]]
    assert folded == []
    # ...the erasure started at the request (not behind the job) and is in the model
    (row,) = summary["erasures"]["applied"]
    assert row["silo"] == 1 and row["started_t"] == pytest.approx(row["submitted_t"], abs=1.0)
    assert summary["jobs_cancelled"] == 1 and summary["cancelled_replies_discarded"] == 1
    # ...the node learnt of it from its watch and stopped between two local steps
    logs = "".join(p.read_text(errors="replace") for p in run.rglob("*.log"))
    assert "stopped after" in logs and "local steps: erasure" in logs
    assert summary["deployment"]["left_running"] == []
