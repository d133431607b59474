"""An erasure cannot wreck the model or starve a silo (issue 9).

- its delta is bounded like any update (clipped, reported; the erasure still happens);
- its size follows the forget set's share of the silo's data;
- every report carries the test score just before and just after the boundary;
- a request whose ids cover all of a silo's samples is a whole-silo erasure;
- a silo left with no data refuses training once, and is sent no more.

In-process (real ServerApp loop, real ClientApp).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from inprocess import CHECKED, InProcessGrid, checked_rows

from clients.app import NO_DATA
from clients.app import app as client_app
from fedasync.events import read_events
from fedasync.tensors import global_norm
from fedasync.unlearning import forget_share_scale
from protocol import keys as P
from protocol import wire
from server.app import run_server
from server.erasure.certificate import build
from server.erasure.store import ErasureStore
from server.loop import AsyncServer
from server.unlearning import ErasureCoordinator

SILO_1 = 1001  # InProcessGrid's node of silo 1
FAST = (
    "lab.erasure.relearn_versions=3",
    "server.eval_every=5",
    # the silo's delta alone at the boundary (fixed steps, no server removal): what is bounded
    "unlearning.stop=fixed",
    "lab.erasure.server_removal=false",
)


class _Inflating(InProcessGrid):
    """Silo 1 answers train.unlearn with its erasure delta multiplied by ``gain`` (a silo that
    would degrade everyone's model on purpose)."""

    def __init__(self, *args, gain: float = 1000.0):
        super().__init__(*args)
        self.gain = gain

    def push_messages(self, messages):
        ids = list(super().push_messages(messages))
        for mid, msg in zip(ids, messages, strict=True):
            if msg.metadata.message_type == "train.unlearn" and msg.metadata.dst_node_id == SILO_1:
                reply = self.replies[mid]
                delta = wire.decode(reply.content[P.ARRAYS])
                big = {k: v * self.gain if v.is_floating_point() else v for k, v in delta.items()}
                reply.content[P.ARRAYS] = wire.encode(big)
        return ids


@pytest.fixture
def boundary_moves(monkeypatch):
    """How far (L2) each erasure moved the global model at its boundary."""
    moves: list[float] = []
    orig = AsyncServer.apply_erasure

    def spy(self, params):
        moves.append(
            global_norm(
                {k: params[k] - self.params[k] for k in params if params[k].is_floating_point()}
            )
        )
        return orig(self, params)

    monkeypatch.setattr(AsyncServer, "apply_erasure", spy)
    return moves


def test_an_oversize_erasure_delta_is_clipped_and_reported(small_cfg, boundary_moves):
    # Prepare: silo 1's erasure delta comes back 1000x larger than its PGA ball allows
    cfg = small_cfg("run.max_versions=30", "erasures=[{silo: 1, at_s: 10}]", *FAST)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    # Execute
    summary = run_server(_Inflating(client_app, 3), cfg, run_dir)
    # Assert: carried out (checked after its window; whether it erased well is its forgetting
    # figures', not this test's), the model moved by at most the bound, the clip reported
    (req,) = summary["erasures"]["requests"]
    assert req["state"] in CHECKED
    (move,) = boundary_moves
    assert move <= cfg.lab.erasure.radius * (1 + 1e-3)  # a whole silo: the full radius at most
    (row,) = checked_rows(summary)
    m = row["at_boundary"]
    bound = m["delta_bound"]
    assert move <= bound * (1 + 1e-4)
    assert m["delta_norm"] > 10 * bound and m["clip_factor"] < 0.1
    events = read_events(run_dir / "metrics.jsonl")
    (cal,) = [e for e in events if e["event"] == "erasure" and e["state"] == "calibrating"]
    assert cal["clip_factor"] == m["clip_factor"]
    # ...and the certificate reads the clip as the bound doing its job: the delta applied is
    # within its bound, the share applied shown beside it, and no verdict of the bound check
    with ErasureStore(run_dir / "erasures.sqlite") as store:
        cert = build(store, req["id"], events=run_dir / "metrics.jsonl")
    (bound_check,) = [c for c in cert["checks"] if c["id"] == "bound"]
    figs = {f["name"]: f for f in bound_check["figures"]}
    assert figs["delta_applied"]["verdict"] == "within"
    assert figs["delta_applied"]["value"] == pytest.approx(bound, rel=1e-4)
    assert figs["clip_factor"]["verdict"] == figs["delta_norm"]["verdict"] == "informational"
    assert any("was clipped to its bound" in n for n in bound_check["notes"])
    assert "bound" not in {x["check"] for x in cert["verdict"]["not_within"]}


def test_the_norm_outlier_bound_and_clip_norm_apply_to_erasure_deltas(small_cfg, boundary_moves):
    # Prepare: server.clip_norm below the PGA radius: it is the tighter bound
    cfg = small_cfg(
        "run.max_versions=30", "erasures=[{silo: 1, at_s: 10}]", "server.clip_norm=0.05", *FAST
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    summary = run_server(_Inflating(client_app, 3), cfg, run_dir)
    assert boundary_moves[0] <= 0.05 * (1 + 1e-4)
    (row,) = checked_rows(summary)
    assert row["at_boundary"]["delta_bound"] <= 0.05


def test_erasure_size_follows_the_forget_share_and_the_dip_is_reported(small_cfg):
    # Prepare: 10% of silo 1's samples
    cfg = small_cfg("run.max_versions=30", "erasures=[{silo: 1, at_s: 10, fraction: 0.1}]", *FAST)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    grid = InProcessGrid(client_app, 3)
    # Execute
    summary = run_server(grid, cfg, run_dir)
    # Assert: the silo was asked for a ball of radius x share (linear rule), not the full one
    (msg,) = [m for m in grid.pushed if m.metadata.message_type == "train.unlearn"]
    sent = P.loads(str(msg.content[P.CONFIG][P.UNLEARN_JSON]))
    (req,) = summary["erasures"]["requests"]
    held = summary["per_silo"]["1"]["num_samples"]
    share = req["samples"] / held
    assert 0.05 < share < 0.2
    assert sent["radius"] == pytest.approx(cfg.lab.erasure.radius * share)
    events = read_events(run_dir / "metrics.jsonl")
    (erasing,) = [e for e in events if e["event"] == "erasure" and e["state"] == "erasing"]
    assert erasing["share"] == pytest.approx(share) and erasing["radius"] == sent["radius"]
    # ...and the report carries the score just before and just after the boundary
    (row,) = checked_rows(summary)
    m = row["at_boundary"]
    assert row["boundary_dip"] == pytest.approx(m["score_before"] - m["score_after"])
    assert 0.0 <= m["score_before"] <= 1.0 and 0.0 <= m["score_after"] <= 1.0
    # the watch stream (the store's metrics of the request) has them too
    with ErasureStore(run_dir / "erasures.sqlite") as store:
        metrics = store.get(req["id"]).metrics
    assert {"score_before", "score_after", "boundary_dip"} <= set(metrics)


@pytest.mark.parametrize(
    ("n", "held", "rule", "floor", "expected"),
    [
        (10, 100, "linear", 0.05, 0.1),
        (1, 100, "linear", 0.05, 0.05),  # the floor
        (25, 100, "sqrt", 0.05, 0.5),
        (1, 10_000, "sqrt", 0.05, 0.05),
        (3, 100, "none", 0.05, 1.0),
        (100, 100, "linear", 0.05, 1.0),  # the whole silo
        (5, 0, "linear", 0.05, 1.0),  # nothing known of the silo: no scaling
    ],
)
def test_forget_share_scale_by_hand(n, held, rule, floor, expected):
    assert forget_share_scale(n, held, rule, floor) == pytest.approx(expected)


def test_forget_share_scale_refuses_bad_rules():
    with pytest.raises(ValueError, match="rule"):
        forget_share_scale(1, 10, "cubic")
    with pytest.raises(ValueError, match="floor"):
        forget_share_scale(1, 10, "linear", 0.0)
    assert math.isclose(forget_share_scale(1, 4, "sqrt", 0.01), 0.5)


def test_a_list_of_every_sample_is_a_whole_silo_erasure(small_cfg):
    # Prepare: a sample list that covers all of silo 1's samples (fraction rounds to all)
    cfg = small_cfg(
        "run.max_versions=30", "erasures=[{silo: 1, at_s: 10, fraction: 0.9999}]", *FAST
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    # Execute
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    # Assert: the silo is retired, as a whole-silo erasure, and says why
    (req,) = summary["erasures"]["requests"]
    assert req["state"] in CHECKED and req["samples"] == summary["per_silo"]["1"]["num_samples"]
    (row,) = checked_rows(summary)
    assert row["scope"] == "silo"
    events = read_events(run_dir / "metrics.jsonl")
    (erasing,) = [e for e in events if e["event"] == "erasure" and e["state"] == "erasing"]
    assert "cover all" in erasing["whole_silo"] and "retired" in erasing["whole_silo"]
    with ErasureStore(run_dir / "erasures.sqlite") as store:
        details = [a.detail for a in store.audit(req["id"])]
    assert any("erased as a whole silo" in d for d in details)
    # ...no training job fails for want of data, and silo 1 never trains after the boundary
    assert summary["updates_rejected"].get("client_error", 0) == 0
    assert not [
        e
        for e in events
        if e["event"] == "update" and e["silo"] == 1 and e["version"] >= row["boundary_version"]
    ]


def test_a_silo_without_data_refuses_once_and_is_sent_no_more_training(small_cfg, monkeypatch):
    # Prepare: the coordinator's whole-silo conversion is bypassed, so silo 1 is left holding
    # only erased samples (the client's own defence is what is tested)
    monkeypatch.setattr(ErasureCoordinator, "_size", lambda self, e: "")
    cfg = small_cfg(
        "run.max_versions=30", "erasures=[{silo: 1, at_s: 10, fraction: 0.9999}]", *FAST
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    grid = InProcessGrid(client_app, 3)
    # Execute
    summary = run_server(grid, cfg, run_dir)
    # Assert: one typed refusal, silo 1 stopped, no crash loop of failing jobs
    assert summary["updates_rejected"].get("client_error", 0) == 0
    assert summary["per_silo"]["1"]["stopped"] == NO_DATA
    events = read_events(run_dir / "metrics.jsonl")
    (stop,) = [e for e in events if e["event"] == "silo_stopped"]
    assert stop["silo"] == 1
    boundary = summary["erasures"]["applied"][0]["boundary_version"]
    sent_after = [
        m
        for m in grid.pushed
        if m.metadata.message_type == "train"
        and m.metadata.dst_node_id == SILO_1
        and int(m.content[P.CONFIG][P.BASE_VERSION]) >= boundary
    ]
    assert len(sent_after) == 1, "one train message finds it without data; none after"
