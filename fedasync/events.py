"""The run's event log: one JSON object a line in ``metrics.jsonl``.

Paper: none. Shared by the federated server and the trainers; each writes its own events.

The federated server's events: ``start``, ``roster``, ``dispatch`` (only at debug level), ``update`` (an applied or
buffered update), ``version`` (the global model advanced), ``reject`` (with a reason), ``eval``,
``checkpoint``, ``fault``, ``silo_eval``, ``end``. Every event carries the clock time ``t`` (virtual
seconds in simulation, wall seconds in deployment) and the global ``version``.

The log is append-only; a checkpoint records its byte offset so that a resumed run truncates
what was written after the checkpoint and never reports an event twice.

Each event is one ``write`` of its whole line on a file opened for append, so a reader polling a
live log (a test waiting for a checkpoint, a dashboard) sees whole lines, except at the end: a
process killed mid-write, or a write still in flight, leaves a last line without its newline.
:func:`read_events` leaves that tail out; a malformed line anywhere before it is an error.
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
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, event: str, **fields: Any) -> None:
        """Append one event (non-finite floats as null) as one line, in one write."""
        line = json.dumps({"event": event, **json_safe(fields)}, sort_keys=False) + "\n"
        data = memoryview(line.encode("utf-8"))
        while data:  # one write for any line a pipe or disk takes whole; the loop is for the rest
            data = data[os.write(self._fd, data) :]

    def offset(self) -> int:
        """The log's length in bytes (a checkpoint keeps it)."""
        return os.fstat(self._fd).st_size

    def truncate(self, offset: int) -> None:
        """Drop everything after ``offset`` (events written after the checkpoint resumed from)."""
        os.ftruncate(self._fd, offset)

    def close(self) -> None:
        """Fsync and close the file."""
        if self._fd < 0:
            return
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1


class EventLogError(ValueError):
    """A metrics.jsonl line that is not an event, before the log's last line."""


def read_events(path: Path, *, skip_bad: bool = False) -> list[dict[str, Any]]:
    """All whole events of a metrics.jsonl file.

    A last line without its newline (a write in flight, or a process killed mid-write) is left
    out. A line before it that is not a JSON object raises :class:`EventLogError` naming the
    file and the line number (the line itself is not echoed: it may be long).

    With ``skip_bad`` (a log a crash may have torn anywhere, e.g. appended to after it: plots,
    the pipeline trainer's resume), every line that reads as a JSON object is an event, the
    last one too, and any other line is skipped.
    """
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    # The piece after the last newline: empty for a whole log, a torn line otherwise.
    tail = lines.pop()
    if skip_bad:
        lines.append(tail)
    out: list[dict[str, Any]] = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            ev = json.loads(raw.decode("utf-8", errors="replace" if skip_bad else "strict"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if skip_bad:
                continue
            raise EventLogError(f"{path}: line {n} is not a JSON event ({type(e).__name__})") from e
        if not isinstance(ev, dict):
            if skip_bad:
                continue
            raise EventLogError(f"{path}: line {n} is not a JSON object")
        out.append(ev)
    return out
