"""One silo, at most one job (train, unlearn or calibration) in flight, always, under crashes,
erasures and retries (issue 9: a silo erasing while a train job was in flight came back with
two training chains, 151 updates against its peers' 85, its crash's down time skipped).

In-process (real ServerApp loop, real ClientApp). The grid records, per node, every message
the server pushed whose reply the server has not yet taken; a push to a node that holds one is
the violation. The server's own guard (``Dispatcher.send``, server/dispatch.py) must never have had to refuse.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Error, Message
from flwr.common.constant import ErrorCode
from inprocess import CHECKED, InProcessGrid

from clients.app import app as client_app
from fedasync.events import read_events
from server.app import run_server
from server.cancel import JobCanceller
from server.loop import AsyncServer

SILO_1 = 1001  # InProcessGrid's node of silo 1
DOWN_S = 15.0


class _Watched(InProcessGrid):
    """Records pushes that find their node still holding an untaken job; reports silo 1 offline
    for its first train.unlearn message (a retry that must wait ``lab.offline_retry_s``)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.holding: dict[int, set[str]] = {}
        self.violations: list[tuple[float, int, str]] = []
        self.pushes: list[tuple[float, int, str]] = []  # (clock time, node, message type)
        self.server: AsyncServer | None = None
        self.unlearn_sent = 0

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            node, kind = msg.metadata.dst_node_id, msg.metadata.message_type
            if not kind.startswith("train"):  # the roster's query: not a job
                ids.extend(super().push_messages([msg]))
                continue
            now = self.server.clock.now if self.server is not None else 0.0
            if self.holding.get(node):
                self.violations.append((now, node, kind))
            self.pushes.append((now, node, kind))
            if kind == "train.unlearn" and node == SILO_1:
                self.unlearn_sent += 1
                if self.unlearn_sent == 1:  # the SuperLink reports the node offline
                    mid = "offline-1"
                    msg.metadata.__dict__["_message_id"] = mid
                    self.pushed.append(msg)
                    err = Error(code=ErrorCode.NODE_UNAVAILABLE, reason="node offline")
                    self.replies[mid] = Message(err, reply_to=msg)
                    self.holding.setdefault(node, set()).add(mid)
                    ids.append(mid)
                    continue
            (mid,) = super().push_messages([msg])
            self.holding.setdefault(node, set()).add(mid)
            ids.append(mid)
        return ids


def test_one_job_per_silo_under_crashes_erasures_and_retries(small_cfg, monkeypatch):
    # Prepare: train jobs (10 steps) outlast erasure jobs (2 + 1 steps), so silo 1 holds a train
    # job whenever an erasure of it is submitted; its first erasure message finds it offline;
    # it crashes later (down 15 s) and a second erasure is submitted while it is down
    grid = _Watched(client_app, 3)
    orig_take = AsyncServer._take

    def take(self, job, reply):
        grid.server = self
        grid.holding[job.node_id].discard(job.msg_id)  # the server has taken this job's reply
        return orig_take(self, job, reply)

    monkeypatch.setattr(AsyncServer, "_take", take)
    orig_cancel = JobCanceller.cancel

    def cancel(self, silo, request_id):
        job = orig_cancel(self, silo, request_id)
        if job is not None:  # the server dropped this job: its reply will never be taken
            grid.holding[job.node_id].discard(job.msg_id)
        return job

    monkeypatch.setattr(JobCanceller, "cancel", cancel)
    cfg = small_cfg(
        "run.max_versions=70",
        "client.local_steps=10",
        "unlearning.steps=2",
        "lab.erasure.signature_batches=1",
        "lab.erasure.relearn_versions=3",
        "lab.offline_retry_s=4",
        "server.eval_every=10",
        "erasures=[{silo: 1, at_s: 12, fraction: 0.1}, {silo: 1, at_s: 75, fraction: 0.1}]",
        f"lab.faults=[{{kind: crash, silo: 1, at_version: 14, down_s: {DOWN_S}}}]",
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    # Execute
    summary = run_server(grid, cfg, run_dir)
    # Assert: the scenario happened (both erasures applied and checked after their window,
    # one retried, the crash fired)
    states = [r["state"] for r in summary["erasures"]["requests"]]
    assert len(states) == 2 and set(states) <= CHECKED and grid.unlearn_sent == 3, states
    events = read_events(run_dir / "metrics.jsonl")
    (crash,) = [e for e in events if e["event"] == "reject" and e["reason"] == "client_error"]
    assert crash["silo"] == 1
    # ...one job per silo, always, and the guard never had to refuse a second one
    assert grid.violations == []
    assert [e for e in events if e["event"] == "dispatch_refused"] == []
    assert summary["dispatches_refused"] == 0
    # ...the crash's down time was kept: nothing sent to silo 1 while it was down
    assert not [
        (t, k) for t, n, k in grid.pushes if n == SILO_1 and crash["t"] < t < crash["t"] + DOWN_S
    ]
    # ...and silo 1, which erased twice and was down, did not out-train its peers
    accepted = {s: summary["per_silo"][s]["accepted"] for s in ("0", "1", "2")}
    assert 0 < accepted["1"] <= min(accepted["0"], accepted["2"]), accepted
    # ...each erasure cancelled silo 1's training job in flight (it would have outlasted the
    # erasure), whose reply was discarded, never folded
    cancelled = [e for e in events if e["event"] == "job_cancelled"]
    discarded = [e for e in events if e["event"] == "reply_discarded"]
    assert cancelled and {e["silo"] for e in cancelled} == {1}
    assert sorted(e["job"] for e in discarded) == sorted(e["job"] for e in cancelled)
    folded = {e.get("job") for e in events if e["event"] == "update"}
    assert not folded & {e["job"] for e in cancelled}
    assert summary["jobs_cancelled"] == len(cancelled) == summary["cancelled_replies_discarded"]


def test_the_dispatch_guard_refuses_a_second_job_and_says_so(small_cfg, monkeypatch):
    # Prepare: a buggy path asks for work for silo 1 (busy) whenever silo 0's reply is taken,
    # and for silo 2 while it waits out a crash
    grid = _Watched(client_app, 3)
    orig_take = AsyncServer._take

    def take(self, job, reply):
        grid.server = self
        grid.holding[job.node_id].discard(job.msg_id)
        ok = orig_take(self, job, reply)
        if job.silo == 0:
            self.dispatch(1)
            self.dispatch(2)
        return ok

    monkeypatch.setattr(AsyncServer, "_take", take)
    cfg = small_cfg(
        "run.max_versions=12", "lab.faults=[{kind: crash, silo: 2, at_version: 2, down_s: 30}]"
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    # Execute
    summary = run_server(grid, cfg, run_dir)
    # Assert: refused every time, never sent, each refusal logged as an event with its reason
    assert grid.violations == []
    events = read_events(run_dir / "metrics.jsonl")
    refused = [e for e in events if e["event"] == "dispatch_refused"]
    assert refused and summary["dispatches_refused"] == len(refused)
    assert {e["silo"] for e in refused} <= {1, 2}
    assert any("in flight" in e["detail"] for e in refused if e["silo"] == 1)
    assert any("down until" in e["detail"] for e in refused if e["silo"] == 2)
    (crash,) = [e for e in events if e["event"] == "reject"]
    assert not [t for t, n, _ in grid.pushes if n == 1002 and crash["t"] < t < crash["t"] + 30]
