"""Replies taken as their content arrives: one silo's half-uploaded reply never holds up the
others.

Flower 1.42's deployment grid (``HttpGrid``) pulls replies in two steps: ``PullMessages``
hands out every reply that has reached the SuperLink (each exactly once), then the grid pulls
each reply's content (its objects), retrying an object that has not arrived yet for up to two
hours (flwr's ``PULL_MAX_TIME``) before it returns anything. A hospital whose link drops
while it uploads a reply leaves exactly that: the reply at the SuperLink, its content on the
far side of the cut. ``grid.pull_messages`` would wait for it, and so would every other
silo's reply: a 12 s partition of one hospital stopped the whole federation until about 8 s
after its link came back (the hospital's TCP retransmission, then its upload's retry).

`ReplyPuller.pull` takes the same two steps without the wait: the replies are taken in one
``PullMessages`` call; each reply's objects are tried once at once, and a reply with objects
still missing is finished on a thread of its own (retries after 10 ms, doubling up to 0.2 s)
while the loop goes on. A later ``pull`` returns it once its content is complete. A reply
whose content stops arriving for ``stall_s`` (``REPLY_STALL_S``), or is not whole
within ``max_wait_s`` (``server.reply_timeout_s``, when the loop abandons the job anyway),
becomes an error reply (as Flower makes one, ``MESSAGE_UNAVAILABLE``): the loop counts its
silo's work as failed and sends it new work. The stall bound matters: a SuperNode whose link
dropped mid-upload retries its push once the link is back and reports it sent, while the
content the SuperLink handed out stays incomplete; without the bound its silo got no work for
``server.reply_timeout_s`` (600 s by default) after a 60 s partition.

Any other grid (Flower's simulation runtime, a test's) is pulled as it is; a
``StoppableGrid`` around the HTTP grid still stops the run at a poll. This relies on
Flower internals (flwr is pinned to the tested minor version); ``FlowerInternalsMoved`` is
raised at start when they are not where 1.42 has them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, cast

from flwr.app import Message

from protocol.transport import FlowerInternalsMoved

POLL_INTERVAL_S = 0.05
"""Wall clock (deployment): seconds between the loop's polls of the SuperLink for replies (each
an HTTPS request; the virtual clock polls every 5 ms). A constant, not a setting: settled as
the cost of a poll against the delay it adds (docs/measured.md), and nobody tunes it."""
REPLY_STALL_S = 30.0
"""Deployment: wall seconds a reply whose content is still arriving may go without any of it
arriving before it counts as failed and its silo is sent new work (a link cut mid-upload). A
constant, not a setting: a bound on a link that died, far above any pause a live link makes."""

try:
    from flwr.app import Metadata
    from flwr.app.error import Error
    from flwr.app.message import make_message
    from flwr.common.constant import ErrorCode
    from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest
    from flwr.supercore.constant import SYSTEM_MESSAGE_TYPE
    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import (
        ObjectPullError,
        ObjectUnavailableError,
        inflate_object_from_contents,
    )
    from flwr.superlink.grid.http_grid import HttpGrid
except ImportError as e:  # pragma: no cover - only with another flwr
    raise FlowerInternalsMoved(f"Flower's two-step reply pull: {e}") from e

log = logging.getLogger("fedasync.server")

FIRST_RETRY_S = 0.01
"""Seconds before an object that is not there yet is tried again (doubling, up to 0.2 s)."""
RETRY_CAP_S = 0.2
SLOW_S = 5.0
"""A reply whose content is still arriving after this many seconds is logged (once)."""


class ReplyPuller:
    """``pull(ids)``: the replies to ``ids`` whose content is complete, never waiting for one
    whose content is still arriving (see the module's docstring)."""

    def __init__(self, grid: Any, max_wait_s: float, stall_s: float | None = None):
        self.grid = grid
        self.max_wait_s = max_wait_s
        self.stall_s = max_wait_s if stall_s is None else min(stall_s, max_wait_s)
        self.two_step = isinstance(getattr(grid, "inner", grid), HttpGrid)  # (StoppableGrid)
        self._done: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._arriving: dict[str, threading.Thread] = {}  # reply_to id -> its content's thread
        self._closed = threading.Event()

    @property
    def arriving(self) -> list[str]:
        """The sent message ids whose reply is here but whose content is still arriving."""
        return [mid for mid, t in list(self._arriving.items()) if t.is_alive()]

    def pull(self, ids: list[str]) -> list[Message]:
        """The replies to ``ids`` that are complete now (in arrival order); a reply completed for
        an id no longer in ``ids`` (its job abandoned meanwhile) is dropped, and logged."""
        if not self.two_step:
            return list(self.grid.pull_messages(ids))
        check = getattr(self.grid, "check", None)  # a StoppableGrid: RunStopped once stopped
        if check is not None:
            check()
        # a reply is handed out once; asked for again, the SuperLink answers that its message
        # is unavailable (it deleted the instruction on handing the reply out)
        ask = [mid for mid in ids if mid not in self._arriving]
        if ask:
            client = self.grid._runtime_client
            res = client.PullMessages(PullAppMessagesRequest(message_ids=ask))
            for proto, tree in zip(res.messages_list, res.message_object_trees, strict=True):
                self._start(proto, tree)
        wanted, out = set(ids), []
        while True:
            try:
                msg = self._done.get_nowait()
            except queue.Empty:
                break
            mid = msg.metadata.reply_to_message_id
            self._arriving.pop(mid, None)
            if mid in wanted:
                out.append(msg)
            else:
                log.info("a reply to %s completed after its job was abandoned: dropped", mid[:12])
        return out

    def close(self) -> None:
        """Stop finishing replies (the run is over): their threads end at their next retry."""
        self._closed.set()

    # ------------------------------------------------------------ one reply's content
    def _start(self, proto: Any, tree: Any) -> None:
        run_id = self.grid._run.run_id
        fetch = make_pull_object_fn_protobuf(
            pull_object_protobuf=self.grid._runtime_client.PullObject,
            node=self.grid.node,
            run_id=run_id,
        )
        wanted = [t.object_id for t in iterate_object_tree(tree)]
        contents: dict[str, bytes] = {}
        try:
            missing = self._try_once(fetch, wanted, contents)
        except ObjectPullError as e:
            self._done.put(self._unavailable(proto, run_id, str(e)))
            return
        if not missing:
            self._done.put(self._finish(proto, run_id, contents))
            return
        mid = proto.metadata.reply_to_message_id
        log.debug(
            "the reply to %s is here, %d of its %d objects still arriving: finished aside",
            mid[:12],
            len(missing),
            len(wanted),
        )
        t = threading.Thread(
            target=self._finish_aside,
            args=(proto, run_id, fetch, missing, contents),
            name=f"reply-{mid[:8]}",
            daemon=True,
        )
        self._arriving[mid] = t
        t.start()

    def _try_once(self, fetch: Any, wanted: list[str], contents: dict[str, bytes]) -> list[str]:
        """Pull each of ``wanted`` once into ``contents``; the ids not there yet."""
        missing = []
        for oid in wanted:
            try:
                contents[oid] = fetch(oid)
            except ObjectUnavailableError:  # type: ignore[union-attr]
                missing.append(oid)
        return missing

    def _finish_aside(
        self, proto: Any, run_id: int, fetch: Any, missing: list[str], contents: dict[str, bytes]
    ) -> None:
        start, delay = time.monotonic(), FIRST_RETRY_S
        progress, told = start, False  # when an object last came; the slow line said
        mid = proto.metadata.reply_to_message_id
        try:
            while missing:
                if self._closed.wait(delay):
                    return
                before = len(missing)
                missing = self._try_once(fetch, missing, contents)
                now = time.monotonic()
                if len(missing) < before:
                    progress, delay = now, FIRST_RETRY_S
                    continue
                if not told and now - start >= SLOW_S:
                    told = True
                    log.info(
                        "the reply to %s: %d of its objects still not here after %.0f s",
                        mid[:12],
                        len(missing),
                        now - start,
                    )
                if now - progress >= self.stall_s:
                    raise ObjectPullError(
                        missing[0],
                        f"none of its last {len(missing)} objects came for {self.stall_s:g}s "
                        "(the reply stall bound; a link cut mid-upload)",
                    )
                if now - start >= self.max_wait_s:
                    raise ObjectPullError(missing[0], f"not there after {self.max_wait_s:g}s")
                delay = min(delay * 2, RETRY_CAP_S)
            self._done.put(self._finish(proto, run_id, contents))
        except ObjectPullError as e:
            log.warning("the reply to %s counts as failed: %s", mid[:12], e)
            self._done.put(self._unavailable(proto, run_id, str(e)))
        except Exception as e:  # the SuperLink went away: the loop's own pull will say so
            if not self._closed.is_set():
                self._done.put(self._unavailable(proto, run_id, f"{type(e).__name__}: {e}"))

    def _finish(self, proto: Any, run_id: int, contents: dict[str, bytes]) -> Message:
        """Confirm the reply to the SuperLink and build it from ``contents``."""
        msg_id = proto.metadata.message_id
        self.grid._runtime_client.ConfirmMessageReceived(
            ConfirmMessageReceivedRequest(
                node=self.grid.node, run_id=run_id, message_object_id=msg_id
            )
        )
        message = cast(Message, inflate_object_from_contents(msg_id, contents))
        message.metadata.__dict__["_message_id"] = msg_id
        return message

    def _unavailable(self, proto: Any, run_id: int, why: str) -> Message:
        """An error reply in place of one whose content never came (as Flower's grid makes)."""
        node = self.grid.node
        return make_message(
            metadata=Metadata(
                run_id=run_id,
                message_id="",
                src_node_id=node.node_id,
                dst_node_id=node.node_id,
                message_type=SYSTEM_MESSAGE_TYPE,
                group_id="",
                ttl=0,
                reply_to_message_id=proto.metadata.reply_to_message_id,
                created_at=time.time(),
            ),
            error=Error(
                code=ErrorCode.MESSAGE_UNAVAILABLE,
                reason=f"reply content unavailable: {why[:200]}",
            ),
        )
