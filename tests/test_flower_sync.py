"""The adapter of Flower's FedAvg to our protocol (server/flower_sync.py), without a deployment."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from inprocess import InProcessGrid, set_task_identity

from clients.app import app as client_app
from fedasync.events import EventLog, read_events
from protocol import keys as P
from protocol import wire
from server.config import FedAsyncConfig
from server.flower_sync import BudgetSpent, ProtocolFedAvg, mean_delta_step, run_flower_fedavg


def test_mean_delta_step_weights_deltas_by_samples() -> None:
    # Prepare: x = [1, 2], deltas [3, 0] (10 samples) and [0, 6] (30 samples)
    params = {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor(7)}
    deltas = [
        ({"w": torch.tensor([3.0, 0.0]), "steps": torch.tensor(1)}, 10),
        ({"w": torch.tensor([0.0, 6.0]), "steps": torch.tensor(2)}, 30),
    ]
    # Execute
    out = mean_delta_step(params, deltas)
    # Assert: x + (10 [3, 0] + 30 [0, 6]) / 40 = [1 + 0.75, 2 + 4.5]; integer buffers kept
    torch.testing.assert_close(out["w"], torch.tensor([1.75, 6.5]))
    assert int(out["steps"]) == 7


def test_mean_delta_step_refuses_no_samples() -> None:
    with pytest.raises(ValueError):
        mean_delta_step({"w": torch.zeros(1)}, [])


class FakeGrid:
    """Two connected nodes; nothing is sent."""

    def get_node_ids(self) -> list[int]:
        return [11, 22]


def _reply(msg: Message, silo: int, delta: list[float], n: int, train_s: float) -> Message:
    msg.metadata.__dict__["_message_id"] = f"sent-{silo}"  # as pushing it would
    cfg: Any = msg.content[P.CONFIG]
    metrics = MetricRecord(
        {
            P.SILO: silo,
            P.BASE_VERSION: int(cfg[P.BASE_VERSION]),
            P.JOB_ID: int(cfg[P.JOB_ID]),
            P.NUM_SAMPLES: n,
            P.TRAIN_SECONDS: train_s,
            "train_loss": 0.5,
        }
    )
    arrays = wire.encode({"w": torch.tensor(delta), "b": torch.tensor([0.0])})
    return Message(RecordDict({P.ARRAYS: arrays, P.METRICS: metrics}), reply_to=msg)


def test_one_round_sends_our_config_and_folds_replies(tmp_path: Path) -> None:
    # Prepare: two silos, model w = [0, 0]
    set_task_identity()
    cfg = FedAsyncConfig()
    cfg.silos.count = 2
    params = {"w": torch.zeros(2), "b": torch.zeros(1)}
    events = EventLog(tmp_path / "metrics.jsonl")
    strategy = ProtocolFedAvg(cfg, params, events, time.monotonic())
    # Execute: round 1
    msgs = list(strategy.configure_train(1, wire.encode(params), ConfigRecord(), FakeGrid()))  # type: ignore[arg-type]
    # Assert: one message per node, each with its own job id and our config keys
    assert sorted(int(m.metadata.dst_node_id) for m in msgs) == [11, 22]
    confs: list[Any] = [m.content[P.CONFIG] for m in msgs]
    assert sorted(int(c[P.JOB_ID]) for c in confs) == [0, 1]
    assert all(int(c[P.BASE_VERSION]) == 0 and P.SETUP in c and P.SEED in c for c in confs)
    torch.testing.assert_close(wire.decode(msgs[0].content[P.ARRAYS])["w"], torch.zeros(2))
    # Execute: replies with deltas [4, 0] (1 sample) and [0, 4] (3 samples)
    replies = [_reply(msgs[0], 0, [4.0, 0.0], 1, 0.25), _reply(msgs[1], 1, [0.0, 4.0], 3, 0.5)]
    arrays, _ = strategy.aggregate_train(1, replies)
    # Assert: w = (1 [4, 0] + 3 [0, 4]) / 4 = [1, 3]; the new model is what goes out next
    assert arrays is not None and strategy.version == 1
    torch.testing.assert_close(strategy.params["w"], torch.tensor([1.0, 3.0]))
    torch.testing.assert_close(wire.decode(arrays)["w"], torch.tensor([1.0, 3.0]))
    assert [m["train_seconds"] for m in strategy.messages] == [0.25, 0.5]
    assert all(m["taken"] >= m["dispatched"] for m in strategy.messages)
    nxt = list(strategy.configure_train(2, arrays, ConfigRecord(), FakeGrid()))  # type: ignore[arg-type]
    assert all(int(m.content[P.CONFIG][P.BASE_VERSION]) == 1 for m in nxt)  # type: ignore[arg-type]
    torch.testing.assert_close(wire.decode(nxt[0].content[P.ARRAYS])["w"], torch.tensor([1.0, 3.0]))
    events.close()


def test_no_round_starts_after_the_budget(tmp_path: Path) -> None:
    cfg = FedAsyncConfig()
    cfg.silos.count = 2
    cfg.run.budget_s = 1.0
    set_task_identity()
    events = EventLog(tmp_path / "metrics.jsonl")
    strategy = ProtocolFedAvg(cfg, {"w": torch.zeros(2)}, events, time.monotonic())
    strategy.started_at = strategy.now() - 2.0  # the first dispatch was 2 s ago
    with pytest.raises(BudgetSpent):
        strategy.configure_train(3, wire.encode(strategy.params), ConfigRecord(), FakeGrid())  # type: ignore[arg-type]
    events.close()


class _BlockingGrid(InProcessGrid):
    """The in-process grid with Flower's blocking ``send_and_receive`` (all replies at once)."""

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        return list(self.pull_messages(self.push_messages(messages)))


def test_flower_fedavg_runs_rounds_with_the_real_clientapp(small_cfg: Any) -> None:
    # Prepare: 3 silos, 2 rounds
    cfg = small_cfg("run.max_versions=2")
    grid = _BlockingGrid(client_app, 3)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    # Execute
    summary = run_flower_fedavg(grid, cfg, run_dir)  # type: ignore[arg-type]
    # Assert: every silo once per round, each reply's training timed, the model evaluated
    # before the first round and after each
    assert summary["versions"] == 2
    assert sorted((m["round"], m["silo"]) for m in summary["messages"]) == [
        (r, s) for r in (1, 2) for s in range(3)
    ]
    assert all(m["train_seconds"] > 0 for m in summary["messages"])
    assert [e["version"] for e in summary["evals"]] == [0, 1, 2]
    assert (run_dir / "summary.json").exists()
    events = [e["event"] for e in read_events(run_dir / "metrics.jsonl")]
    assert events.count("update") == 6 and events[0] == "start" and events[-1] == "end"
