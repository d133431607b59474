"""Which node is which silo: the roster, learned with one ``query`` message per node
(``discover_silos``), what the ``roster`` event says of it (``roster_event``), and whether
what each silo reports of its data fits the benchmark (``check_reports``).

Also the one helper for the server's few blocking exchanges (the roster query at start and
the per-silo evaluation at the end): push messages, collect their replies until a deadline.
The training loop itself never blocks like this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flwr.app import Message
from flwr.serverapp import Grid

from fedasync.errors import ConfigError
from protocol.messages import ErrorReply, Malformed, QueryReply, QueryRequest

if TYPE_CHECKING:
    from medical_data.registry import BenchmarkSpec

log = logging.getLogger("fedasync.server")


def exchange(grid: Grid, messages: Sequence[Message], timeout_s: float) -> list[Message | None]:
    """Push ``messages`` and return their replies in the same order (None: none in time).

    Each message's TTL becomes ``timeout_s``: what is not fetched by then is dropped.
    """
    for m in messages:
        m.metadata.ttl = timeout_s
    ids = list(grid.push_messages(list(messages)))
    index = {m: i for i, m in enumerate(ids)}
    replies: list[Message | None] = [None] * len(ids)
    deadline = time.monotonic() + timeout_s
    pending = set(ids)
    while pending and time.monotonic() < deadline:
        for reply in grid.pull_messages(list(pending)):
            mid = reply.metadata.reply_to_message_id
            pending.discard(mid)
            replies[index[mid]] = reply
        if pending:
            time.sleep(0.05)
    return replies


def discover_silos(
    grid: Grid,
    setup_json: str,
    want: int,
    wait_s: float,
    *,
    salt: str = "",
    reports: dict[int, QueryReply] | None = None,
) -> tuple[dict[int, int], dict[int, int]]:
    """Wait for ``want`` nodes, ask each its silo; return (silo -> node id, silo -> samples).

    With ``salt`` every silo also reports the salted digests of its sample ids
    (``protocol.ids``); ``reports``, when given, receives each silo's whole reply (its class
    counts and digests): what the coordinator learns of the silos' data, and all of it."""
    deadline = time.monotonic() + wait_s
    nodes: list[int] = []
    while time.monotonic() < deadline:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= want:
            break
        time.sleep(0.2)
    if len(nodes) < want:
        raise RuntimeError(f"only {len(nodes)} of {want} silos connected within {wait_s:.0f}s")
    msgs = [QueryRequest(setup_json, salt).to_message(n) for n in nodes]
    roster: dict[int, int] = {}
    samples: dict[int, int] = {}
    for node, reply in zip(nodes, exchange(grid, msgs, timeout_s=max(wait_s, 60.0))):
        if reply is None:
            log.error("node %s failed the roster query: no reply", node)
            continue
        try:
            got = QueryReply.from_message(reply)
        except ErrorReply as e:
            log.error("node %s failed the roster query: %s", node, e.last_line)
            continue
        except Malformed as e:
            raise RuntimeError(f"node {node} sent a malformed roster reply: {e}") from e
        if got.silo in roster:
            raise RuntimeError(f"nodes {roster[got.silo]} and {node} both claim silo {got.silo}")
        if salt and len(got.id_digests) == 0 and got.num_samples:
            raise RuntimeError(f"node {node} (silo {got.silo}) reported no id digests")
        roster[got.silo] = node
        samples[got.silo] = got.num_samples
        if reports is not None:
            reports[got.silo] = got
    missing = sorted(set(range(want)) - set(roster))
    if missing:
        raise RuntimeError(f"silos {missing} did not answer the roster query")
    return roster, samples


def roster_event(
    roster: dict[int, int],
    samples: dict[int, int],
    speeds: Sequence[float],
    reports: dict[int, QueryReply],
) -> dict[str, Any]:
    """The ``roster`` event's ``silos``: per silo its node, sample count, speed and, where it
    reported them, its class counts."""
    counts = {s: list(r.class_counts) for s, r in reports.items() if r.class_counts}
    return {
        str(s): {
            "node": n,
            "num_samples": samples[s],
            "speed": speeds[s],
            **({"class_counts": counts[s]} if s in counts else {}),
        }
        for s, n in roster.items()
    }


def check_reports(reports: Mapping[int, QueryReply], spec: BenchmarkSpec) -> None:
    """Every silo's class counts (``reports``, its roster reply) fit the benchmark ``spec``
    (one per class): a silo that reads its data for another task or class count is a
    configuration error, said at the start."""
    for s, r in sorted(reports.items()):
        if r.class_counts and len(r.class_counts) != spec.num_classes:
            raise ConfigError(
                f"silo {s} reports {len(r.class_counts)} classes, {spec.name} has "
                f"{spec.num_classes}: its data or its version of the app differs"
            )
