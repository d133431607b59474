"""A sample-level erasure's retraining reference (``lab.exclude_samples``) never trains on
exactly the samples the erasure of the same share erases, and the backdoor watch follows
those samples in both runs (server/job_requests.py ``excluded_ids``, server/erasure_setup.py ``watched_ids``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from inprocess import InProcessGrid

from clients.app import app as client_app
from fedasync.errors import ConfigError
from protocol.ids import fraction_ids
from protocol.messages import TrainRequest
from server.app import run_server
from server.erasure_setup import watched_ids
from server.loop import AsyncServer


def _train_requests(grid: InProcessGrid, node: int) -> list[TrainRequest]:
    return [
        TrainRequest.from_message(m)
        for m in grid.pushed
        if m.metadata.message_type == "train" and m.metadata.dst_node_id == node
    ]


def test_retraining_without_a_share_never_trains_on_what_its_erasure_erases(small_cfg, monkeypatch):
    # Prepare: the same seed, once retraining without 20% of silo 1, once erasing that share
    retrain = small_cfg("run.max_versions=6", "lab.exclude_samples=[{silo: 1, fraction: 0.2}]")
    erase = small_cfg("run.max_versions=30", "erasures=[{silo: 1, at_s: 3, fraction: 0.2}]")
    erased: list[list[str]] = []
    start = AsyncServer.dispatch_unlearn

    def spy(self, silo, params, e):
        erased.append(list(e.sample_ids))
        return start(self, silo, params, e)

    monkeypatch.setattr(AsyncServer, "dispatch_unlearn", spy)
    # Execute
    grid = InProcessGrid(client_app, 3)
    run_server(grid, retrain, Path(retrain.run.out_dir) / "retrain")
    run_server(InProcessGrid(client_app, 3), erase, Path(erase.run.out_dir) / "erase")
    # Assert: every training job of silo 1 left out the share, from the first; the others none
    jobs = _train_requests(grid, 1001)
    assert jobs, "silo 1 trained"
    never = set(jobs[0].exclude)
    assert all(set(j.exclude) == never for j in jobs)
    assert all(not j.exclude for j in _train_requests(grid, 1000))
    # ...and it is exactly what the erasure of 20% of that silo erased
    assert erased and set(erased[0]) == never
    assert 0 < len(never) < 200


def test_the_watch_follows_the_share_in_both_runs(small_cfg):
    from server.benchmark import federation

    retrain = small_cfg(
        "lab.backdoor.enabled=true",
        "lab.backdoor.silo=1",
        "lab.exclude_samples=[{silo: 1, fraction: 0.2}]",
    )
    erase = small_cfg(
        "lab.backdoor.enabled=true",
        "lab.backdoor.silo=1",
        "erasures=[{silo: 1, at_s: 3, fraction: 0.2}]",
    )
    whole = small_cfg(
        "lab.backdoor.enabled=true", "lab.backdoor.silo=1", "erasures=[{silo: 1, at_s: 3}]"
    )
    fed = federation(retrain)
    ids = [str(x) for x in fed.silos[1].sample_ids]
    assert watched_ids(retrain, fed) == watched_ids(erase, fed) == fraction_ids(ids, 0, 1, 0.2)
    assert watched_ids(whole, fed) == []


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ("[{silo: 5, fraction: 0.2}]", "is not a silo"),
        ("[{silo: 1, fraction: 1.0}]", "must be in (0, 1)"),
        ("[{silo: 1, fraction: 0.2}, {silo: 1, fraction: 0.3}]", "listed twice"),
    ],
)
def test_bad_shares_are_refused_by_name(small_cfg, entry, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        small_cfg(f"lab.exclude_samples={entry}")
