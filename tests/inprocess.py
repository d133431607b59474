"""A Grid that runs the real ClientApp in this process, for fast tests of the server loop.

Tests may fake what is slow, never what is tested: the server loop, the ClientApp's handlers,
the messages and records are Flower's and fedasync's own; only Ray's process pool is replaced
by a direct call. The order in which replies are taken is the virtual clock's decision anyway.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

from server.erasure import states

SMALL = [
    "lab.compare_sync=false",
    "run.progress=false",
    "run.budget_s=1000",
    "silos.count=3",
    "lab.speed.profile=uniform",
    "client.local_steps=2",
    "client.batch_size=16",
    "data.max_samples=600",
    "server.eval_every=2",
    "server.checkpoint_every=0",
    "server.evaluate_silos=false",
]
"""A tiny but real run's overrides: brain tissue patches, cnn-small, 3 silos (the ``small_cfg``
fixture's; a later override of the same key wins)."""

CHECKED = frozenset(s.value for s in states.CHECKED)
"""The states of a request checked after its relearning window: ``verified`` (every
forgetting check within its tolerance) or ``unverified``. A test of the lifecycle's mechanics
(the window ended, the boundary came, a cancel, requeue or resume happened) asserts this, not
``verified``: a tiny run's forgetting figures are its own, and the certificate's tests judge
them (tests/test_erasure_certificate.py)."""


def checked_rows(summary: dict) -> list[dict]:
    """``summary.json``'s report rows of the requests checked after their relearning window
    (``erasures.verified`` and ``erasures.unverified``), in the order they were checked."""
    return [x for x in summary["erasures"]["applied"] if x.get("state") in CHECKED]


def set_task_identity(run_id: int = 1) -> None:
    """What Flower's runtimes set before a ServerApp runs (messages are stamped with it)."""
    TaskIdentity.task_id = 1
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = 1  # the SuperLink's node id


class InProcessGrid:
    def __init__(self, client_app: ClientApp, num_nodes: int, first_node_id: int = 1000):
        set_task_identity()
        self.app = client_app
        self.contexts = {
            first_node_id + i: Context(
                run_id=1,
                node_id=first_node_id + i,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for i in range(num_nodes)
        }
        self.replies: dict[str, Message] = {}
        self.pushed: list[Message] = []

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = str(uuid.uuid4())
            msg.metadata.__dict__["_message_id"] = mid
            self.pushed.append(msg)
            ctx = self.contexts[msg.metadata.dst_node_id]
            try:
                reply = self.app(msg, ctx)
            except Exception as e:  # noqa: BLE001 - becomes an error reply, as in Flower
                reply = Message(Error(code=0, reason=f"{type(e).__name__}: {e}"), reply_to=msg)
            self.replies[mid] = reply
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self.replies.pop(m) for m in list(message_ids) if m in self.replies]
