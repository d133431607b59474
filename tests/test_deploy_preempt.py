"""A deployed node stops training between two local steps when an erasure of its silo reaches
it (clients/preempt.py, the warm worker's TaskWatcher), and runs the erasure next.

The worker is driven with fakes of the Flower runtime calls it makes (AcquireTask, a task's
heartbeat, pulling its input, pushing its reply and output): what is tested is the worker's
own order of work and the training loop's stop, not Flower's runtime.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from flwr.app import Message, RecordDict
from inprocess import set_task_identity

import clients.preempt as preempt
import simulations.worker as worker
from clients.local import train_local
from medical_data.federation import SiloData


def _message(kind: str, mid: str) -> Message:
    set_task_identity()  # (what Flower's runtime sets before messages are made)
    msg = Message(RecordDict(), dst_node_id=7, message_type=kind)
    msg.metadata.__dict__["_message_id"] = mid
    return msg


class _Runtime:
    """The SuperNode's side: tasks handed out by AcquireTask (the second only after the first
    has run a while), heartbeats, inputs, and what was pushed."""

    def __init__(self, tasks: list[tuple[int, str]], second_after_s: float):
        self.tasks = list(tasks)
        self.second_after_s = second_after_s
        self.acquired: list[tuple[int, float, str]] = []  # (task, time, by which thread)
        self.pushed: list[tuple[int, Message]] = []
        self.outputs: list[tuple[int, str]] = []
        self.seq: list[tuple[str, int]] = []  # what happened, in order
        self.t_first: float | None = None

    def acquire(self) -> SimpleNamespace:
        now = time.monotonic()
        ready = self.tasks and (self.t_first is None or now - self.t_first >= self.second_after_s)
        if not ready:
            return SimpleNamespace(HasField=lambda _: False, token="")
        task_id, kind = self.tasks.pop(0)
        self.t_first = self.t_first or now
        self.acquired.append((task_id, now, threading.current_thread().name))
        self.seq.append(("acquired", task_id))
        task = SimpleNamespace(task_id=task_id, fab_hash="fab", HasField=lambda _: True)
        return SimpleNamespace(HasField=lambda _: True, token=f"{task_id}:{kind}", task=task)


def _worker(rt: _Runtime, app) -> worker.Worker:
    w = object.__new__(worker.Worker)
    w.poll_s = w.poll_max_s = 0.005
    w.max_tasks, w.tasks, w.stopping, w.fab_hash, w.app = 2, 0, False, "fab", app
    w.torch_seed, w.runtime_api = 0, "fake"

    class Heartbeat:
        def __init__(self, fn):
            self.token, self.is_running = fn, False

        def start(self):
            self.is_running = True
            rt.seq.append(("heartbeat on", int(self.token.split(":")[0])))

        def stop(self):
            self.is_running = False
            rt.seq.append(("heartbeat off", int(self.token.split(":")[0])))

    def client(component, token=None):
        return SimpleNamespace(
            AcquireTask=lambda req: rt.acquire(), close=lambda: None, token=token
        )

    def pull(c):
        task_id, kind = c.token.split(":")
        return (
            _message(kind, f"m{task_id}"),
            SimpleNamespace(),
            None,
            SimpleNamespace(hash_str="fab"),
        )

    w._client = client
    w._load = lambda fab, run: app
    w.f = {
        "AcquireTaskRequest": lambda **kw: None,
        "HeartbeatSender": Heartbeat,
        "make_task_heartbeat_fn_http": lambda c: c.token,
        "pull_task_input": pull,
        "push_message": lambda c, reply, ctx: rt.pushed.append((int(c.token.split(":")[0]), reply)),
        "push_task_output": lambda c, ctx, status, d: (
            rt.outputs.append((int(c.token.split(":")[0]), status)),
            rt.seq.append(("output", int(c.token.split(":")[0]))),
        ),
        "SubStatus": SimpleNamespace(FAILED="failed", COMPLETED="completed"),
        "Error": lambda code, reason: __import__("flwr.app", fromlist=["Error"]).Error(
            code=code, reason=reason
        ),
        "ErrorCode": SimpleNamespace(CLIENT_APP_RAISED_EXCEPTION=1),
    }
    return w


def test_an_erasure_reaching_the_node_stops_training_at_the_next_step_and_runs_next():
    # Prepare: a training task of 2000 steps of 5 ms; the erasure's task comes 0.2 s in
    steps_done: list[int] = []

    def app(message, context):
        if message.metadata.message_type == "train":
            for step in range(2000):
                preempt.check(step, 2000)
                steps_done.append(step)
                time.sleep(0.005)
        return Message(RecordDict(), reply_to=message)

    rt = _Runtime([(1, "train"), (2, "train.unlearn")], second_after_s=0.2)
    w = _worker(rt, app)
    # Execute
    assert w.serve() == 0
    # Assert: the training stopped within a step of the claim, as an error reply
    (t1, _, _), (t2, _, by) = rt.acquired
    assert (t1, t2) == (1, 2) and by.startswith("task-watcher")
    assert 0 < len(steps_done) < 2000
    first, second = rt.pushed
    assert first[0] == 1 and first[1].has_error() and "preempted after" in first[1].error.reason
    assert second[0] == 2 and not second[1].has_error()
    assert rt.outputs == [(1, "failed"), (2, "completed")]
    # ...the erasure's heartbeat ran from its claim (the SuperNode counts a task without one
    # as crashed), through the end of the training task, to its own end
    assert rt.seq == [
        ("acquired", 1),
        ("heartbeat on", 1),
        ("acquired", 2),
        ("heartbeat on", 2),
        ("output", 1),
        ("heartbeat off", 1),
        ("output", 2),
        ("heartbeat off", 2),
    ]
    assert not preempt.requested()


def test_a_task_other_than_an_erasure_waits_for_the_training_to_finish():
    steps_done: list[int] = []

    def app(message, context):
        if message.metadata.message_type == "train":
            for step in range(400):
                preempt.check(step, 400)
                steps_done.append(step)
                time.sleep(0.005)
        return Message(RecordDict(), reply_to=message)

    rt = _Runtime([(1, "train"), (2, "evaluate")], second_after_s=0.05)
    w = _worker(rt, app)
    assert w.serve() == 0
    assert len(steps_done) == 400, "claimed while it trained, and not preempted"
    assert rt.acquired[1][2].startswith("task-watcher")
    assert [t for t, _ in rt.pushed] == [1, 2] and not rt.pushed[0][1].has_error()


def test_local_training_checks_the_flag_before_each_step():
    import numpy as np
    import torch

    data = SiloData(
        0,
        "x",
        np.zeros((8, 1, 4, 4), np.float32),
        np.zeros(8, np.int64),
        np.array([str(i) for i in range(8)]),
    )
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 2))
    kw = {"steps": 3, "lr": 0.1, "batch_size": 4, "task": "classification", "seed": 0}
    preempt.request("test")
    try:
        with pytest.raises(preempt.Preempted, match="after 0 of 3 local steps: test"):
            train_local(model, data, **kw)
    finally:
        preempt.clear()
    assert train_local(model, data, **kw)["train_loss"] >= 0
    assert preempt.sleep(0.01) is False
