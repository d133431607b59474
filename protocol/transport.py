"""Flower transport tuning shared by the ServerApp, the SuperNode launcher and the worker.

Flower 1.42 pulls a message's content (its objects) separately from the message. A reader
can see a message whose content is still arriving (a SuperNode stores a message before
pulling its content; a reply reaches the SuperLink before its objects), and Flower then
retries the object after 1 s, doubling up to 10 s: a whole second on a path that otherwise
takes milliseconds. ``short_backoff`` makes one module's pulls retry after 10 ms.

These rely on Flower internals (flwr is pinned to the tested minor version):
``FlowerInternalsMoved`` is raised, at start, when they are not where 1.42 has them.
"""

from __future__ import annotations

import functools
import inspect
import time
import types
from typing import Any


class FlowerInternalsMoved(RuntimeError):
    """A Flower internal this project relies on is not where flwr 1.42 has it."""


def short_backoff(module: types.ModuleType, name: str, initial_s: float = 0.01) -> None:
    """Make ``module.name`` (Flower's ``pull_objects`` or ``pull_and_inflate_object_from_tree``
    as that module imported it) retry an object that is not there yet after ``initial_s``,
    doubling up to 0.2 s (Flower: 1 s up to 10 s). Idempotent. FlowerInternalsMoved if the
    function or its backoff parameters are not there."""
    fn = getattr(module, name, None)
    if isinstance(fn, functools.partial):
        fn = fn.func
    if fn is None or not callable(fn):
        raise FlowerInternalsMoved(f"{module.__name__} has no {name}")
    params = inspect.signature(fn).parameters
    if "initial_backoff" not in params or "backoff_cap" not in params:
        raise FlowerInternalsMoved(f"{module.__name__}.{name} has no initial_backoff/backoff_cap")
    setattr(module, name, functools.partial(fn, initial_backoff=initial_s, backoff_cap=0.2))


class CappedSleep(types.ModuleType):
    """``time`` whose ``sleep`` waits at most ``cap_s``; every other attribute is ``time``'s
    own. Set as one Flower module's ``time`` (``cap_sleep``) it shortens that module's fixed
    sleeps only."""

    def __init__(self, cap_s: float):
        super().__init__("time")
        self.cap_s = cap_s

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, at most ``cap_s``."""
        time.sleep(min(seconds, self.cap_s))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def cap_sleep(module: types.ModuleType, cap_s: float) -> None:
    """Cap ``module``'s ``time.sleep`` at ``cap_s`` (idempotent; adjusts a cap set before).
    FlowerInternalsMoved unless the module imports ``time`` as ``time``."""
    current = getattr(module, "time", None)
    if isinstance(current, CappedSleep):
        current.cap_s = cap_s
        return
    if current is not time:
        raise FlowerInternalsMoved(f"{module.__name__} does not import time")
    module.time = CappedSleep(cap_s)  # type: ignore[attr-defined]
