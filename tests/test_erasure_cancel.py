"""An erasure request cancels its silo's training job in flight (server/cancel.py): the
erasure starts at the request, not when that job (a straggler's, say) would have come back,
and the job's reply is discarded, never folded.

In-process (real ServerApp loop, real ClientApp, virtual clock); the canceller's bookkeeping
of a reply still to come is checked on its own with a grid that holds replies back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.app import Message, RecordDict
from inprocess import CHECKED, InProcessGrid, set_task_identity

from clients.app import app as client_app
from fedasync.clock import VirtualClock
from fedasync.events import EventLog, read_events
from server.app import run_server
from server.cancel import JobCanceller
from server.dispatch import Dispatcher
from server.intake import Job, JobKind


def _run(small_cfg, *extra: str):
    cfg = small_cfg(
        "run.max_versions=24",
        "client.local_steps=12",  # a training job outlasts the erasure's 2 + 1 steps
        "unlearning.steps=2",
        "lab.erasure.signature_batches=1",
        "lab.erasure.relearn_versions=2",
        "erasures=[{silo: 1, at_s: 5, fraction: 0.2}]",
        *extra,
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    summary = run_server(InProcessGrid(client_app, 3), cfg, run_dir)
    (request,) = summary["erasures"]["requests"]
    assert request["state"] in CHECKED  # the window ended (how well it forgot: not tested here)
    (row,) = summary["erasures"]["applied"]
    return summary, row, read_events(run_dir / "metrics.jsonl")


def test_an_erasure_starts_at_its_request_and_the_job_in_flight_is_discarded(small_cfg):
    # Execute: the same run, with and without cancelling the job in flight
    summary, row, events = _run(small_cfg)
    _, row_wait, events_wait = _run(small_cfg, "lab.erasure.cancel_inflight=false", "run.name=w")
    # Assert: cancelled at the request; the erasure started then
    (cancel,) = [e for e in events if e["event"] == "job_cancelled"]
    assert cancel["silo"] == 1 and cancel["t"] == row["submitted_t"] == row["started_t"]
    assert cancel["would_finish_at"] > row["submitted_t"]
    # ...its reply discarded, never folded
    (dropped,) = [e for e in events if e["event"] == "reply_discarded"]
    assert dropped["job"] == cancel["job"] and "cancelled for erasure" in dropped["reason"]
    assert cancel["job"] not in {e["job"] for e in events if e["event"] == "update"}
    assert summary["jobs_cancelled"] == summary["cancelled_replies_discarded"] == 1
    assert summary["cancelled_replies_outstanding"] == 0
    # ...and the latency no longer holds the rest of that job: without the cancel, the erasure
    # started when the job would have finished, and took that much longer
    assert [e for e in events_wait if e["event"] == "job_cancelled"] == []
    assert row_wait["started_t"] == pytest.approx(cancel["would_finish_at"])
    waited = row_wait["started_t"] - row_wait["submitted_t"]
    assert row_wait["erasure_latency_s"] == pytest.approx(row["erasure_latency_s"] + waited)
    assert row["erasure_latency_s"] < cancel["would_finish_at"] - cancel["dispatched_at"]


class _HoldingGrid:
    """Pushes are answered only when ``release`` is called (a reply still on its way)."""

    def __init__(self):
        self.held: dict[str, Message] = {}

    def push_messages(self, messages):
        ids = []
        for i, msg in enumerate(messages):
            mid = f"m{len(self.held) + i}"
            msg.metadata.__dict__["_message_id"] = mid
            self.held[mid] = msg
            ids.append(mid)
        return ids


def _job(silo: int, job_id: int, kind: JobKind = JobKind.TRAIN) -> Job:
    job = Job("", silo, 100 + silo, job_id, 0, 0.0, 10.0, 0.0)
    job.kind = kind
    return job


def _message(node: int) -> Message:
    set_task_identity()  # (what Flower's runtime sets before messages are made; a test run
    # alone has had no earlier test to set it)
    return Message(RecordDict(), dst_node_id=node, message_type="train")


def test_the_canceller_frees_the_silo_at_once_and_drops_the_reply_when_it_comes(tmp_path):
    clock = VirtualClock([1.0, 1.0], 1.0, seed=0)
    events = EventLog(tmp_path / "metrics.jsonl")
    grid = _HoldingGrid()
    jobs = Dispatcher(grid, clock, events)
    arrived: dict[str, Message] = {}
    seen = []
    canceller = JobCanceller(
        jobs, events, arrived, lambda: clock.now, lambda: 3, on_discard=lambda j, r: seen.append(j)
    )
    train, unlearn = _job(0, 7), _job(1, 8, JobKind.UNLEARN)
    assert jobs.send(_message(100), train, 0) and jobs.send(_message(101), unlearn, 0)
    # an erasure's own job is never cancelled; a silo with nothing in flight has nothing to cancel
    assert canceller.cancel(1, "r-x") is None and jobs.holding(1) is not None
    assert canceller.cancel(0, "r-1") is train
    assert jobs.holding(0) is None and canceller.waiting_ids() == [train.msg_id]
    assert canceller.cancel(0, "r-1") is None
    # the reply comes: dropped (and handed to on_discard once); any other reply is not its
    other = Message(RecordDict(), dst_node_id=101, message_type="train")
    assert not canceller.on_reply("m-other", other)
    reply = Message(RecordDict(), reply_to=grid.held[train.msg_id])
    assert canceller.on_reply(train.msg_id, reply)
    assert seen == [train] and canceller.waiting_ids() == []
    assert canceller.summary() == {
        "jobs_cancelled": 1,
        "cancelled_replies_discarded": 1,
        "cancelled_replies_outstanding": 0,
    }
    kinds = [e["event"] for e in read_events(tmp_path / "metrics.jsonl")]
    assert kinds == ["job_cancelled", "reply_discarded"]


def test_a_reply_that_never_comes_is_forgotten_and_a_restart_counts_it(tmp_path):
    clock = VirtualClock([1.0], 1.0, seed=0)
    events = EventLog(tmp_path / "metrics.jsonl")
    jobs = Dispatcher(_HoldingGrid(), clock, events)
    canceller = JobCanceller(jobs, events, {}, lambda: clock.now, lambda: 0)
    jobs.send(_message(100), _job(0, 1), 0)
    canceller.cancel(0, "r-1")
    canceller.expire(limit_s=3600.0)
    assert canceller.waiting_ids()  # not yet
    state = canceller.state_dict()  # a checkpoint now: a restarted server never pulls it
    canceller.expire(limit_s=0.0)
    assert (
        canceller.waiting_ids() == [] and canceller.summary()["cancelled_replies_outstanding"] == 1
    )
    again = JobCanceller(jobs, events, {}, lambda: clock.now, lambda: 0)
    again.load_state_dict(state)
    assert again.summary() == {
        "jobs_cancelled": 1,
        "cancelled_replies_discarded": 0,
        "cancelled_replies_outstanding": 1,
    }


def test_an_erasure_that_stops_by_itself_takes_the_virtual_time_of_its_work(small_cfg):
    # Prepare: a budget of 40 steps, read every 4; the silo's held-out samples decide
    from server.clock import silo_speeds

    cfg_args = ("unlearning.stop=membership", "unlearning.steps=40", "lab.erasure.stop_every=4")
    # Execute
    summary, row, events = _run(small_cfg, *cfg_args)
    # Assert: the erasure took the virtual time of the work its silo reports, not its budget
    cfg = small_cfg(*cfg_args)
    at = row["at_boundary"]
    work = at["silo_work_units"]
    assert at["silo_readings"] >= 1 and 0 <= at["silo_steps"] <= 40
    assert work == pytest.approx(
        at["silo_steps"] + 1 + at["silo_readings"] * at["silo_compared"] / (3 * 16)
    )
    speed = silo_speeds(cfg.silos, cfg.lab.speed, cfg.run.seed)[1]
    span = work * cfg.lab.speed.step_time_s / speed + cfg.lab.speed.latency_s
    assert row["erasure_latency_s"] == pytest.approx(span)
    most = 40 + 1 + (2 + 40 // 4) * 256 / 48
    assert span < most * cfg.lab.speed.step_time_s / speed + cfg.lab.speed.latency_s


def test_on_the_wall_clock_an_erasure_waits_for_the_job_in_flight(small_cfg):
    # a deployed node finishes its job before it pulls the erasure (Flower's SuperNode takes
    # one message at a time): the server does not cancel it there
    from test_server_wallclock import _SlowGrid

    cfg = small_cfg(
        "run.budget_s=6",
        "client.local_steps=2",
        "unlearning.steps=1",
        "lab.erasure.signature_batches=1",
        "erasures=[{silo: 1, at_s: 1}]",
    )
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    grid = _SlowGrid(client_app, 3, reply_delay_s=0.5)
    summary = run_server(grid, cfg, run_dir, wall_clock=True)
    (row,) = summary["erasures"]["applied"]
    events = read_events(run_dir / "metrics.jsonl")
    assert [e for e in events if e["event"] == "job_cancelled"] == []
    assert summary["jobs_cancelled"] == 0 and row["silo"] == 1
