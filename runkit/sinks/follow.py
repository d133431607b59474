"""The follower: a thread that tails a run's event logs into its sinks while the run runs.

``following(keys, kind, run_dir)`` wraps a run command's run: it prints where the TensorBoard
files go and how to view them, starts a thread that polls the run folder's event logs every
second (``metrics.jsonl``, and the logs beneath it the command names: the sync baseline's, a
market's seeds'), turns each new event into scalars by the one table (runkit.sinks.tags) and
hands them to each sink; when the run ends it reads what is left, adds the run's PNGs written
meanwhile as images, and closes the sinks.

The event log stays the source of truth: a sink's files are derived from it and rebuilt from
it whenever a follower starts (a resumed run's included), and a log that began again (a fresh
run's new file, a resumed run cutting it back to its checkpoint) is followed from its new start
(runkit.tail). A fresh run's follower leaves an earlier run's log alone until the run has
replaced it.

A sink's failure (tensorboard not installed, the disk full, the MLflow server unreachable) is
logged once, on the ``fedasync.sinks`` logger, and that sink is dropped: it never stops or
slows the run, which keeps every event in metrics.jsonl anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from runkit.folder import EVENTS
from runkit.keys import RunKeys
from runkit.sinks import mlflow_sink, tensorboard_sink
from runkit.sinks.tags import Totals, scalars
from runkit.tail import EventTail

log = logging.getLogger("fedasync.sinks")

TENSORBOARD_DIR = "tensorboard"
"""The TensorBoard event files' folder in the run folder."""

FAMILY = {
    "simulate": "fed",
    "deploy": "fed",
    "node": "node",
    "rl": "rl",
    "pipeline": "pipeline",
    "market": "market",
    "trainer": "trainer",
}
"""Each run kind's family of events (runkit.sinks.tags.FAMILIES)."""

POLL_S = 1.0
"""Seconds between two polls of the logs."""
JOIN_S = 60.0
"""Seconds the end of a run waits for the follower's thread: a sink busy setting up (a new
MLflow store takes seconds) finishes; one stuck on the network is left behind."""


class Sink(Protocol):
    """What the follower hands a run's scalars and PNGs to."""

    name: str

    def open(self) -> None:
        """Make ready to write (in the follower's thread: it may take seconds)."""

    def reset(self, stream: str) -> None:
        """``stream``'s log began again: what was written of it goes."""

    def scalars(self, stream: str, rows: list[tuple[str, float, int, float]]) -> None:
        """Write ``(tag, value, step, wall time)`` rows of ``stream``."""

    def images(self, pngs: list[Path], step: int) -> None:
        """Write the run's PNGs, at ``step``."""

    def close(self, ok: bool) -> None:
        """Finish (``ok``: the run finished)."""


@dataclass
class Stream:
    """One followed event log: its tail, its totals, its last step and wall time."""

    name: str
    """Its folder under the run folder ("": the run folder's own log)."""
    tail: EventTail
    totals: Totals = field(default_factory=dict)
    step: int = 0
    wall: float = 0.0
    generation: int = 0

    def rows(self, family: str, events: list[dict[str, Any]], anchor: float) -> list[Any]:
        """The ``(tag, value, step, wall time)`` rows of ``events`` (runkit.sinks.tags)."""
        out = []
        for e in events:
            step = e.get("step", e.get("version"))
            if isinstance(step, int) and not isinstance(step, bool):
                self.step = step
            self.wall = _wall(e, anchor, self.wall)
            out += [
                (tag, value, self.step, self.wall) for tag, value in scalars(family, e, self.totals)
            ]
        return out


def _wall(e: dict[str, Any], anchor: float, last: float) -> float:
    """An event's wall time: its ``wall``, else the follower's start plus its clock time ``t``
    (virtual seconds in a simulation: TensorBoard's relative axis is then the run's clock),
    else plus its ``time_s``; else the last event's."""
    for key, base in (("wall", 0.0), ("t", anchor), ("time_s", anchor)):
        x = e.get(key)
        if isinstance(x, int | float) and not isinstance(x, bool):
            return base + float(x)
    return last or anchor


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class Follower:
    """Follows the logs ``patterns`` (globs under ``run_dir``) of a run of ``family`` into
    ``sinks`` (see the module's docstring). ``fresh``: a run that starts afresh (an earlier
    run's logs are left unread until they change)."""

    def __init__(
        self,
        run_dir: Path,
        family: str,
        sinks: list[Sink],
        *,
        patterns: Iterable[str] = (EVENTS,),
        fresh: bool = False,
        poll_s: float = POLL_S,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.family = family
        self.sinks = list(sinks)
        self.patterns = tuple(patterns)
        self.poll_s = poll_s
        self.streams: dict[Path, Stream] = {}
        self.anchor = time.time()
        self._stale = {p: _signature(p) for p in self._paths()} if fresh else {}
        self._opened = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._broken = False

    # ---------------------------------------------------------------- sinks
    def _call(self, sink: Sink, method: str, *args: Any) -> None:
        """Call ``sink``'s ``method``; the sink's first failure is logged and drops it."""
        if sink not in self.sinks:
            return
        try:
            getattr(sink, method)(*args)
        except Exception as e:  # noqa: BLE001 - any sink failure: logged once, the run goes on
            self.sinks.remove(sink)
            log.warning(
                "%s: stopped writing the run's metrics (%s: %s); the run goes on, and "
                "%s keeps every event",
                sink.name,
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "",
                self.run_dir / EVENTS,
            )

    def _open(self) -> None:
        if not self._opened:
            self._opened = True
            for s in list(self.sinks):
                self._call(s, "open")

    # ---------------------------------------------------------------- the logs
    def _paths(self) -> list[Path]:
        found: set[Path] = set()
        for pattern in self.patterns:
            found.update(p for p in self.run_dir.glob(pattern) if p.is_file())
        return sorted(found)

    def _stream(self, path: Path) -> Stream | None:
        s = self.streams.get(path)
        if s is None:
            if path in self._stale and _signature(path) == self._stale[path]:
                return None  # an earlier run's log, not (yet) replaced by this run's
            self._stale.pop(path, None)
            name = path.parent.relative_to(self.run_dir).as_posix()
            s = Stream("" if name == "." else name, EventTail(path, keep=False))
            self.streams[path] = s
        return s

    def poll(self) -> int:
        """Read every log's new events into the sinks; how many scalars were written."""
        self._open()
        written = 0
        for path in self._paths():
            s = self._stream(path)
            if s is None:
                continue
            events = s.tail.poll()
            if s.tail.generation != s.generation:  # the log began again: so do its scalars
                s.generation, s.totals, s.step, s.wall = s.tail.generation, {}, 0, 0.0
                for sink in list(self.sinks):
                    self._call(sink, "reset", s.name)
            rows = s.rows(self.family, events, self.anchor)
            if rows:
                for sink in list(self.sinks):
                    self._call(sink, "scalars", s.name, rows)
                written += len(rows)
        return written

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._poll_safely()

    def _poll_safely(self) -> None:
        if self._broken:
            return
        try:
            self.poll()
        except Exception:  # noqa: BLE001 - a bug here must not stop the run: logged once
            self._broken = True
            log.warning("the metrics sinks stopped following %s", self.run_dir, exc_info=True)

    # ---------------------------------------------------------------- life cycle
    def start(self) -> Follower:
        """Start following in a thread of its own (a daemon: it never holds the process)."""
        if self.sinks:
            self._thread = threading.Thread(target=self._loop, name="fedasync-sinks", daemon=True)
            self._thread.start()
        return self

    def pngs(self) -> list[Path]:
        """The run folder's PNGs written since the follower started (not an earlier run's)."""
        out = []
        for p in sorted(self.run_dir.glob("*.png")):
            try:
                if p.stat().st_mtime >= self.anchor - 1.0:
                    out.append(p)
            except OSError:
                continue
        return out

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(ok=exc_type is None)

    def close(self, ok: bool = True) -> None:
        """Stop the thread, read what is left, add the PNGs, close the sinks. Never raises."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(JOIN_S)
            if self._thread.is_alive():
                log.warning(
                    "the metrics sinks were still busy after %.0f s (a network call?): left "
                    "behind; %s keeps every event",
                    JOIN_S,
                    self.run_dir / EVENTS,
                )
                return
        if not self.sinks:
            return
        self._poll_safely()
        pngs = self.pngs()
        step = max((s.step for s in self.streams.values()), default=0)
        for sink in list(self.sinks):
            if pngs:
                self._call(sink, "images", pngs, step)
            self._call(sink, "close", ok)


def sinks_for(
    keys: RunKeys,
    run_dir: Path,
    kind: str,
    config: dict[str, Any] | None = None,
) -> list[Sink]:
    """The sinks ``keys`` (``tensorboard``, ``mlflow`` in ``run.trackers``) ask for, those installed; one
    that is not installed is said once."""
    sinks: list[Sink] = []
    if keys.tensorboard:
        why = tensorboard_sink.available()
        if why is None:
            sinks.append(tensorboard_sink.TensorBoardSink(Path(run_dir) / TENSORBOARD_DIR))
        else:
            log.warning(
                "run.tensorboard: tensorboard is not installed (%s): no TensorBoard files "
                "(pip install tensorboard, or run.trackers without tensorboard)",
                why,
            )
    if keys.mlflow:
        why = mlflow_sink.available()
        if why is None:
            sinks.append(
                mlflow_sink.MlflowSink(
                    keys.mlflow_uri, run_dir, f"fedasync {kind}", keys.name, config
                )
            )
        else:
            log.warning(
                "run.trackers has mlflow but MLflow is not installed (%s): pip install 'fedasync[mlflow]'",
                why,
            )
    return sinks


def start_lines(sinks: list[Sink]) -> list[str]:
    """What a run prints as it starts: where its TensorBoard files go and how to view them,
    and its MLflow run."""
    lines = []
    for s in sinks:
        if isinstance(s, tensorboard_sink.TensorBoardSink):
            lines.append(
                f"TensorBoard: {s.logdir} (live); view with: tensorboard --logdir {s.logdir}"
            )
        elif isinstance(s, mlflow_sink.MlflowSink):
            lines.append(f"MLflow: run {s.run_name!r} in experiment {s.experiment!r} at {s.uri}")
    return lines


def start_following(
    keys: RunKeys,
    kind: str,
    run_dir: Path | None = None,
    *,
    patterns: Iterable[str] = (EVENTS,),
    config: dict[str, Any] | None = None,
    echo: Callable[[str], None] = print,
    fresh: bool | None = None,
) -> Follower:
    """Print the start lines and start following (`following`'s arguments); the caller
    closes the follower."""
    run_dir = Path(run_dir) if run_dir is not None else Path(keys.out_dir) / keys.name
    sinks = sinks_for(keys, run_dir, kind, config)
    for line in start_lines(sinks):
        echo(line)
    return Follower(
        run_dir,
        FAMILY[kind],
        sinks,
        patterns=patterns,
        fresh=not keys.resume if fresh is None else fresh,
    ).start()


following = start_following
"""``with following(keys, kind, run_dir, ...) as follower:``: follow the run of ``kind``
(`FAMILY`'s keys) in ``run_dir`` (default ``<run.out_dir>/<run.name>``) while the block runs,
and close the follower with the block (``ok`` unless it raised); see the module's docstring."""
