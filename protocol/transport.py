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
import types


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
