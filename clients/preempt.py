"""Local training that stops between two steps when its node learns of an erasure (no Flower
imports).

An erasure request cancels its silo's training job in flight (server/cancel.py), but Flower
cannot withdraw a message already pushed: the node would finish the job before it even looks
at the ``train.unlearn`` message queued behind it. On a deployed node the warm worker
(simulations/worker.py) watches its SuperNode for that message while a training job runs;
when it comes, the worker calls ``request``, and the training loop, which calls ``check``
before each local step (and ``sleep`` for an emulated-speed wait), stops: ``Preempted``
ends the job as an error reply, which the server has already stopped waiting for. The
erasure then starts within one local step of the message reaching the node.

One flag per process: a worker runs one task at a time, and ``clear`` resets the flag before
each. The worker must use this module as the app imported it (``sys.modules``, after the
app's FAB is loaded): the FAB brings its own copy of the ``clients`` package.
"""

from __future__ import annotations

import threading

_flag = threading.Event()
_why: list[str] = [""]


class Preempted(RuntimeError):
    """The job was stopped between two local steps: an erasure of this silo came."""


def request(why: str) -> None:
    """Stop the training job running in this process at its next step (any thread)."""
    _why[0] = why
    _flag.set()


def clear() -> None:
    """No stop requested (before a new task)."""
    _flag.clear()
    _why[0] = ""


def requested() -> bool:
    """Whether a stop was requested."""
    return _flag.is_set()


def check(step: int, steps: int) -> None:
    """Raise ``Preempted`` when a stop was requested (call before local step ``step``)."""
    if _flag.is_set():
        raise Preempted(f"preempted after {step} of {steps} local steps: {_why[0]}")


def sleep(seconds: float) -> bool:
    """Wait ``seconds``, or less when a stop is requested meanwhile; True when one was."""
    return _flag.wait(timeout=max(0.0, seconds))
