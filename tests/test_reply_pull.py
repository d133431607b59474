"""server/reply_pull.py: on Flower's deployment grid a reply whose content is still arriving
(its hospital's link dropped mid-upload) never holds up the replies that are complete.

The grid is Flower's real ``HttpGrid`` and the messages are real Flower messages, cut into
their real objects; only the SuperLink's Runtime API is a dict in this process (the
deployment tests run the real one)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.app.message import remove_content_from_message
from flwr.common.serde import message_to_proto
from flwr.proto.message_pb2 import PullObjectResponse
from flwr.proto.runtime_pb2 import PullAppMessagesResponse
from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_ins_message
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.superlink.grid.http_grid import HttpGrid

from server.reply_pull import ReplyPuller
from tests.inprocess import set_task_identity


class RuntimeAPI:
    """The three Runtime API calls the pull makes, over replies and objects held here.
    ``held`` object ids are "still arriving" until released."""

    def __init__(self) -> None:
        self.replies: dict[str, tuple] = {}  # sent id -> (message proto, object tree)
        self.objects: dict[str, bytes] = {}
        self.held: set[str] = set()
        self.confirmed: list[str] = []
        self.handed: set[str] = set()
        self.lock = threading.Lock()

    def add(self, sent_id: str, reply: Message, hold: bool = False) -> None:
        reply.metadata.__dict__["_message_id"] = reply.object_id
        objects = get_all_nested_objects(reply)
        for oid, obj in objects.items():
            self.objects[oid] = obj.deflate()
        if hold:  # its arrays are on the far side of a cut
            self.held |= {oid for oid in objects if oid != reply.object_id}
        proto = message_to_proto(remove_content_from_message(reply))
        proto.metadata.reply_to_message_id = sent_id
        self.replies[sent_id] = (proto, get_object_tree(reply))

    def PullMessages(self, request):  # noqa: N802 - Flower's name
        out = PullAppMessagesResponse()
        with self.lock:
            for mid in request.message_ids:
                if mid in self.replies:  # handed out once, as the SuperLink does
                    proto, tree = self.replies.pop(mid)
                    self.handed.add(mid)
                elif mid in self.handed:  # its instruction deleted: "message unavailable"
                    err = create_message_error_unavailable_ins_message(mid, run_id=7)
                    self.objects[err.object_id] = err.deflate()
                    proto, tree = message_to_proto(err), get_object_tree(err)
                else:
                    continue
                out.messages_list.append(proto)
                out.message_object_trees.append(tree)
        return out

    def PullObject(self, request):  # noqa: N802
        with self.lock:
            if request.object_id not in self.objects:
                return PullObjectResponse(object_found=False)
            if request.object_id in self.held:
                return PullObjectResponse(object_found=True, object_available=False)
            return PullObjectResponse(
                object_found=True,
                object_available=True,
                object_content=self.objects[request.object_id],
            )

    def ConfirmMessageReceived(self, request):  # noqa: N802
        self.confirmed.append(request.message_object_id)


def _grid(api: RuntimeAPI) -> HttpGrid:
    from flwr.supercore.run import Run

    grid = HttpGrid(token="test")
    grid._client = api  # what _runtime_client returns once connected
    grid.set_run(Run.create_empty(run_id=7))
    return grid


def _reply(silo: int, size: int = 1000) -> Message:
    set_task_identity(run_id=7)
    sent = Message(RecordDict(), dst_node_id=100 + silo, message_type="train")
    sent.metadata.__dict__["_message_id"] = f"sent-{silo}"
    arrays = ArrayRecord([np.full(size, float(silo), dtype=np.float32)])
    return Message(RecordDict({"arrays": arrays, "m": ConfigRecord({"silo": silo})}), reply_to=sent)


def _api(held: tuple[int, ...] = (0,), ready: tuple[int, ...] = ()) -> RuntimeAPI:
    """A Runtime API holding the replies of silos ``held`` (their content still arriving) and
    those of ``ready`` whole."""
    api = RuntimeAPI()
    for silo in held:
        api.add(f"sent-{silo}", _reply(silo), hold=True)
    for silo in ready:
        api.add(f"sent-{silo}", _reply(silo))
    return api


def _release(api: RuntimeAPI) -> None:
    """The link is back: every held object arrives."""
    with api.lock:
        api.held.clear()


def _wait_for(condition, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def puller_of():
    """``puller_of(grid_or_api, **kw)``: a ReplyPuller (on the deployment grid over an api),
    closed after the test."""
    made: list[ReplyPuller] = []

    def make(grid, max_wait_s: float = 30, **kw) -> ReplyPuller:
        puller = ReplyPuller(
            _grid(grid) if isinstance(grid, RuntimeAPI) else grid, max_wait_s, **kw
        )
        made.append(puller)
        return puller

    yield make
    for puller in made:
        puller.close()


def test_a_complete_reply_is_taken_while_another_is_still_arriving(puller_of):
    api = _api(held=(0,), ready=(1,))
    puller = puller_of(api)
    result: list = []
    t = threading.Thread(target=lambda: result.append(puller.pull(["sent-0", "sent-1"])))
    t.start()
    t.join(timeout=20)  # Flower's own pull waits here until the held objects come
    assert not t.is_alive(), "the pull waited for the reply still arriving"
    (got,) = result
    assert [m.metadata.reply_to_message_id for m in got] == ["sent-1"]
    assert got[0].content["m"]["silo"] == 1
    assert np.all(got[0].content["arrays"].to_numpy_ndarrays()[0] == 1.0)
    assert puller.arriving == ["sent-0"]
    assert puller.pull(["sent-0"]) == []  # not asked for again (the SuperLink: unavailable)
    _release(api)  # the link is back: the upload completes
    got = _pull_until(puller, ["sent-0"], timeout_s=5)
    assert [m.metadata.reply_to_message_id for m in got] == ["sent-0"]
    assert got[0].content["m"]["silo"] == 0 and not got[0].has_error()
    assert len(api.confirmed) == 2 and puller.arriving == []


def test_a_reply_whose_content_never_comes_becomes_an_error_reply(puller_of):
    api = _api(held=(0,))
    puller = puller_of(api, max_wait_s=0.3)
    assert puller.pull(["sent-0"]) == []
    (got,) = _pull_until(puller, ["sent-0"])
    assert got.has_error() and got.metadata.reply_to_message_id == "sent-0"
    assert "unavailable" in got.error.reason and api.confirmed == []


def test_a_reply_completed_after_its_job_was_abandoned_is_dropped(puller_of):
    api = _api(held=(0,))
    puller = puller_of(api)
    assert puller.pull(["sent-0"]) == []
    _release(api)
    assert _wait_for(lambda: len(api.confirmed) == 1)  # its content came in whole
    assert puller.pull(["sent-9"]) == []  # the loop no longer waits for sent-0: not handed out
    assert puller.arriving == []


def test_closing_ends_the_threads_finishing_replies():
    puller = ReplyPuller(_grid(_api(held=(0,))), max_wait_s=30)
    puller.pull(["sent-0"])
    (thread,) = [t for t in threading.enumerate() if t.name.startswith("reply-")]
    puller.close()
    thread.join(timeout=2.0)
    assert not thread.is_alive()


def test_another_grid_is_pulled_as_it_is():
    class Plain:
        def pull_messages(self, ids):
            return [f"reply to {i}" for i in ids]

    puller = ReplyPuller(Plain(), max_wait_s=1)
    assert not puller.two_step and puller.pull(["a"]) == ["reply to a"]


def test_a_stoppable_grid_around_the_deployment_grid_still_stops_the_run_at_a_poll(puller_of):
    from server.run_stop import RunStopped, StoppableGrid

    reason: list[str] = []
    grid = StoppableGrid(_grid(_api(held=(), ready=(1,))), lambda: reason[0] if reason else None)
    puller = puller_of(grid)
    assert puller.two_step
    assert [m.metadata.reply_to_message_id for m in puller.pull(["sent-1"])] == ["sent-1"]
    reason.append("SIGINT")
    with pytest.raises(RunStopped, match="SIGINT"):
        puller.pull(["sent-1"])


def test_what_counts_as_a_stop_and_what_as_a_failure():
    import httpx
    from flwr.supercore.run import RunNotRunningException

    from server.run_stop import RunStopped, stop_reason

    def refused(status: int, path: str) -> httpx.HTTPStatusError:
        request = httpx.Request("POST", f"https://10.0.0.1:9092{path}")
        response = httpx.Response(status, request=request)
        return httpx.HTTPStatusError("refused", request=request, response=response)

    assert stop_reason(RunStopped("SIGINT")) == "SIGINT"
    assert stop_reason(RunStopped()) == "stop requested"
    assert "flwr stop" in stop_reason(RunNotRunningException())
    assert "revoked" in stop_reason(refused(401, "/v1/runtime/pull-messages"))
    # anything else is a failure, not a stop: the run must not end as if stopped on purpose
    assert stop_reason(refused(401, "/v1/fleet/pull-messages")) is None
    assert stop_reason(refused(500, "/v1/runtime/pull-messages")) is None
    assert stop_reason(ValueError("bad reply")) is None
    assert stop_reason(KeyboardInterrupt()) is None


def _pull_until(puller: ReplyPuller, ids: list[str], timeout_s: float = 15.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = puller.pull(ids)
        if got:
            return got
        time.sleep(0.02)
    return []


def test_content_that_stops_arriving_counts_as_failed_after_the_stall_bound(puller_of):
    """A link cut mid-upload: the SuperNode later reports its reply sent, but the content the
    SuperLink handed out never completes. Past the stall bound (``REPLY_STALL_S``) without an object
    arriving the reply is an error reply (its silo is sent new work), long before
    ``server.reply_timeout_s``."""
    puller = puller_of(_api(held=(0,)), max_wait_s=600, stall_s=0.3)
    assert puller.pull(["sent-0"]) == []
    (got,) = _pull_until(puller, ["sent-0"])
    assert got.has_error() and "stall bound" in got.error.reason


def test_content_arriving_slowly_but_steadily_is_waited_for(puller_of):
    """A slow link: each object takes a while, but objects keep coming; the stall bound is
    between two objects, not over the whole reply."""
    api = _api(held=(0,))
    held = sorted(api.held)
    assert len(held) >= 2
    puller = puller_of(api, max_wait_s=600, stall_s=2.0)
    assert puller.pull(["sent-0"]) == []
    for oid in held:  # one object every 1.2 s: 1.2 s x n in all, more than 2 s
        time.sleep(1.2)
        with api.lock:
            api.held.discard(oid)
    (got,) = _pull_until(puller, ["sent-0"])
    assert not got.has_error() and got.content["m"]["silo"] == 0
