"""A deployed node's training job stops between two local steps once its silo is being erased
(no Flower imports).

An erasure request cancels its silo's training job in flight (server/cancel.py), but Flower
cannot withdraw a message already pushed, and Flower 1.42's SuperNode takes one message at a
time: it pulls the erasure's ``train.unlearn`` only after it has pushed the reply to the job it
runs. So the node learns of the erasure another way: ``fedasync node --erasure-service``
watches its own silo's requests on the coordinator's erasure service (TLS, the silo's own
token; ``simulations.erasure_watch``) and, when one enters ``erasing``, writes the time it did
to a *stop file* in the node's folder (``write_stop``). Every training job on the node reads
the file's path from ``STOP_FILE_ENV`` and checks it before each local step (``JobStop``): a
job the coordinator sent before that time (its message's ``created_at``, on the same clock) is
obsolete, so it raises ``Preempted`` and the ClientApp answers with an error reply, which the
server has stopped waiting for and drops. The SuperNode then pulls the erasure.

A job sent after the erasure started is never stopped by it, so a stale file can only stop
jobs that are obsolete anyway. Nothing of a stopped job is released: under DP its privacy
spend is recorded only after training (``clients.dp.train_private``), so none is.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

STOP_FILE_ENV = "FEDASYNC_ERASURE_STOP_FILE"
"""The environment variable that names a node's stop file (set by ``fedasync node`` and
``fedasync deploy local`` for the SuperNode and its ClientApp processes)."""

STOP_FILE = "erasure-stop.json"
"""The stop file's name in a node's folder."""

MAX_STOP_BYTES = 4096
"""A larger stop file is not ours: it is ignored (the job trains on)."""


class Preempted(RuntimeError):
    """The job stopped between two local steps: its silo is being erased."""


@dataclass(frozen=True)
class StopSignal:
    """The newest erasure of this node's silo: its request id and when it entered ``erasing``
    (seconds since the epoch, on the coordinator's clock)."""

    request_id: str
    erasing_at: float


def read_stop(path: Path) -> StopSignal | None:
    """The stop file's signal; None when it is missing, torn or not ours."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if len(raw) > MAX_STOP_BYTES:
        return None
    try:
        d = json.loads(raw)
        return StopSignal(str(d["request_id"])[:128], float(d["erasing_at"]))
    except (ValueError, KeyError, TypeError):
        return None


def write_stop(path: Path, request_id: str, erasing_at: float) -> bool:
    """Record that erasure ``request_id`` of this silo entered ``erasing`` at ``erasing_at``,
    unless the file already holds a later one; whole or absent for a reader (a temporary file
    renamed over it). True when the file changed."""
    old = read_stop(path)
    if old is not None and old.erasing_at >= erasing_at:
        return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"request_id": request_id[:128], "erasing_at": erasing_at}))
    os.replace(tmp, path)
    return True


class JobStop:
    """The stop check of one training job the coordinator sent at ``sent_at`` (its message's
    ``created_at``). ``check`` costs one ``stat`` of the stop file per step; the file is read
    only when it changed (each write renames a new file over it: a new inode)."""

    def __init__(self, path: Path | None, sent_at: float) -> None:
        self.path, self.sent_at = path, sent_at
        self._seen: tuple[int, int, int] | None = None
        self.signal: StopSignal | None = None
        """The erasure that stopped this job, once one did."""

    @classmethod
    def from_env(cls, sent_at: float) -> JobStop:
        """The check for a job sent at ``sent_at``, on the stop file ``STOP_FILE_ENV`` names
        (none named: a job that never stops, as in simulation)."""
        name = os.environ.get(STOP_FILE_ENV, "")
        return cls(Path(name) if name else None, sent_at)

    def stopped(self) -> bool:
        """Whether an erasure of this silo started after this job was sent."""
        if self.signal is not None:
            return True
        if self.path is None:
            return False
        try:
            st = self.path.stat()
        except OSError:
            return False
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)  # (a rename: a new inode)
        if seen == self._seen:
            return False
        self._seen = seen
        sig = read_stop(self.path)
        if sig is not None and sig.erasing_at >= self.sent_at:
            self.signal = sig
        return self.signal is not None

    def check(self, step: int, steps: int) -> None:
        """Raise ``Preempted`` before local step ``step`` of ``steps`` when the job is stopped."""
        if self.stopped():
            assert self.signal is not None
            raise Preempted(
                f"stopped after {step} of {steps} local steps: erasure "
                f"{self.signal.request_id} of this silo started"
            )

    def sleep(self, seconds: float, poll_s: float = 0.05) -> bool:
        """Wait ``seconds`` (an emulated slow silo's wait), checking every ``poll_s``; True
        when the job was stopped meanwhile (it then returns at once)."""
        end = time.monotonic() + max(0.0, seconds)
        while not self.stopped():
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(poll_s, left))
        return True
