"""A request across a server restart: which requests resume and how (``reconcile``), when a
request was submitted (``submitted``), and its latency in the summary (``row``), which counts
from submission, not from the restart. Functions of what the erasure coordinator
(lifecycle.py) hands them; it owns the state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from server.erasure.states import State, is_terminal
from server.unlearning.requests import WENT_OFFLINE

if TYPE_CHECKING:
    from fedasync.clock import Clock
    from server.erasure.store import ErasureStore
    from server.unlearning.requests import Erasure

log = logging.getLogger("fedasync.server")


def submitted(
    req: Any, clock: Clock, opened_ms: int, seen: dict[str, float]
) -> tuple[float, int | None]:
    """``(submitted_t, submitted_wall_ms)`` of ``req`` (the store opened at ``opened_ms``).
    Submitted in this process: the clock time ``poll`` first saw it (``seen``; as for
    scheduled erasures). Before a restart: on the wall clock, its ``created_at_ms`` converted to the clock; on the virtual clock that
    time is unknown, so ``created_at_ms`` is kept for a wall-clock latency."""
    from server.erasure.store import now_ms

    now = clock.now
    if req.created_at_ms >= opened_ms:
        return seen.get(req.id, now), None
    if clock.realtime:
        return now - max(0.0, (now_ms() - req.created_at_ms) / 1000), None
    return seen.get(req.id, now), int(req.created_at_ms)


def row(
    e: Erasure, store: ErasureStore, clock_kind: str, accepted: Callable[[float, float], int]
) -> dict[str, Any]:
    """What the summary reports of an applied erasure (``accepted``: updates accepted in a
    clock interval)."""
    # latency as the requester sees it: from submission to the erasure in the model;
    # others' work counts while the silo erased (a halted federation drains its work in
    # flight between submission and the start of erasing, and starts nothing new)
    latency, clock = (e.applied_t or 0.0) - e.submitted_t, clock_kind
    if e.submitted_wall_ms is not None:  # submitted before a restart, on the virtual clock
        applied = [
            a.time_ms
            for a in store.audit(e.request_id)
            if a.action == "transition" and a.to_state is State.CALIBRATING
        ]
        if applied:  # from submission to the erasure in the model, both on the wall clock
            latency, clock = (applied[0] - e.submitted_wall_ms) / 1000, "wall"
    removed = None
    if e.removed_t is not None and clock == clock_kind:  # (same clock as the submission)
        removed = e.removed_t - e.submitted_t
    return {
        "request": e.request_id,
        "silo": e.silo,
        "scope": "silo" if not e.sample_ids else f"{len(e.sample_ids)} samples",
        "submitted_t": e.submitted_t,
        "started_t": e.started_t,
        # the server's removal, in force at the request (None: no removal)
        "removed_version": e.removed_version,
        "removal_latency_s": removed,
        "boundary_version": e.boundary,
        "erasure_latency_s": latency,
        "latency_clock": clock,  # "virtual" or "wall": the clock erasure_latency_s is on
        "updates_from_others_while_erasing": accepted(e.started_t or 0.0, e.applied_t or 0.0),
        # the global test score just before vs just after the boundary (positive: a drop)
        "boundary_dip": e.metrics_at_boundary.get("boundary_dip"),
        "at_boundary": e.metrics_at_boundary,
    }


def reconcile(
    store: ErasureStore,
    active: dict[str, Erasure],
    applied: set[str],
    version: int,
    roster: Mapping[int, int],
    restart: Callable[[Any], None],
) -> None:
    """After a restart: match the store's unfinished requests with the restored model
    (``active`` and ``applied``: the coordinator's, restored; ``version``: the
    restored model's; ``roster``: the silos here; ``restart``: start an erasing request again).

    The model with an erasure applied is checkpointed before the store moves the request
    to calibrating, so: erasing + applied -> the transition was lost, finish it; erasing
    and not applied -> the erasure never reached a checkpoint, run it again (the silo
    is sent train.unlearn anew); queued -> picked up by ``poll`` as usual. A request
    resumed mid-erasure (erasing, calibrating) gets an audit row saying so (``note``).

    The store can also be ahead of the checkpoint: a request checked after its relearning
    window (verified or unverified) or failed after the last checkpoint and before the
    server died is restored as calibrating. It is done: it leaves the active set instead of
    being checked a second time (which the lifecycle forbids: no transition leaves a
    terminal state), and its reading stays the store's.
    """
    for rid in list(active):
        done = store.get(rid)
        if done is not None and is_terminal(done.state):
            log.info(
                "erasure %s was %s after the checkpoint this run resumed from: not checked again",
                rid,
                done.state,
            )
            del active[rid]
    for req in store.unfinished():
        if req.state is State.CALIBRATING:  # applied; checked after its window
            store.note(
                req.id,
                actor="server",
                model_version=version,
                detail="resumed after restart (calibrating)",
            )
        if req.state is not State.ERASING:
            continue
        if req.id in applied:
            store.transition(
                req.id,
                State.CALIBRATING,
                actor="server",
                model_version=version,
                detail="resumed after a restart",
            )
        elif req.silo in roster:
            log.info("erasure %s restarts after a server restart", req.id)
            restart(req)
        else:  # its silo is not here after the restart: it waits, queued, for it
            detail = (
                f"{WENT_OFFLINE}: silo {req.silo} is not in the roster after a server "
                "restart; will start when it returns"
            )
            log.warning("erasure %s of silo %d back to queued: %s", req.id, req.silo, detail)
            store.transition(
                req.id,
                State.QUEUED,
                actor="server",
                model_version=version,
                detail=detail,
            )
