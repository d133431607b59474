"""The server's side of DP-SGD: each silo's reported epsilon, and silos out of budget.

Every DP train reply carries the silo's accumulated epsilon (``dp-epsilon``, at ``dp-delta``);
the server keeps the latest per silo (``per_silo[silo]["dp_epsilon"]`` in summary.json, and on
the ``update`` event), logs it, and counts it whether or not the update itself is accepted: a
rejected update was still trained on the silo's data. A silo that has spent its budget replies
with a typed refusal instead of an update; the server stops sending it work, logs why in one
line and writes a ``silo_stopped`` event. A refusal is not a fault: nothing is counted as
rejected. The value is what the silo says; the server cannot check it (the silo's ledger and
data never leave it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from flwr.app import Message

from clients import protocol as P
from clients.privacy import DP_DELTA, DP_EPSILON, REFUSAL, REFUSAL_DETAIL

if TYPE_CHECKING:
    from server.intake import Job
    from server.loop import AsyncServer

log = logging.getLogger("fedasync.server")


def reported_epsilon(reply: Message) -> tuple[float, float] | None:
    """``(epsilon, delta)`` a train reply reports, or None (no DP, an error, malformed)."""
    if reply.has_error() or P.METRICS not in reply.content:
        return None
    metrics: Any = reply.content[P.METRICS]
    try:
        return float(metrics[DP_EPSILON]), float(metrics.get(DP_DELTA, float("nan")))
    except (KeyError, TypeError, ValueError):
        return None


def refusal(reply: Message) -> tuple[str, str] | None:
    """``(reason, detail)`` when a train reply refuses the work, else None."""
    if reply.has_error() or P.CONFIG not in reply.content:
        return None
    cfg: Any = reply.content[P.CONFIG]
    if REFUSAL not in cfg:
        return None
    return str(cfg[REFUSAL]), str(cfg.get(REFUSAL_DETAIL, ""))[:300]


def take_privacy(srv: AsyncServer, job: Job, reply: Message) -> bool:
    """Note the epsilon ``reply`` reports for ``job``'s silo; True when the silo refused the
    work (it is then stopped: never sent training again in this run)."""
    eps = reported_epsilon(reply)
    if eps is not None:
        srv.per_silo[job.silo]["dp_epsilon"] = eps[0]
        log.info(
            "silo %d privacy: epsilon %.4g (delta %g) after job %d",
            job.silo,
            eps[0],
            eps[1],
            job.job_id,
        )
    why = refusal(reply)
    if why is None:
        return False
    reason, detail = why
    srv.stopped[job.silo] = reason
    log.warning("silo %d stopped training (job %d): %s: %s", job.silo, job.job_id, reason, detail)
    srv.events.write(
        "silo_stopped",
        t=srv.clock.now,
        version=srv.version,
        silo=job.silo,
        job=job.job_id,
        reason=reason,
        detail=detail,
        **({"dp_epsilon": eps[0]} if eps is not None else {}),
    )
    return True
