"""A deployed node's own event log: what this hospital's ClientApp did, kept on its side.

The coordinator's metrics.jsonl says what the server took from each silo; the hospital keeps
its own record of the jobs it ran (``train``, ``refuse``, ``evaluate``, ``unlearn``), with its
local training loss and score, seconds and, under DP, the epsilon it has spent, in
``<node folder>/metrics.jsonl``. ``fedasync node`` names the file in ``NODE_EVENTS_ENV`` for its
SuperNode and ClientApp processes and follows it into the node's own TensorBoard
(runkit.sinks); nothing of it leaves the node. Without the variable (a simulation, or Flower's
own ``flower-supernode``) nothing is written.

Each event is one line appended in one write, with ``wall`` (seconds since the epoch), so the
processes a node runs its messages in (a warm worker, or one of Flower's per message) share
the file. A write that fails (disk full, the folder gone) is logged once and never fails the
job.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from fedasync.events import EventLog

NODE_EVENTS_ENV = "FEDASYNC_NODE_EVENTS"
"""The environment variable that names a node's event log (set by ``fedasync node``)."""

log = logging.getLogger("fedasync.client")

_logs: dict[str, EventLog] = {}
"""This process's open node logs, by path (a process appends to its node's one log)."""
_failed = False


def record(event: str, **fields: Any) -> None:
    """Append ``event`` with ``fields`` and ``wall`` to the node's event log, if it has one."""
    global _failed
    path = os.environ.get(NODE_EVENTS_ENV)
    if not path:
        return
    try:
        if path not in _logs:
            _logs[path] = EventLog(Path(path))
        _logs[path].write(event, wall=time.time(), **fields)
    except OSError as e:
        if not _failed:
            _failed = True
            log.warning("the node's event log %s cannot be written (%s); jobs go on", path[:200], e)
