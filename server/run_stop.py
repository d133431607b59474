"""A run's stop: the launcher's handle on a running ServerApp, and the grid that stops it.

The simulation launcher stops a run (Ctrl-C, SIGTERM) through a ``StopHandle``; the ServerApp
then sees the grid (``StoppableGrid``) raise ``RunStopped`` at its next poll, so the loop is
stopped between two steps, checkpoint written, never inside one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from flwr.serverapp import Grid


class RunStopped(BaseException):
    """The launcher stopped the run (Ctrl-C, SIGTERM): raised in the ServerApp's thread at its
    next poll of the grid. A BaseException, so that no ``except Exception`` takes it for a
    silo's failure."""


class StoppableGrid:
    """``grid`` whose reading calls (``pull_messages``, ``get_node_ids``) raise RunStopped once
    ``stopped()`` gives a reason (None: go on); everything else is passed through. Pushing
    never raises, so the loop is stopped between two steps, never inside one."""

    def __init__(self, grid: Grid, stopped: Callable[[], str | None]):
        self.inner, self._stopped = grid, stopped

    def check(self) -> None:
        """RunStopped (with the reason) if the run was asked to stop."""
        reason = self._stopped()
        if reason is not None:
            raise RunStopped(reason)

    def pull_messages(self, *args: Any, **kwargs: Any) -> Any:
        """The grid's, unless the run was stopped (then ``RunStopped``)."""
        self.check()
        return self.inner.pull_messages(*args, **kwargs)

    def get_node_ids(self, *args: Any, **kwargs: Any) -> Any:
        """The grid's, unless the run was stopped (then ``RunStopped``)."""
        self.check()
        return self.inner.get_node_ids(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def stop_reason(e: BaseException) -> str | None:
    """What stopped a run, in words, from the exception that ended its loop (None: it is no
    stop but a failure): ``RunStopped`` (its reason), or the SuperLink refusing the run's calls
    after ``flwr stop``, which Flower 1.42 shows the ServerApp as ``RunNotRunningException``
    or as HTTP 401 on the Runtime API (the run's task token revoked)."""
    if isinstance(e, RunStopped):
        return str(e) or "stop requested"
    from flwr.supercore.run import RunNotRunningException

    if isinstance(e, RunNotRunningException):
        return "stopped at the SuperLink (flwr stop)"
    response = getattr(e, "response", None)  # httpx.HTTPStatusError
    if getattr(response, "status_code", None) == 401 and "/v1/runtime/" in str(
        getattr(getattr(response, "request", None), "url", "")
    ):
        return "stopped at the SuperLink (flwr stop: the run's task token was revoked)"
    return None


class StopHandle:
    """How the simulation launcher stops a running ServerApp and waits for its thread, which
    Flower does not make a daemon: a process cannot exit while it runs."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.started = False
        self.done = threading.Event()

    def stop(self, timeout_s: float) -> bool:
        """Ask the run to stop; whether its ServerApp ended (or never started) in ``timeout_s``."""
        self.requested.set()
        return not self.started or self.done.wait(timeout_s)
