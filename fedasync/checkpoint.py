"""Atomic checkpoint files for the core's state dicts.

No paper. Departure from a plain ``torch.save``: the file is written to a temporary file in
the same directory, fsynced, then moved into place with ``os.replace``, so a crash never
leaves a half-written checkpoint under the final name. Loading uses ``weights_only=True``:
states must be made of tensors, numbers, strings, bools, None, lists, tuples and dicts (all
``state_dict()`` methods of this package comply).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Atomically write ``state`` to ``path`` (creating the parent directory)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename durable; not supported on every platform
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` onto the CPU (weights only)."""
    state = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {path} holds a {type(state).__name__}, not a dict")
    return state
