"""The ``train.unlearn`` exchange with a silo: the message sent, and the reply read strictly.

The reply carries the erasure delta (relative to the model sent), the forget data's gradient
signature basis ``(d, k)`` with the names of the tensors it spans, and the silo's metrics.
Anything malformed is an error message (the request fails with it), never an exception that
would stop the loop. An error reply (the silo's ClientApp raised or crashed, the SuperLink
reports the node offline, the message expired) is a ``SiloLost``: the silo went down
mid-erasure, and the request goes back to the queue instead of failing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import ErrorCode

from fedasync import Params, check_tensors
from protocol import keys as P
from protocol import wire
from protocol.config import to_dict

if TYPE_CHECKING:
    from server.loop import AsyncServer


def unlearn_message(
    srv: AsyncServer, silo: int, job_id: int, start: Params, erasure: Any
) -> Message:
    """The train.unlearn message asking ``silo`` to erase ``erasure``'s samples from ``start``."""
    seed = int(np.random.default_rng([srv.cfg.run.seed, silo, job_id, 7]).integers(2**31 - 1))
    config = ConfigRecord(
        {
            P.SETUP: srv.setup_json,
            P.JOB_ID: job_id,
            P.BASE_VERSION: srv.version,
            P.SEED: seed,
            P.FORGET: list(erasure.sample_ids),
            # the erasure's own size (scaled to its forget set) over the configured one
            P.UNLEARN_JSON: P.dumps({**to_dict(srv.cfg.unlearning), **erasure.overrides}),
        }
    )
    content = RecordDict({P.ARRAYS: wire.encode(start), P.CONFIG: config})
    return Message(
        content,
        dst_node_id=srv.roster[silo],
        message_type=P.UNLEARN,
        ttl=srv.cfg.server.reply_timeout_s,
    )


class SiloLost(str):
    """Why a silo did not carry out an erasure it was sent: it went down (an error reply, or no
    reply at all). A ``str``, so a caller that only tells results from reasons still can;
    ``offline`` is True when the SuperLink reported the node unavailable (its heartbeats
    stopped: a restart, a network cut), when trying again only makes sense once it is back."""

    offline: bool

    def __new__(cls, reason: str, offline: bool = False) -> SiloLost:
        lost = super().__new__(cls, reason)
        lost.offline = offline
        return lost


def read_unlearn_reply(
    reply: Message, reference: Params
) -> tuple[Params, torch.Tensor, list[str], dict[str, float]] | str:
    """(delta, signature basis, basis tensor names, metrics), or why the reply is unusable:
    a ``SiloLost`` for an error reply (the silo went down; the request is retried), a plain
    ``str`` for a reply that came back malformed (the request fails)."""
    try:
        if reply.has_error():
            return SiloLost(
                f"the silo failed: {reply.error.reason}".splitlines()[0][:300],
                offline=reply.error.code == ErrorCode.NODE_UNAVAILABLE,
            )
        delta = wire.decode(P.array_record(reply.content, P.ARRAYS))
        bad = check_tensors(delta, reference)
        if bad is not None:
            return f"{bad.reason.value}: {bad.detail}"
        basis = wire.decode(P.array_record(reply.content, P.SIGNATURE))["basis"]
        names = [str(n) for n in reply.content[P.CONFIG][P.SIGNATURE_NAMES]]  # type: ignore[union-attr]
        if (
            basis.dim() != 2
            or not basis.is_floating_point()
            or not bool(torch.isfinite(basis).all())
        ):
            return "the gradient signature is not a finite (d, k) matrix"
        metrics = {
            k: P.as_float(v)
            for k, v in reply.content[P.METRICS].items()
            if k not in (P.SILO, P.JOB_ID, P.BASE_VERSION)
        }
    except (KeyError, ValueError, TypeError) as e:
        return f"malformed erasure reply: {e}"
    return delta, basis, names, metrics
