"""Follow a live event log (metrics.jsonl) as it grows: the new whole events at each poll.

Shared by whatever watches a run while it runs: ``fedasync deploy local``'s progress lines
(simulations.deploy_progress) and the metrics sinks (runkit.sinks). A reader of a live log
meets three things besides new lines, and `EventTail` takes each in its stride:

- a torn last line (a write in flight, or a process killed mid-write): it waits, unread, for
  its newline;
- a line that is not a JSON object (a crash tore it and the run appended after it): skipped;
- a log begun again: a fresh run's new file, or a resumed run that cut the log back to its
  checkpoint's offset (fedasync.events) and wrote on. The tail notices a smaller file, another
  file, or other bytes where the last line it read ended, and reads the new log from its
  start; ``generation`` counts these restarts, so that a reader that derives something from
  the events (a sink) can start that again too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

GUARD_BYTES = 64
"""Bytes before the read offset that must be unchanged for the log to be the one read so far."""


class EventTail:
    """The events appended to ``path`` since the last `poll` (the file may not exist yet, be
    replaced, or be cut back: see the module's docstring)."""

    def __init__(self, path: Path, *, keep: bool = True):
        self.path = Path(path)
        self.keep = keep
        """Keep every event read in `events` (a reader that only wants the new ones: False)."""
        self.offset = 0
        """Bytes of the log read so far (whole lines only)."""
        self.generation = 0
        """How many times the log was found begun again (0: the first one read)."""
        self.events: list[dict[str, Any]] = []
        """Every event read from the current log (cleared when it begins again; with ``keep``)."""
        self._inode = 0
        self._guard = b""

    def _restarted(self, f: Any, st: os.stat_result) -> bool:
        """Whether the open file is not the log read so far."""
        if self.offset == 0:
            return False
        if st.st_ino != self._inode or st.st_size < self.offset:
            return True
        f.seek(self.offset - len(self._guard))
        return bool(f.read(len(self._guard)) != self._guard)

    def poll(self) -> list[dict[str, Any]]:
        """The whole events appended since the last call; [] while the file does not exist."""
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return []
        with f:
            st = os.fstat(f.fileno())
            if self._restarted(f, st):
                self.offset, self._guard, self.events = 0, b"", []
                self.generation += 1
            self._inode = st.st_ino
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # what follows the last newline is a line still coming
        if end == 0:
            return []
        whole = data[:end]
        self.offset += end
        self._guard = (self._guard + whole[-GUARD_BYTES:])[-GUARD_BYTES:]
        new = [e for e in map(_event, whole.split(b"\n")) if e is not None]
        if self.keep:
            self.events += new
        return new


def _event(line: bytes) -> dict[str, Any] | None:
    """The event on ``line``; None for a blank line or one that is not a JSON object."""
    if not line.strip():
        return None
    try:
        e = json.loads(line.decode("utf-8", errors="replace"))
    except json.JSONDecodeError:
        return None
    return e if isinstance(e, dict) and "event" in e else None
