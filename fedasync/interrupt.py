"""How a command ends on a signal: the same for every run kind.

Paper: none. Shared by ``fedasync simulate``, ``deploy local``, ``node`` and the trainers
(``rl``, ``pipeline``, ``market``), so that Ctrl-C means the same everywhere:

- SIGINT (Ctrl-C), SIGTERM and SIGHUP (the terminal closed) become :class:`Interrupted`, a
  ``KeyboardInterrupt``, so code it passes through treats it as Ctrl-C; its exit code is
  128 + the signal's number, as a shell reports a process the signal ended (130, 143, 129).
- A loop whose state must be saved whole uses :class:`DeferredStop`: the first signal asks for
  a stop, which the loop takes at its next safe point (where it can write a checkpoint); a
  second signal, or the loop not reaching a safe point within ``grace_s``, raises at once.
- Child processes that the parent stops (pool workers, pipeline stages) ignore SIGINT
  (:func:`ignore_interrupts`): Ctrl-C reaches the whole foreground process group, and a child
  that died of it would print its own traceback and race the parent's orderly stop. They are
  started within :func:`children_start_deaf`, so that a Ctrl-C while they start up, before
  they can ignore it, does not reach them either.
- The command prints one line (:func:`stop_line`): what stopped it, where, the checkpoint and
  the command that resumes; then :func:`exit_now` ends the process without joining threads a
  library left behind (a non-daemon thread that outlived the stop held an exit for minutes).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived: the run stops, cleans up and says where it stopped.

    ``at_safe_point``: raised by :meth:`DeferredStop.check` where the loop's state is whole
    (the loop saved it first); False when raised at once (a second signal, the grace over)."""

    def __init__(self, signum: int, *, at_safe_point: bool = False):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.at_safe_point = at_safe_point
        self.run_dir: Path | None = None
        """The run folder of the run it stopped (for a command that runs several)."""
        self.server_left_running = False
        """Something the stop waits for did not stop in time (the process exits regardless)."""
        self.where = ""
        """Where the run stopped, for the stop line (``at version 7``); set by the run."""
        self.checkpoint: Path | str | None = None
        """The checkpoint the run resumes from, set by the run when it has one: its path, or
        words for one of several files (a pipeline's, one per stage); None: none yet."""

    @property
    def name(self) -> str:
        """The signal's name: SIGINT, SIGTERM or SIGHUP."""
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """128 + the signal's number: 130 SIGINT, 143 SIGTERM, 129 SIGHUP."""
        return 128 + self.signum


def signal_of(e: BaseException) -> tuple[str, int]:
    """(signal name, exit code) of an interruption: an :class:`Interrupted`, or a plain
    KeyboardInterrupt (Ctrl-C before a handler was set: SIGINT, 130)."""
    if isinstance(e, Interrupted):
        return e.name, e.exit_code
    return "SIGINT", 130


def raise_interrupted(signum: int, frame: FrameType | None) -> None:
    """A signal handler: raise :class:`Interrupted` in the main thread."""
    raise Interrupted(signum)


def set_handlers(handler: Any, signals: Sequence[int] = STOP_SIGNALS) -> dict[int, Any]:
    """Handle ``signals`` with ``handler``; the handlers they had (to :func:`restore`). Only
    the main thread can set handlers: elsewhere nothing is changed and {} is returned."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in signals}


def restore(previous: dict[int, Any]) -> None:
    """Put back the handlers :func:`set_handlers` returned."""
    for s, h in previous.items():
        signal.signal(s, h if h is not None else signal.SIG_DFL)


@contextmanager
def interruptible() -> Iterator[None]:
    """Within: SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted`."""
    previous = set_handlers(raise_interrupted)
    try:
        yield
    finally:
        restore(previous)


@contextmanager
def handlers_kept(signals: Sequence[int] = STOP_SIGNALS) -> Iterator[None]:
    """Within: code that replaces the handlers of ``signals`` (``ray.init`` installs its own
    for SIGTERM) has them put back on the way out, so the command's own stay in charge. Only
    in the main thread (elsewhere none can be set); a handler not set from Python (None) is
    left as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {s: signal.getsignal(s) for s in signals}
    try:
        yield
    finally:
        restore({s: h for s, h in kept.items() if h is not None})


@contextmanager
def shielded() -> Iterator[None]:
    """Within: SIGINT, SIGTERM and SIGHUP are ignored, so that a second Ctrl-C cannot cut a
    bounded clean-up short (and leave processes behind)."""
    previous = set_handlers(signal.SIG_IGN)
    try:
        yield
    finally:
        restore(previous)


class DeferredStop:
    """A loop's stop at its next safe point.

    Used as a context manager around the loop: the first SIGINT/SIGTERM/SIGHUP only records the
    request (:attr:`requested`); the loop calls :meth:`check` where its state is whole, saves it
    and lets the :class:`Interrupted` that ``check`` raises end the run. If the loop does not
    get there within ``grace_s`` (it waits on something slow), or a second signal comes, the
    signal raises at once wherever the loop is; the run then keeps its last saved state.
    """

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}
        self._alarm: Any = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None:
            raise Interrupted(self.requested)  # the second: at once
        self.requested = signum
        if threading.current_thread() is threading.main_thread() and self.grace_s > 0:
            self._alarm = signal.signal(signal.SIGALRM, self._on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.grace_s)

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None:
            raise Interrupted(self.requested)

    def check(self) -> None:
        """Raise :class:`Interrupted` (``at_safe_point``) if a stop was asked for."""
        if self.requested is not None:
            self._disarm()
            raise Interrupted(self.requested, at_safe_point=True)

    def _disarm(self) -> None:
        if self._alarm is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._alarm)
            self._alarm = None

    def __enter__(self) -> DeferredStop:
        self._previous = set_handlers(self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        self._disarm()
        restore(self._previous)
        self._previous = {}


def ignore_interrupts() -> None:
    """In a child process its parent stops: ignore SIGINT (the terminal sends Ctrl-C to the
    whole process group; the parent stops its children itself, with SIGTERM). Also lets go of
    the block :func:`children_start_deaf` left it with (a SIGINT held by it is dropped)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextmanager
def children_start_deaf() -> Iterator[None]:
    """Within: SIGINT is blocked in this thread, and the processes started here inherit the
    block, so a Ctrl-C while a child starts up (its interpreter, its imports: seconds, before
    it can call :func:`ignore_interrupts`) cannot end it with a traceback. A SIGINT meant for
    this process is held, not lost: it arrives when the block ends.

    multiprocessing's resource tracker, when it starts, unblocks SIGINT in the process that
    starts it: it is started first, so that it cannot undo the block."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def resume_command(command: str, config: str | None, overrides: Sequence[str]) -> str:
    """The command line that resumes a run: the same command, config and overrides, with
    ``run.resume=true`` (replacing a ``run.resume=...`` it had)."""
    parts = ["fedasync", *command.split()]
    if config:
        parts += ["--config", config]
    parts += [o for o in overrides if not o.startswith("run.resume=")]
    parts.append("run.resume=true")
    return shlex.join(parts)


def resume_or_afresh(
    command: str, config: str | None, overrides: Sequence[str], checkpoint: Path | str | None
) -> str:
    """The stop line's last part: the checkpoint and the command that resumes from it, or,
    with no checkpoint, that the run starts afresh when run again (offering a resume that
    would fail for want of a checkpoint would be worse than saying so)."""
    if checkpoint is None:
        return "no checkpoint yet: run it again to start afresh"
    return f"checkpoint {checkpoint}; resume with: {resume_command(command, config, overrides)}"


def stop_line(command: str, e: BaseException, where: str, resume: str) -> str:
    """The one line a command prints when a signal stopped it, e.g. ``fedasync rl: stopped by
    SIGINT at version 7; checkpoint runs/x/checkpoint.pt; resume with: fedasync rl ...``."""
    name, _ = signal_of(e)
    prefix = f"fedasync {command}" if command else "fedasync"
    return f"{prefix}: stopped by {name} {where}; {resume}"


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` now: logs and streams flushed, without joining threads
    (every process the run started is stopped by now; a library's non-daemon thread must not
    hold the exit)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
