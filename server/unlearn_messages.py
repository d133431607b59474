"""The server's side of the ``train.unlearn`` exchange: what it asks, and what a reply means.

The messages themselves are ``protocol.erasure_messages.UnlearnRequest`` / ``UnlearnReply``
(built and validated there; the loop builds the request). Here: the server's reading of a
reply. Anything malformed
is an error message (the request fails with it), never an exception that would stop the loop.
An error reply (the silo's ClientApp raised or crashed, the SuperLink reports the node offline,
the message expired) is a ``SiloLost``: the silo went down mid-erasure, and the request goes
back to the queue instead of failing.
"""

from __future__ import annotations

import torch
from flwr.app import Message

from fedasync import Params, check_tensors
from protocol.erasure_messages import UnlearnReply
from protocol.reading import ErrorReply, Malformed


class SiloLost(str):
    """Why a silo did not carry out an erasure it was sent: it went down (an error reply, or no
    reply at all). A ``str``, so a caller that only tells results from reasons still can;
    ``offline`` is True when the SuperLink reported the node unavailable (its heartbeats
    stopped: a restart, a network cut), when trying again only makes sense once it is back."""

    offline: bool

    def __new__(cls, reason: str, offline: bool = False) -> SiloLost:
        """A reason (a ``str``) with its ``offline`` flag."""
        lost = super().__new__(cls, reason)
        lost.offline = offline
        return lost

    @classmethod
    def of(cls, error: ErrorReply) -> SiloLost:
        """The loss an error reply means (its first line, at most 300 characters)."""
        return cls(f"the silo failed: {error.first_line}"[:300], offline=error.offline)


def check_unlearn_reply(reply: UnlearnReply, reference: Params) -> str | None:
    """Why the erasure delta does not fit the reference model (names, shapes, dtypes, finite
    values), or None."""
    bad = check_tensors(reply.delta, reference)
    return None if bad is None else f"{bad.reason.value}: {bad.detail}"


def read_unlearn_reply(
    reply: Message, reference: Params
) -> tuple[Params, torch.Tensor, list[str], dict[str, float], torch.Tensor | None] | str:
    """(delta, signature basis, basis tensor names, metrics, forget gradient or None), or why
    the reply is unusable:
    a ``SiloLost`` for an error reply (the silo went down; the request is retried), a plain
    ``str`` for a reply that came back malformed (the request fails). ``metrics``: every
    metric but silo, job and base version, as floats."""
    try:
        got = UnlearnReply.from_message(reply)
    except ErrorReply as e:
        return SiloLost.of(e)
    except Malformed as e:
        return f"malformed erasure reply: {e}"
    bad = check_unlearn_reply(got, reference)
    if bad is not None:
        return bad
    return got.delta, got.basis, list(got.names), got.report(), got.gradient
