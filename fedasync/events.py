"""The run's event log: one JSON object a line in ``metrics.jsonl``.

Paper: none. Shared by the federated server and the trainers; each writes its own events.

The federated server's events: ``start``, ``roster``, ``dispatch`` (only at debug level), ``update`` (an applied or
buffered update), ``version`` (the global model advanced), ``reject`` (with a reason), ``eval``,
``checkpoint``, ``fault``, ``silo_eval``, ``end``. Every event carries the clock time ``t`` (virtual
seconds in simulation, wall seconds in deployment) and the global ``version``.

The log is append-only; a checkpoint records its byte offset so that a resumed run truncates
what was written after the checkpoint and never reports an event twice.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def json_safe(v: Any) -> Any:
    """``v`` with non-finite floats as None and tuples as lists (strict JSON)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [json_safe(x) for x in v]
    return v


class EventLog:
    """Append JSON lines to ``path``; ``offset()`` and ``truncate()`` support resume."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, event: str, **fields: Any) -> None:
        """Append one event (non-finite floats as null) and flush it."""
        self._f.write(json.dumps({"event": event, **json_safe(fields)}, sort_keys=False) + "\n")
        self._f.flush()

    def offset(self) -> int:
        """The log's length in bytes, everything written flushed (a checkpoint keeps it)."""
        self._f.flush()
        return self._f.tell()

    def truncate(self, offset: int) -> None:
        """Drop everything after ``offset`` (events written after the checkpoint resumed from)."""
        self._f.flush()
        self._f.close()
        with open(self.path, "r+b") as f:
            f.truncate(offset)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def close(self) -> None:
        """Flush, fsync and close the file."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    """All events of a metrics.jsonl file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
