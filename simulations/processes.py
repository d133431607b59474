"""The processes of one local deployment: started in process groups, stopped by pid, verified.

Each process is started in a session (and so a process group) of its own, with its own
FLWR_HOME and temp folder, its output in a log file, and a marker in its environment that its
descendants inherit. Stopping sends SIGTERM to every group, waits, sends SIGKILL to what is
left, and then looks for the marker in /proc: Flower starts some processes detached, in
sessions of their own (the SuperLink's SuperExec and, through it, the ServerApp), which no
process group reaches. Linux only (/proc) for that last check.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("fedasync")

MARKER_ENV = "FEDASYNC_DEPLOY"
"""Environment variable whose value marks every process of one deployment."""


@dataclass
class Proc:
    """One started process: its name, handle and log file."""

    name: str
    popen: subprocess.Popen
    log: Path

    def tail(self, lines: int = 15) -> str:
        """The last lines of its log (for error messages)."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])


class Processes:
    """Start marked processes and stop all of them (and their descendants) again."""

    def __init__(self, marker: str):
        self.marker = marker
        self.procs: list[Proc] = []
        self.seen: set[int] = set()
        """Every pid started or found carrying the marker (to check later that all are gone)."""

    def start(
        self,
        name: str,
        cmd: Sequence[str],
        home: Path,
        *,
        pipe: bool = False,
    ) -> Proc:
        """Start ``cmd`` in ``home`` (its FLWR_HOME, cwd and, under tmp/, its TMPDIR); output to
        ``home/<name>.log``, or to a pipe read by the caller when ``pipe``."""
        tmp = home / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        bin_dir = str(Path(cmd[0]).parent)
        full_env = {
            **os.environ,
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "FLWR_HOME": str(home),
            "TMPDIR": str(tmp),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PYTHONUNBUFFERED": "1",
            MARKER_ENV: self.marker,
        }
        log_path = home / f"{name}.log"
        out = subprocess.PIPE if pipe else open(log_path, "ab")  # noqa: SIM115 - closed below
        try:
            popen = subprocess.Popen(
                list(cmd),
                cwd=home,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                text=pipe,
            )
        finally:
            if not pipe:
                out.close()  # type: ignore[union-attr]
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        self.seen.add(popen.pid)
        return proc

    def scan(self) -> list[int]:
        """Live processes carrying the marker (zombies excluded); remembered in ``seen``."""
        pids = pids_with_env(MARKER_ENV, self.marker)
        self.seen.update(pids)
        return pids

    def stop(self, grace_s: float = 10.0) -> list[int]:
        """Stop everything started, newest first; return the pids still alive (should be none).

        SIGTERM to each process group and to every marked process (also those in sessions of
        their own), ``grace_s`` to exit, then SIGKILL to the groups and to every marked process
        left, until two scans in a row find none (a child started late is caught too).
        """
        deadline = time.monotonic() + grace_s
        live = [p for p in reversed(self.procs) if p.popen.poll() is None]
        for p in live:
            _signal_group(p.popen.pid, signal.SIGTERM)
        termed = set(self.scan())
        for pid in termed:
            _kill(pid, signal.SIGTERM)
        for p in live:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM: SIGKILL", p.name, p.popen.pid)
        for p in self.procs:
            _signal_group(p.popen.pid, signal.SIGKILL)  # whatever is left in the group
            try:
                p.popen.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) survived SIGKILL", p.name, p.popen.pid)
        return self._stop_marked(deadline, termed)

    def _stop_marked(self, deadline: float, termed: set[int]) -> list[int]:
        quiet = 0
        while quiet < 2:
            left = self.scan()
            if not left:
                quiet += 1
                time.sleep(0.2)
                continue
            quiet = 0
            now = time.monotonic()
            if now > deadline + 5.0:
                log.error("processes %s survived SIGKILL", left)
                return left
            for pid in left:
                if pid not in termed:
                    termed.add(pid)
                    _kill(pid, signal.SIGTERM)
                elif now > deadline:
                    _kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        return []


def _kill(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def pids_with_env(name: str, value: str) -> list[int]:
    """Processes (not this one) whose environment has ``name=value``."""
    needle = f"{name}={value}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, exited but not reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
