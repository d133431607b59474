"""Erasures end to end in the server loop (real ClientApp, in-process grid): a scheduled one
and a live one submitted through the gRPC service are both checked after their relearning
window (``verified`` or ``unverified``: the lifecycle is tested here, a tiny run's forgetting
figures are its own; tests/test_erasure_certificate.py tests how they are read)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from inprocess import CHECKED, InProcessGrid, checked_rows

from clients.app import app as client_app
from fedasync.events import read_events
from server.app import run_server
from server.erasure.certificate import build
from server.erasure.store import ErasureStore

ERASE = (
    "lab.erasure.relearn_versions=4",
    "unlearning.steps=5",
    "server.eval_every=5",
    "lab.backdoor.enabled=true",
    "lab.backdoor.silo=1",
    "lab.backdoor.target_label=0",
)


def test_scheduled_whole_silo_erasure_is_checked_after_its_window(small_cfg):
    # Prepare
    cfg = small_cfg("run.max_versions=30", "erasures=[{silo: 1, at_s: 10}]", *ERASE)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    # Execute
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    # Assert
    (req,) = summary["erasures"]["requests"]
    assert req["state"] in CHECKED and req["silo"] == 1 and req["requester"] == "schedule"
    (row,) = checked_rows(summary)
    boundary = row["boundary_version"]
    for key in ("forget_accuracy", "test_accuracy", "mia_auc", "asr"):
        assert key in row["at_boundary"] and key in row["after_relearn"]
    # how far the model went back toward the pre-erasure one: a finite ratio, < 1 (it did not
    # return all the way) after a few versions of the others' training
    assert row["after_relearn"]["reversion_ratio"] < 1.0
    events = read_events(run_dir / "metrics.jsonl")
    states = [e["state"] for e in events if e["event"] == "erasure"]
    # the server's removal is in force at once, before the silo is sent its own part (what
    # the held-out bound withheld of it follows in steps: removed_more)
    states = [s for s in states if s != "removed_more"]
    assert states == ["removed", "erasing", "calibrating", req["state"]]
    after = [e for e in events if e["event"] == "update" and e["version"] >= boundary]
    assert after and all(e["silo"] != 1 for e in after), "an erased silo never trains again"
    # training never paused: others' updates were taken while silo 1 was erasing
    assert row["updates_from_others_while_erasing"] >= 1


def test_watching_an_erasure_reports_its_metrics_between_boundary_and_verification(small_cfg):
    # Prepare: watch every version of the relearning window (4 versions)
    cfg = small_cfg(
        "run.max_versions=30", "erasures=[{silo: 1, at_s: 10}]", *ERASE, "lab.erasure.watch_every=1"
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    # Execute
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    # Assert: one watch at 1, 2 and 3 versions after the boundary, then the verification
    (row,) = checked_rows(summary)
    watches = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "erasure_watch"]
    assert [w["since_boundary"] for w in watches] == [1, 2, 3]
    assert [w["version"] for w in watches] == [row["boundary_version"] + k for k in (1, 2, 3)]
    for w in watches:
        assert w["silo"] == 1 and 0.0 <= w["asr"] <= 1.0 and w["reversion_ratio"] < 1.0


def test_sample_level_erasure_keeps_the_silo_training(small_cfg):
    """Relabelling, a share of one silo's samples: the silo keeps training without them."""
    cfg = small_cfg(
        "run.max_versions=30",
        "erasures=[{silo: 2, at_s: 10, fraction: 0.3}]",
        "unlearning.method=relabel",
        "lab.erasure.signature_dtype=float16",  # half the bytes; re-orthonormalised on arrival
        *ERASE,
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    (req,) = summary["erasures"]["requests"]
    assert req["state"] in CHECKED and req["samples"] > 0
    boundary = checked_rows(summary)[0]["boundary_version"]
    events = read_events(run_dir / "metrics.jsonl")
    assert any(
        e["event"] == "update" and e["silo"] == 2 and e["version"] > boundary for e in events
    )


def test_live_erasure_through_the_service(small_cfg, tmp_path):
    from simulations.erase_cli import main as erase

    cfg = small_cfg(
        "run.max_versions=400",
        "erasures=[{silo: 1, at_s: 5}]",
        "unlearning.service=true",
        "unlearning.address=127.0.0.1:0",
        *ERASE,
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(run_server(InProcessGrid(client_app, 3), cfg, run_dir))
    )
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "erasure_address").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        address = (run_dir / "erasure_address").read_text().strip()
        token = json.loads((run_dir / "tokens.json").read_text())["silo-2"]
        common = ["--whole-silo", "--address", address, "--token", token]
        assert erase(["submit", "--silo", "2", *common, "--key", "k1"]) == 0
        # a silo may not erase another silo's data
        assert erase(["submit", "--silo", "0", *common]) != 0
    finally:
        worker.join(timeout=300)
    states = {r["silo"]: r["state"] for r in result["erasures"]["requests"]}
    assert set(states) == {1, 2} and set(states.values()) <= CHECKED, states


def test_only_the_halting_strategy_halts_for_an_erasure_and_rebuilds(small_cfg):
    """The erasure policy is the strategy's: the coordinator is given it, it never asks the mode."""
    from server.strategies import STRATEGIES, strategy_for

    policy = {
        name: (cls.halts_for_erasure, cls.rebuilds_for_erasure) for name, cls in STRATEGIES.items()
    }
    assert policy.pop("federaser") == (True, True)
    assert set(policy.values()) == {(False, False)}
    assert strategy_for(small_cfg("server.mode=federaser")).halts_for_erasure


def test_federaser_baseline_rebuilds_without_the_silo(small_cfg):
    """Halting FedEraser (server.mode=federaser): the model is rebuilt from the initial one by calibration
    rounds of the remaining silos only (half the local steps), one per retained round, while
    nobody trains; then training resumes without the silo."""
    cfg = small_cfg(
        "run.max_versions=12",
        "server.mode=federaser",
        "erasures=[{silo: 1, at_s: 10}]",
        "lab.erasure.federaser_interval=2",
        *ERASE,
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    (row,) = checked_rows(summary)
    boundary = row["boundary_version"]
    events = read_events(run_dir / "metrics.jsonl")
    erasing_t = next(e["t"] for e in events if e["event"] == "erasure" and e["state"] == "erasing")
    rounds_before = len(
        {e["version"] for e in events if e["event"] == "update" and e["t"] <= erasing_t}
    )
    # one calibration round per retained (every 2nd) round before the request
    assert row["at_boundary"]["silo_federaser_rounds"] == len(range(0, rounds_before, 2)) >= 1
    assert row["updates_from_others_while_erasing"] == 0  # the federation was halted
    after = [e for e in events if e["event"] == "update" and e["version"] >= boundary]
    assert after and {e["silo"] for e in after} == {0, 2}
    # a rebuild is calibration training (half of client.local_steps), never folded as updates
    applied_t = next(
        e["t"] for e in events if e["event"] == "erasure" and e["state"] == "calibrating"
    )
    assert not [e for e in events if e["event"] == "update" and erasing_t < e["t"] < applied_t]
    assert summary["versions"] == 12 and row["erasure_latency_s"] > 0


def test_the_halting_baseline_erases_whole_silos_only(small_cfg):
    """FedEraser rebuilds without a whole silo: a sample-level request fails, with the reason,
    and the federation goes on (it is not left halted)."""
    cfg = small_cfg(
        "run.max_versions=10",
        "server.mode=federaser",
        "erasures=[{silo: 1, at_s: 10, fraction: 0.5}]",
        *ERASE,
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    (req,) = summary["erasures"]["requests"]
    assert req["state"] == "failed"
    events = read_events(run_dir / "metrics.jsonl")
    failed_t = next(e["t"] for e in events if e.get("state") == "failed")
    after = [e for e in events if e["event"] == "update" and e["t"] > failed_t]
    assert summary["versions"] == 10 and {e["silo"] for e in after} == {0, 1, 2}


def test_excluded_silo_never_trains(small_cfg):
    cfg = small_cfg("run.max_versions=10", "lab.exclude=[0]")
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    assert summary["per_silo"]["0"]["accepted"] == 0 and summary["versions"] == 10


def test_server_restart_mid_erasure_finishes_it_once(small_cfg):
    """The server stops while a silo is erasing; resumed, the erasure is carried out again
    from the store and checked after its window, and it is applied exactly once."""
    from server.erasure.store import ErasureStore

    first = small_cfg("run.max_versions=12", "erasures=[{silo: 1, at_s: 8}]", *ERASE)
    run_dir = Path(first.run.out_dir) / first.run.name
    summary = run_server(InProcessGrid(client_app, 3), first, run_dir)
    (req,) = summary["erasures"]["requests"]
    assert req["state"] == "erasing", "the run stopped mid-erasure"
    second = small_cfg(
        "run.max_versions=40", "erasures=[{silo: 1, at_s: 8}]", "run.resume=true", *ERASE
    )
    summary = run_server(InProcessGrid(client_app, 3), second, run_dir)
    (req,) = summary["erasures"]["requests"]
    assert req["state"] in CHECKED
    with ErasureStore(run_dir / "erasures.sqlite") as store:
        actions = [(a.from_state, a.to_state) for a in store.audit(req["id"])]
    assert actions.count(("erasing", "calibrating")) == 1, actions
    events = read_events(run_dir / "metrics.jsonl")
    assert [e["state"] for e in events if e["event"] == "erasure"].count("calibrating") == 1


def test_calibration_projects_later_updates_and_drop_rule_counts(small_cfg):
    """After the boundary every update is calibrated (its overlap with the erased data's
    signature is logged); under the drop rule, work based before the boundary is rejected."""
    cfg = small_cfg(
        "run.max_versions=30",
        "erasures=[{silo: 1, at_s: 10}]",
        "lab.erasure.pre_boundary=drop",
        "lab.erasure.calibration_target=reply",  # each reply projected: its overlap logged
        *ERASE,
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    boundary = summary["erasures"]["applied"][0]["boundary_version"]
    assert summary["updates_rejected"].get("crossed_boundary", 0) >= 1
    events = read_events(run_dir / "metrics.jsonl")
    later = [e for e in events if e["event"] == "update" and e["version"] >= boundary]
    assert later and all(0.0 <= e["calibration_overlap"] <= 1.0 for e in later)
    earlier = [e for e in events if e["event"] == "update" and e["version"] < boundary]
    assert all("calibration_overlap" not in e for e in earlier)


def test_relearning_attack_is_sent_to_its_silo_after_its_time(small_cfg):
    cfg = small_cfg(
        "run.max_versions=20",
        "lab.backdoor.enabled=true",
        "lab.backdoor.silo=1",
        "lab.backdoor.relearn_silo=2",
        "lab.backdoor.relearn_after_s=8",
    )
    grid = InProcessGrid(client_app, 3)
    run_server(grid, cfg, Path(cfg.run.out_dir) / cfg.run.name)
    flags = [
        (m.metadata.dst_node_id, bool(m.content["config"]["relearn"]))
        for m in grid.pushed
        if m.metadata.message_type == "train"
    ]
    assert any(flag for node, flag in flags if node == 1002)
    assert not any(flag for node, flag in flags if node != 1002)
    assert not flags[0][1], "not before relearn_after_s"


def test_restart_while_calibrating_keeps_the_erasure(small_cfg):
    """Stopped after the erasure was applied but before it was checked, a resumed run keeps
    the erased silo retired and checks the request after its window."""
    common = ("erasures=[{silo: 1, at_s: 5}]", *ERASE, "lab.erasure.relearn_versions=15")
    first = small_cfg("run.max_versions=20", *common)
    run_dir = Path(first.run.out_dir) / first.run.name
    summary = run_server(InProcessGrid(client_app, 3), first, run_dir)
    assert [r["state"] for r in summary["erasures"]["requests"]] == ["calibrating"]
    boundary = summary["erasures"]["applied"][0]["boundary_version"]
    second = small_cfg("run.max_versions=45", "run.resume=true", *common)
    summary = run_server(InProcessGrid(client_app, 3), second, run_dir)
    (req,) = summary["erasures"]["requests"]
    assert req["state"] in CHECKED
    events = read_events(run_dir / "metrics.jsonl")
    later = [e for e in events if e["event"] == "update" and e["version"] >= boundary]
    assert later and all(e["silo"] != 1 for e in later)


def test_a_request_verified_after_the_checkpoint_is_not_verified_again(small_cfg):
    """The store can be ahead of the checkpoint: the server verified the erasure, then died
    before its next checkpoint. The resumed run (which restores it as calibrating) leaves it
    verified, once, instead of failing on verified -> verified (seen in a deployment under
    load: the resumed ServerApp exited with InvalidTransition)."""
    from server.erasure.states import State
    from server.erasure.store import ErasureStore

    # Prepare: a checkpoint with the request calibrating; the store moved on to verified
    common = ("erasures=[{silo: 1, at_s: 5}]", *ERASE, "lab.erasure.relearn_versions=15")
    first = small_cfg("run.max_versions=20", *common)
    run_dir = Path(first.run.out_dir) / first.run.name
    summary = run_server(InProcessGrid(client_app, 3), first, run_dir)
    (req,) = summary["erasures"]["requests"]
    assert req["state"] == "calibrating"
    with ErasureStore(run_dir / "erasures.sqlite") as store:
        store.transition(req["id"], State.VERIFIED, actor="server", model_version=20)
    # Execute: resume past the point where it would be verified again
    second = small_cfg("run.max_versions=45", "run.resume=true", *common)
    summary = run_server(InProcessGrid(client_app, 3), second, run_dir)
    # Assert: verified, by one transition only
    assert [r["state"] for r in summary["erasures"]["requests"]] == ["verified"]
    with ErasureStore(run_dir / "erasures.sqlite") as store:
        verified = [
            a
            for a in store.audit(req["id"])
            if a.action == "transition" and a.to_state is State.VERIFIED
        ]
    assert len(verified) == 1


def test_drop_rule_rejects_stale_work_without_calibration_too(small_cfg):
    """drop-all-stale is a policy of its own: with the calibration off, work based before the
    boundary is still rejected, and nothing is projected."""
    cfg = small_cfg(
        "run.max_versions=30",
        "erasures=[{silo: 1, at_s: 10}]",
        "lab.erasure.pre_boundary=drop",
        "lab.erasure.calibration=false",
        *ERASE,
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    assert summary["updates_rejected"].get("crossed_boundary", 0) >= 1
    updates = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "update"]
    assert updates and all("calibration_overlap" not in e for e in updates)


def test_watching_the_backdoor_adds_its_metrics_to_every_evaluation(small_cfg):
    """lab.backdoor.watch: each eval event carries the backdoored silo's verification metrics, in a
    run without any erasure (the retraining reference's time series)."""
    cfg = small_cfg(
        "run.max_versions=10", "server.eval_every=5", *ERASE[3:], "lab.backdoor.watch=true"
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    evals = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "eval"]
    assert len(evals) >= 2
    for e in evals:
        for key in ("bd_asr", "bd_asr_without_trigger", "bd_forget_accuracy", "bd_mia_auc"):
            assert 0.0 <= e[key] <= 1.0, (key, e)
        assert "bd_test_accuracy" not in e  # that is the eval's own score


def test_an_erasure_the_run_ends_before_checking_says_so(small_cfg):
    # Prepare: a relearning window far longer than what is left of the run
    cfg = small_cfg(
        "run.max_versions=16", "erasures=[{silo: 1, at_s: 4}]", *ERASE,
        "lab.erasure.relearn_versions=1000",
    )  # fmt: skip
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    # Execute
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    # Assert: still calibrating, never called verified; its row, its audit log and its
    # certificate say it was not checked within the run, and why
    (req,) = summary["erasures"]["requests"]
    (row,) = summary["erasures"]["applied"]
    assert req["state"] == "calibrating" and not summary["erasures"]["verified"]
    assert row["reading"].startswith("not checked within the run: the run ended at version")
    with ErasureStore(run_dir / "erasures.sqlite") as store:
        notes = [a.detail for a in store.audit(req["id"]) if a.action == "note"]
        cert = build(store, req["id"], events=run_dir / "metrics.jsonl")
    assert row["reading"] in notes
    assert cert["verdict"]["reading"] == "calibrating"
    assert {"check": "the relearning check", "why": row["reading"]} in cert["not_verified"]
