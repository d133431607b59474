"""A run's stop: the launcher's handle on a running ServerApp, and the grid that stops it.

The simulation launcher stops a run (Ctrl-C, SIGTERM) through a ``StopHandle``; the ServerApp
then sees the grid (``StoppableGrid``) raise ``RunStopped`` at its next poll, so the loop is
stopped between two steps, checkpoint written, never inside one.
"""

from __future__ import annotations

import threading
from typing import Any

from flwr.serverapp import Grid


class RunStopped(BaseException):
    """The launcher stopped the run (Ctrl-C, SIGTERM): raised in the ServerApp's thread at its
    next poll of the grid. A BaseException, so that no ``except Exception`` takes it for a
    silo's failure."""


class StoppableGrid:
    """``grid`` whose reading calls (``pull_messages``, ``get_node_ids``) raise RunStopped once
    ``stop`` is set; everything else is passed through. Pushing never raises, so the loop is
    stopped between two steps, never inside one."""

    def __init__(self, grid: Grid, stop: threading.Event):
        self._grid, self._stop = grid, stop

    def pull_messages(self, *args: Any, **kwargs: Any) -> Any:
        """The grid's, unless the run was stopped (then ``RunStopped``)."""
        if self._stop.is_set():
            raise RunStopped
        return self._grid.pull_messages(*args, **kwargs)

    def get_node_ids(self, *args: Any, **kwargs: Any) -> Any:
        """The grid's, unless the run was stopped (then ``RunStopped``)."""
        if self._stop.is_set():
            raise RunStopped
        return self._grid.get_node_ids(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


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
