"""The loop on the wall clock (deployment): TTLs, the budget's origin, polling, offline silos.

Driven through the real ClientApp on an in-process grid whose replies can be held back, so
that what a SuperLink would do (answer late, report a node offline) is played in-process.
"""

from __future__ import annotations

import time
from pathlib import Path

from flwr.app import Error, Message
from flwr.common.constant import ErrorCode
from inprocess import InProcessGrid

import server.loop
from clients.app import app as client_app
from fedasync.events import read_events
from server.app import run_server


class _SlowGrid(InProcessGrid):
    """Nodes appear after ``roster_delay_s``; each reply is visible ``reply_delay_s`` after its
    push; ``pulls`` counts calls of pull_messages."""

    def __init__(self, *args, roster_delay_s: float = 0.0, reply_delay_s: float = 0.0, **kw):
        super().__init__(*args, **kw)
        self.t0 = time.monotonic()
        self.roster_delay_s, self.reply_delay_s = roster_delay_s, reply_delay_s
        self.visible_at: dict[str, float] = {}
        self.pulls = 0

    def get_node_ids(self):
        return list(self.contexts) if time.monotonic() - self.t0 >= self.roster_delay_s else []

    def push_messages(self, messages):
        ids = list(super().push_messages(messages))
        for m in ids:
            self.visible_at[m] = time.monotonic() + self.reply_delay_s
        return ids

    def pull_messages(self, message_ids):
        self.pulls += 1
        now = time.monotonic()
        ready = [m for m in message_ids if m in self.replies and self.visible_at[m] <= now]
        return [self.replies.pop(m) for m in ready]


def _run(cfg, grid):
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    return run_server(grid, cfg, run_dir, wall_clock=True), run_dir


def test_every_message_carries_the_reply_timeout_as_ttl(small_cfg):
    # Prepare
    cfg = small_cfg("run.max_versions=3", "server.reply_timeout_s=45")
    grid = InProcessGrid(client_app, 3)
    # Execute
    _run(cfg, grid)
    # Assert: every train message; the roster query's TTL is its own timeout
    ttl = {(m.metadata.message_type, m.metadata.ttl) for m in grid.pushed}
    assert ttl == {("train", 45), ("query", 120)}  # server.wait_for_nodes_s


def test_budget_counts_from_the_first_dispatch(small_cfg, monkeypatch):
    # Prepare: the silos appear 1.5 s after the start, the budget is 3 s (the in-process grid
    # trains inside push_messages: on a loaded machine the first three jobs take a second)
    monkeypatch.setattr(server.loop, "POLL_INTERVAL_S", 0.01)
    cfg = small_cfg("run.budget_s=3.0", "server.eval_every=1000")
    grid = _SlowGrid(client_app, 3, roster_delay_s=1.5)
    # Execute
    summary, run_dir = _run(cfg, grid)
    # Assert: training happened (the roster wait did not eat the budget), for about 1 s after
    # the roster, and no update was taken once the budget was over
    assert summary["versions"] >= 1
    events = read_events(run_dir / "metrics.jsonl")
    roster = next(e for e in events if e["event"] == "roster")
    end = next(e for e in events if e["event"] == "end")
    updates = [e["t"] for e in events if e["event"] == "update"]
    assert roster["t"] >= 1.4
    assert end["t"] >= roster["t"] + 3.0  # the budget started at the first dispatch
    assert max(updates) <= roster["t"] + 3.0 + 1.5  # a poll, a push and a fold past it at most


def test_wall_clock_polls_at_the_interval(small_cfg, monkeypatch):
    # Prepare: every reply arrives 0.6 s after its push
    monkeypatch.setattr(server.loop, "POLL_INTERVAL_S", 0.2)
    cfg = small_cfg("run.max_versions=3")
    grid = _SlowGrid(client_app, 3, reply_delay_s=0.6)
    # Execute
    t0 = time.monotonic()
    summary, _ = _run(cfg, grid)
    # Assert: about one poll per 0.2 s of waiting (other steps of the loop also pull once:
    # allow twice that), not one per 5 ms (which would be ~40 times as many)
    waited = time.monotonic() - t0
    assert summary["versions"] == 3
    assert grid.pulls <= 2 * waited / 0.2 + 10, (grid.pulls, waited)


class _OfflineSilo(InProcessGrid):
    """Silo 2's node is offline for its first ``offline`` train messages: each is answered at
    once with the SuperLink's NODE_UNAVAILABLE error reply."""

    def __init__(self, *args, offline: int = 2, **kw):
        super().__init__(*args, **kw)
        self.offline = offline
        self.pushed_to_2: list[float] = []

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            if msg.metadata.message_type != "train" or msg.metadata.dst_node_id != 1002:
                ids.extend(super().push_messages([msg]))
                continue
            self.pushed_to_2.append(time.monotonic())
            if len(self.pushed_to_2) > self.offline:
                ids.extend(super().push_messages([msg]))
                continue
            mid = f"offline-{len(self.pushed_to_2)}"
            msg.metadata.__dict__["_message_id"] = mid
            err = Error(code=ErrorCode.NODE_UNAVAILABLE, reason="node is offline")
            self.replies[mid] = Message(err, reply_to=msg)
            ids.append(mid)
        return ids


def test_offline_silo_is_retried_after_a_pause_not_at_once(small_cfg):
    # Prepare
    # a wall budget, not a version count: on an idle machine the two other silos make 30
    # versions before silo 2's second retry is due
    cfg = small_cfg("run.budget_s=5.0", "lab.offline_retry_s=0.3", "server.eval_every=1000")
    grid = _OfflineSilo(client_app, 3, offline=2)
    # Execute
    summary, run_dir = _run(cfg, grid)
    # Assert: two refusals, each followed by a pause of offline_retry_s; then silo 2 trains
    gaps = [b - a for a, b in zip(grid.pushed_to_2, grid.pushed_to_2[1:])]
    assert gaps[0] >= 0.3 and gaps[1] >= 0.3
    assert summary["updates_rejected"]["client_error"] == 2
    assert summary["per_silo"]["2"]["accepted"] >= 1
    rejects = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "reject"]
    assert all(e["silo"] == 2 and "offline" in e["detail"] for e in rejects)


def test_resume_sends_work_to_a_silo_that_was_between_jobs(small_cfg, tmp_path):
    """A checkpoint written while a reply is folded holds no job of that silo (its next one
    is sent right after); a resumed run must send it work, or it never trains again."""
    from server.checkpoint import load_state, save_state

    # Prepare: a run, and its checkpoint with silo 2's job removed
    first = small_cfg("run.max_versions=3", "server.checkpoint_every=1")
    _run(first, InProcessGrid(client_app, 3))
    path = tmp_path / "t" / "checkpoint.pt"
    state = load_state(path)
    state.jobs = [j for j in state.jobs if j["silo"] != 2]
    save_state(path, state)
    # Execute
    again = small_cfg("run.max_versions=9", "server.checkpoint_every=1", "run.resume=true")
    summary, run_dir = _run(again, InProcessGrid(client_app, 3))
    # Assert: silo 2 trained after the resume
    events = read_events(run_dir / "metrics.jsonl")
    resumed = max(i for i, e in enumerate(events) if e["event"] == "resume")
    assert any(e["event"] == "update" and e["silo"] == 2 for e in events[resumed:])
