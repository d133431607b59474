"""The ``fedasync`` console script: Ctrl-C is one line at any moment, imports included.

``simulations.cli`` imports torch, MONAI and Flower (seconds); a Ctrl-C while they load would
otherwise print the interpreter's KeyboardInterrupt traceback. This module imports nothing
heavy before it can catch it. Each command handles a signal during its run itself (one line
saying where it stopped and how to resume); what reaches here is a Ctrl-C before a command
started ends the process at once with 128 + the signal's number and one line; one while
the interpreter shuts down after the command finished is held off (the command's own exit
code stands), never a traceback.
"""

from __future__ import annotations

import os
import signal
import sys


def _end(code: int) -> None:
    """Exit with ``code`` at once: streams flushed, no thread joined, no atexit callback run
    (a second Ctrl-C there would print a traceback of the interpreter's shutdown). Not
    ``fedasync.interrupt.exit_now``: importing ``fedasync`` loads torch, the seconds of imports
    this module exists to cover."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main() -> None:
    """Run ``fedasync`` with the process's arguments; exit with its code."""
    # While the modules load nothing has started: a Ctrl-C ends the process on the spot. (Raised
    # as KeyboardInterrupt inside an import, some libraries turn it into another error:
    # matplotlib, under MONAI, made it a ValueError with a traceback.)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _before_start)
    try:
        from simulations.cli import main as cli_main
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        code = cli_main()
    except KeyboardInterrupt as e:  # a command that does not take its own signals
        name = getattr(e, "name", "SIGINT")
        print(f"fedasync: stopped by {name}; nothing to resume", file=sys.stderr)
        _end(getattr(e, "exit_code", 130))
        return
    # The command is done and said so. A Ctrl-C while the interpreter shuts down must not end
    # it with a traceback, nor kill it by the signal: Python puts SIG_DFL back late in its
    # shutdown for a signal with a Python handler (not for an ignored one), and blocking it
    # in this thread would not do (another thread, torch's or tqdm's, takes it then).
    for s in (signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    sys.exit(code)


def _before_start(signum: int, frame: object) -> None:
    name = signal.Signals(signum).name
    print(
        f"fedasync: stopped by {name} before the command started; nothing to resume",
        file=sys.stderr,
    )
    _end(128 + signum)
