"""Every bad-input case is rejected with its reason, counted, and leaves the model untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
from inprocess import InProcessGrid

from clients.app import app as client_app
from fedasync import FedAsyncAggregator
from fedasync.events import read_events
from server.app import run_server


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("nan", "non_finite"),
        ("wrong_shape", "shape_mismatch"),
        ("replay", "duplicate"),
        ("huge_norm", "norm_outlier"),
        ("future_version", "future_version"),
        ("unknown_silo", "unknown_silo"),
        ("crash", "client_error"),
    ],
)
def test_fault_is_rejected_and_model_untouched(small_cfg, monkeypatch, kind, reason):
    # Prepare: record every fold the aggregator performs
    folded: list[tuple[str, int]] = []
    orig = FedAsyncAggregator.fold

    def spy(self, params, update, tau, factor=1.0):
        folded.append((update.silo, update.base_version))
        return orig(self, params, update, tau, factor)

    monkeypatch.setattr(FedAsyncAggregator, "fold", spy)
    cfg = small_cfg(
        "run.max_versions=24", f"lab.faults=[{{kind: '{kind}', silo: 1, at_version: 4, down_s: 5}}]"
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    # Execute
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    # Assert
    assert summary["updates_rejected"] == {reason: 1}
    assert summary["versions"] == 24, "a bad reply never stops the loop"
    events = read_events(run_dir / "metrics.jsonl")
    (rej,) = [e for e in events if e["event"] == "reject"]
    assert rej["silo"] == 1 and rej["reason"] == reason and rej["detail"]
    assert len(folded) == summary["updates_applied"] == 24
    # the rejected job was never folded, and silo 1 came back to work afterwards
    later = [e for e in events if e["event"] == "update" and e["silo"] == 1 and e["t"] > rej["t"]]
    assert later, "the faulty silo is sent work again"
    assert not [e for e in events if e["event"] == "update" and e["job"] == rej["job"]]


class _SilentSilo(InProcessGrid):
    """Silo 2's node takes train messages and never answers."""

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            if msg.metadata.message_type == "train" and msg.metadata.dst_node_id == 1002:
                msg.metadata.__dict__["_message_id"] = f"silent-{len(self.pushed)}"
                self.pushed.append(msg)
                ids.append(msg.metadata.message_id)
            else:
                ids.extend(super().push_messages([msg]))
        return ids


def test_silent_silo_holds_nothing_up(small_cfg):
    cfg = small_cfg("run.max_versions=8", "server.reply_timeout_s=0.2")
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    summary = run_server(_SilentSilo(client_app, 3), cfg, run_dir)
    assert summary["versions"] == 8
    assert summary["per_silo"]["2"]["accepted"] == 0
    assert summary["updates_rejected"]["client_error"] >= 1
    events = read_events(run_dir / "metrics.jsonl")
    assert any("no reply within" in e.get("detail", "") for e in events if e["event"] == "reject")
