"""What an erasure certificate reads from a run's event log (``metrics.jsonl``), fast.

The store has the request's states, times and metrics; the event log adds the run's clock
time of each step, the checks between the boundary and verification (``erasure_watch``),
the calibration overlap of every later update, and what the server did with the silo's work
(cancelled jobs, discarded replies, updates refused as erased, updates taken after the
boundary). A long run's log holds hundreds of thousands of lines, so they are not read one
by one: the few that can concern the request are found by what they hold and parsed, and the
updates after the boundary are read by a regular expression (``read_run_events``). Read-only; a torn last line (a write in flight) and lines
that are not JSON objects are skipped, as ``fedasync.events.read_events(skip_bad=True)``
does (that module is not imported here: it would load torch).

Retraining reference runs (``references``) are read the same way: their ``eval`` events
with the ``bd_*`` forgetting metrics that ``lab.backdoor.watch`` adds.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_START, _REJECT, _EVAL = (b'{"event": "%s"' % k for k in (b"start", b"reject", b"eval"))
_HEADS = re.compile(
    rb'^\{"event": "update", "t": ([-0-9.eE+]+), "version": (-?[0-9]+), "silo": (-?[0-9]+),',
    re.MULTILINE,
)
_OVERLAP = re.compile(rb'"calibration_overlap": ([-0-9.eE+]+)[,}]')
_WATCHED = ("asr", "forget_accuracy", "mia_auc")
"""The forgetting metrics a retraining reference has (as ``bd_<name>`` in its evals)."""


@dataclass
class RunEvents:
    """The events of one run that concern one request (see the module docstring)."""

    clock: str | None = None
    """``virtual`` or ``wall`` (the ``start`` event), None when it is not there."""
    erasure: list[dict[str, Any]] = field(default_factory=list)
    """The request's ``erasure`` events (one per state entered), in order."""
    watch: list[dict[str, Any]] = field(default_factory=list)
    """Its ``erasure_watch`` events: the checks between the boundary and verification."""
    cancelled: list[dict[str, Any]] = field(default_factory=list)
    """``job_cancelled`` events for the request."""
    discarded: int = 0
    """Replies of jobs cancelled for the request that were dropped (``reply_discarded``)."""
    refused_erased: int = 0
    """``reject`` events of the silo's updates with reason ``erased``."""
    calibrated: list[tuple[float, int]] = field(default_factory=list)
    """``(t, version)`` of every update taken in the calibration window (from the boundary
    to verification): each was calibrated."""
    overlaps: list[float] = field(default_factory=list)
    """The ``calibration_overlap`` of those that carry one."""
    silo_after: int = 0
    """Updates of the request's silo taken from the boundary on."""
    sha256: str = ""
    """The log file's SHA-256 as read (the certificate names what it was built from)."""


def _lines(data: bytes) -> list[bytes]:
    """The whole lines of ``data``: a last line without its newline is left out."""
    end = data.rfind(b"\n")
    return [] if end < 0 else data[:end].split(b"\n")


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        ev = json.loads(line)
    except ValueError:
        return None
    return ev if isinstance(ev, dict) else None


def _lines_with(data: bytes, needle: bytes) -> list[tuple[int, bytes]]:
    """``(offset, line)`` of each whole line of ``data`` holding ``needle``, in order."""
    found: list[tuple[int, bytes]] = []
    at = data.find(needle)
    while at >= 0:
        start = data.rfind(b"\n", 0, at) + 1
        end = data.find(b"\n", at)
        if end < 0:
            break  # the torn last line
        found.append((start, data[start:end]))
        at = data.find(needle, end)
    return found


def read_run_events(
    path: Path, request_id: str, silo: int, window: tuple[int, float] | None = None
) -> RunEvents:
    """The events of the log at ``path`` that concern request ``request_id`` of ``silo``;
    ``window``: its boundary version and its verified one (``inf`` while not verified), or
    None before the erasure was applied (then no update concerns it).

    Found by what they hold, not line by line: the lines naming the request, the ``start``
    line, the refusals as ``erased``; the updates only from the request's ``calibrating``
    event on (the log is in version order: none before it has the boundary's version), read
    by regular expressions over that part."""
    data = Path(path).read_bytes()
    out = RunEvents(sha256=hashlib.sha256(data).hexdigest())
    start = _lines_with(data[:4096], _START)
    if start:
        ev = _parse(start[0][1])
        if ev is not None and isinstance(ev.get("clock"), str):
            out.clock = ev["clock"]
    boundary_at = 0
    for offset, line in _lines_with(data, request_id.encode()):
        ev = _mine(out, line, request_id)
        if ev is not None and ev.get("event") == "erasure" and ev.get("state") == "calibrating":
            boundary_at = offset
    for _, line in _lines_with(data, b'"reason": "erased"'):
        ev = _parse(line) if line.startswith(_REJECT) else None
        if ev is not None and ev.get("silo") == silo and ev.get("reason") == "erased":
            out.refused_erased += 1
    if window is not None:
        _updates(out, data, boundary_at, silo, window)
    return out


def _mine(out: RunEvents, line: bytes, request_id: str) -> dict[str, Any] | None:
    """A line that names the request: its erasure or watch event, a cancelled job of it, a
    reply dropped for it. The event, parsed."""
    ev = _parse(line)
    if ev is None:
        return None
    kind = ev.get("event")
    if kind == "erasure" and ev.get("request") == request_id:
        out.erasure.append(ev)
    elif kind == "erasure_watch" and ev.get("request") == request_id:
        out.watch.append(ev)
    elif kind == "job_cancelled" and ev.get("request_id") == request_id:
        out.cancelled.append(ev)
    elif kind == "reply_discarded" and request_id in str(ev.get("reason", "")):
        out.discarded += 1
    return ev


def _updates(
    out: RunEvents, data: bytes, offset: int, silo: int, window: tuple[int, float]
) -> None:
    """The ``update`` lines from ``offset`` on, read from their head (``EventLog.write`` puts
    ``t``, ``version`` and ``silo`` first): those in the calibration ``window`` (their time,
    version and overlap) and how many of them are the silo's."""
    end = data.rfind(b"\n") + 1  # whole lines only
    for m in _HEADS.finditer(data, offset, end):
        version, who = int(m.group(2)), int(m.group(3))
        if version >= window[0] and who == silo:
            out.silo_after += 1
        if window[0] <= version < window[1]:
            out.calibrated.append((float(m.group(1)), version))
            lap = _OVERLAP.search(data, m.end(), data.find(b"\n", m.end()))
            if lap is not None:
                out.overlaps.append(float(lap.group(1)))


@dataclass(frozen=True)
class Reference:
    """One retraining reference run: its name, its log's SHA-256, and each forgetting
    metric's evaluations over time (``[(t, value), ...]`` in time order)."""

    name: str
    sha256: str
    series: dict[str, list[tuple[float, float]]]

    def at(self, metric: str, t: float) -> float | None:
        """The metric at clock time ``t``, interpolated linearly between the evaluations
        around it (the nearest one outside their span); None when it was never measured."""
        points = self.series.get(metric) or []
        if not points:
            return None
        if t <= points[0][0]:
            return points[0][1]
        for (t0, v0), (t1, v1) in zip(points, points[1:]):
            if t <= t1:
                return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
        return points[-1][1]


def read_reference(run_dir: Path) -> Reference:
    """A retraining reference run's forgetting metrics over time (``bd_*`` in its ``eval``
    events, written with ``lab.backdoor.watch=true``). FileNotFoundError without a log."""
    path = Path(run_dir) / "metrics.jsonl"
    data = path.read_bytes()
    series: dict[str, list[tuple[float, float]]] = {m: [] for m in _WATCHED}
    for line in _lines(data):
        if not line.startswith(_EVAL) or b'"bd_' not in line:
            continue
        ev = _parse(line)
        if ev is None or not isinstance(ev.get("t"), int | float):
            continue
        for m in _WATCHED:
            v = ev.get(f"bd_{m}")
            if isinstance(v, int | float):
                series[m].append((float(ev["t"]), float(v)))
    for points in series.values():
        points.sort()
    return Reference(Path(run_dir).name, hashlib.sha256(data).hexdigest(), series)
