"""The ``fedasync`` console script: Ctrl-C is one line at any moment, imports included.

``simulations.cli`` imports torch, MONAI and Flower (seconds); a Ctrl-C while they load would
otherwise print the interpreter's KeyboardInterrupt traceback. This module imports nothing
heavy before it can catch it. Each command handles a signal during its run itself (one line
saying where it stopped and how to resume); what reaches here is a Ctrl-C before a command
started, or one while the interpreter shuts down after it finished: either ends the process
at once with 128 + the signal's number, without a traceback.
"""

from __future__ import annotations

import os
import signal
import sys


def _end(code: int) -> None:
    """Exit with ``code`` at once: streams flushed, no thread joined, no atexit callback run
    (a second Ctrl-C there would print a traceback of the interpreter's shutdown)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main() -> None:
    """Run ``fedasync`` with the process's arguments; exit with its code."""
    try:
        from simulations.cli import main as cli_main

        code = cli_main()
    except KeyboardInterrupt as e:  # before a command took over its signals, or after
        name = getattr(e, "name", "SIGINT")
        print(f"fedasync: stopped by {name}; nothing to resume", file=sys.stderr)
        _end(getattr(e, "exit_code", 130))
        return
    # the command is done: a Ctrl-C while the interpreter shuts down ends it at once, quietly
    for s in (signal.SIGINT, signal.SIGHUP):
        signal.signal(s, _quietly)
    sys.exit(code)


def _quietly(signum: int, frame: object) -> None:
    _end(128 + signum)
