"""Erasure protocol runs end to end (real ClientApp, in-process grid): a sample-level erasure,
three erasures in a row, and whole-silo erasures under FedBuff with a momentum server
optimiser, for both calibration targets. What each checks is observable from outside the
coordinator: the summary, metrics.jsonl, the train messages sent, the erasure store and the
final checkpoint. Each request ends checked after its relearning window (``verified`` or
``unverified``): the protocol is tested here, not how well a tiny run forgets."""

from __future__ import annotations

from pathlib import Path

import pytest
from inprocess import CHECKED, InProcessGrid, checked_rows

from clients.app import app as client_app
from fedasync.events import read_events
from protocol import keys as P
from server.app import run_server

FIRST_NODE = 1000  # InProcessGrid's node ids: silo i is node 1000 + i
COMMON = (
    "lab.erasure.relearn_versions=4",
    "unlearning.steps=3",
    "unlearning.stop=fixed",  # every erasure moves the model (its jump is kept): 3 steps each
    "server.eval_every=10",
)


def _run(cfg) -> tuple[dict, list[dict], InProcessGrid, Path]:
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    grid = InProcessGrid(client_app, 3)
    summary = run_server(grid, cfg, run_dir)
    return summary, read_events(run_dir / "metrics.jsonl"), grid, run_dir


def _train_configs(grid: InProcessGrid, silo: int) -> list:
    """The config records of the train messages sent to ``silo``, in order."""
    return [
        m.content[P.CONFIG]
        for m in grid.pushed
        if m.metadata.message_type == P.TRAIN and m.metadata.dst_node_id == FIRST_NODE + silo
    ]


def _erased_ids(run_dir: Path) -> dict[str, list[str]]:
    from server.erasure.store import ErasureStore

    with ErasureStore(run_dir / "erasures.sqlite") as store:
        return {r.id: sorted(r.sample_ids) for r in store.list()}


def test_sample_level_erasure_excludes_the_erased_samples_from_later_training(small_cfg):
    # Prepare
    cfg = small_cfg("run.max_versions=30", "erasures=[{silo: 1, at_s: 10, fraction: 0.3}]", *COMMON)
    # Execute
    summary, events, grid, run_dir = _run(cfg)
    # Assert: checked, as a sample-level erasure (the silo not retired)
    (req,) = summary["erasures"]["requests"]
    assert req["state"] in CHECKED and req["silo"] == 1 and req["samples"] > 0
    (row,) = checked_rows(summary)
    assert row["scope"] == f"{req['samples']} samples"
    boundary = row["boundary_version"]
    erased = _erased_ids(run_dir)[req["id"]]
    assert len(erased) == req["samples"]
    # every train message to silo 1 based on the erased model lists exactly the erased ids;
    # none before the boundary lists any
    configs = _train_configs(grid, 1)
    before = [c for c in configs if int(c[P.BASE_VERSION]) < boundary]
    after = [c for c in configs if int(c[P.BASE_VERSION]) >= boundary]
    assert before and all(list(c[P.EXCLUDE]) == [] for c in before)
    assert after, "the silo is sent training after a sample-level erasure"
    assert all(sorted(c[P.EXCLUDE]) == erased for c in after)
    # ... and no other silo is told to exclude anything
    assert all(list(c[P.EXCLUDE]) == [] for s in (0, 2) for c in _train_configs(grid, s))
    # the silo keeps training: its updates are folded after the boundary
    later = [e for e in events if e["event"] == "update" and e["version"] > boundary]
    assert any(e["silo"] == 1 for e in later)
    assert [e["state"] for e in events if e["event"] == "erasure"] == [
        "erasing",
        "calibrating",
        req["state"],
    ]


SEQUENCE = "erasures=[{silo: 1, at_s: 6, fraction: 0.3}, {silo: 2, at_s: 14}, {silo: 1, at_s: 22}]"


@pytest.mark.parametrize(
    "protect", ["calibration_target=reply", "calibration_target=applied,protect=both"]
)
def test_three_erasures_in_a_row_are_each_checked_and_all_stay_protected(small_cfg, protect):
    """A sample-level erasure of silo 1, then silo 2 whole, then silo 1 whole: each is
    checked after its window in turn, with its own, later boundary; after the third the calibration holds all
    three signatures (and, protecting jumps, all three jumps)."""
    from server.checkpoint import load_state

    # Prepare
    options = [f"lab.erasure.{kv}" for kv in protect.split(",")]
    cfg = small_cfg("run.max_versions=45", SEQUENCE, *COMMON, *options)
    # Execute
    summary, events, grid, run_dir = _run(cfg)
    # Assert: all checked, in the order they were scheduled
    reqs = summary["erasures"]["requests"]
    assert [r["silo"] for r in reqs] == [1, 2, 1]
    assert all(r["state"] in CHECKED for r in reqs), [r["state"] for r in reqs]
    assert reqs[0]["samples"] > 0 and reqs[1]["samples"] == reqs[2]["samples"] == 0
    rows = checked_rows(summary)
    assert [r["request"] for r in rows] == [r["id"] for r in reqs]
    boundaries = [r["boundary_version"] for r in rows]
    assert boundaries == sorted(set(boundaries)), (
        f"boundaries not strictly increasing: {boundaries}"
    )
    # the erasure events of each request in its own order, the three one after another
    flow = [(e["request"], e["state"]) for e in events if e["event"] == "erasure"]
    for r in reqs:
        removal = ("removed", "removed_more")  # (with a removal, in steps if it was bounded)
        got = [s for rid, s in flow if rid == r["id"] and s not in removal]
        assert got == ["erasing", "calibrating", r["state"]]
    calibrating = [rid for rid, s in flow if s == "calibrating"]
    assert calibrating == [r["id"] for r in reqs]
    # retired silos train no more after their whole-silo boundary; silo 1 did between its two
    updates = [e for e in events if e["event"] == "update"]
    assert not [e for e in updates if e["silo"] == 2 and e["version"] >= boundaries[1]]
    assert not [e for e in updates if e["silo"] == 1 and e["version"] >= boundaries[2]]
    assert [e for e in updates if e["silo"] == 1 and boundaries[0] < e["version"] < boundaries[2]]
    # the sample-level erasure's ids stay excluded for silo 1 until it is retired
    erased = _erased_ids(run_dir)[reqs[0]["id"]]
    later = [c for c in _train_configs(grid, 1) if int(c[P.BASE_VERSION]) >= boundaries[0]]
    assert later and all(sorted(c[P.EXCLUDE]) == erased for c in later)
    # after the third boundary every update is still calibrated
    last = [e for e in updates if e["version"] >= boundaries[2]]
    assert last and all(0.0 <= e["calibration_overlap"] <= 1.0 for e in last)
    # the coordinator's state at the end (the checkpoint written at the third boundary):
    # the three signatures merged, the first two kept as they were and the third appended
    # (each erasing silo reports its signature's rank); with protect=both, one jump each, and
    # one for each whole-silo erasure's removal by the server
    ranks = [int(r["at_boundary"]["silo_signature_rank"]) for r in rows]
    assert all(k >= 1 for k in ranks), ranks
    co = load_state(run_dir / "checkpoint.pt").parts["erasure"]
    merged = co["signature"]["basis"].shape[1]
    assert ranks[0] + ranks[1] < merged <= sum(ranks), (merged, ranks)
    # (a removal moves the model when some of it was applied, at once or in later steps)
    moved = {e["request"] for e in events if e["event"] == "erasure" and e.get("applied")}
    removals = len(moved)
    assert len(co["jumps"]) == (3 + removals if cfg.lab.erasure.protect == "both" else 0)
    assert co["boundary"] == boundaries[2] and sorted(co["retired"]) == [1, 2]


@pytest.mark.parametrize("target", ["reply", "applied"])
def test_fedbuff_momentum_whole_silo_erasure_is_checked(small_cfg, target):
    # Prepare
    cfg = small_cfg(
        "run.max_versions=30",
        "server.mode=fedbuff",
        "server.buffer_size=2",
        "server.optimizer.kind=momentum",
        "erasures=[{silo: 1, at_s: 10}]",
        f"lab.erasure.calibration_target={target}",
        *COMMON,
    )
    # Execute
    summary, events, grid, run_dir = _run(cfg)
    # Assert
    (req,) = summary["erasures"]["requests"]
    assert req["state"] in CHECKED and req["silo"] == 1 and req["samples"] == 0
    (row,) = checked_rows(summary)
    boundary = row["boundary_version"]
    assert row["verified_version"] >= boundary + cfg.lab.erasure.relearn_versions
    updates = [e for e in events if e["event"] == "update"]
    assert [e for e in updates if e["silo"] == 1 and e["version"] < boundary]
    after = [e for e in updates if e["version"] >= boundary]
    assert after and all(e["silo"] != 1 for e in after), "an erased silo never trains again"
    # nor is it sent training based on the erased model
    assert not [c for c in _train_configs(grid, 1) if int(c[P.BASE_VERSION]) >= boundary]
    assert summary["versions"] == 30
