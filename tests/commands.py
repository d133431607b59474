"""A real ``fedasync`` command started by a test, and everything it starts, found and stopped.

The command runs in a session of its own (so that a test can send Ctrl-C to its whole process
group, as a terminal does), with its output in files, a private temp folder (Ray's socket paths
must stay under 108 bytes, so it is short, under /tmp) and a marker variable that every process
it starts inherits. ``left()`` finds what is still alive by that marker and by the files held in
its folders (Ray's agents can lose the variable); ``kill()`` stops all of it. Shared by
``test_run_ending.py``, ``test_trainers_ending.py`` and ``ctrl_c_sweep.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from fedasync.processes import alive, pids_with_env

REPO = Path(__file__).resolve().parents[1]
MARKER = "FEDASYNC_TEST_RUN"


def fedasync_exe() -> str:
    """The ``fedasync`` console script of this environment."""
    exe = Path(sys.executable).parent / "fedasync"
    return str(exe) if exe.exists() else str(REPO / ".venv" / "bin" / "fedasync")


def holds(proc: Path, folders: tuple[str, ...]) -> bool:
    """Whether a process names one of ``folders`` in its command line or holds a file in one."""
    try:
        if any(f.encode() in (proc / "cmdline").read_bytes() for f in folders):
            return True
        return any(os.readlink(fd).startswith(folders) for fd in (proc / "fd").iterdir())
    except OSError:
        return False


def names(pids: Sequence[int]) -> dict[int, str]:
    """What each process is: the start of its command line."""
    out = {}
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            out[pid] = cmdline[:80].decode(errors="replace")
        except OSError:
            out[pid] = "(gone)"
    return out


class Command:
    """``argv`` (default: the ``fedasync`` script with ``args``) started in ``folder``."""

    def __init__(
        self,
        folder: Path,
        args: Sequence[str] = (),
        *,
        argv: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.folder, self.marker = folder, uuid.uuid4().hex
        folder.mkdir(parents=True, exist_ok=True)
        self.temp = Path(tempfile.mkdtemp(prefix="fa-test-", dir="/tmp"))
        n = len(list(folder.glob("stderr*")))
        self.out = folder / ("stdout" if n == 0 else f"stdout{n}")
        self.err = folder / ("stderr" if n == 0 else f"stderr{n}")
        full_env = {
            **os.environ,
            "TMPDIR": str(self.temp),
            "FLWR_HOME": str(folder / "flwr-home"),
            "FLWR_TELEMETRY_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",  # a hang's stacks, on SIGABRT (wait's diagnosis)
            **(env or {}),
            MARKER: self.marker,
        }
        cmd = list(argv) if argv is not None else [fedasync_exe(), *args]
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.popen = subprocess.Popen(
                cmd, cwd=REPO, env=full_env, stdout=out, stderr=err, start_new_session=True
            )
        self.t0 = time.monotonic()
        self.seen: set[int] = set()

    def left(self) -> list[int]:
        """Live processes of this command: its marker, or holding its folders' files."""
        pids = set(pids_with_env(MARKER, self.marker))
        folders = (str(self.folder), str(self.temp))
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and holds(entry, folders):
                pids.add(int(entry.name))
        pids.discard(os.getpid())
        live = sorted(p for p in pids if alive(p))
        self.seen.update(live)
        return live

    def wait_for(self, ready: Callable[[], bool], what: str, timeout_s: float = 300.0) -> None:
        """Until ``ready()``; AssertionError naming ``what`` if the command ended or time ran
        out first. Remembers the pids seen meanwhile (to check each is gone at the end)."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert self.popen.poll() is None, f"it ended before {what}:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
            self.left()
            time.sleep(0.1)
        self.left()

    def interrupt(self, sig: int = signal.SIGINT, timeout_s: float = 30.0) -> int:
        """Ctrl-C to the whole process group, as a terminal sends it (any other signal to the
        command only, as ``kill`` does); its exit code, which must come within ``timeout_s``."""
        if sig == signal.SIGINT:
            os.killpg(self.popen.pid, sig)
        else:
            self.popen.send_signal(sig)
        return self.wait(timeout_s)

    def wait(self, timeout_s: float) -> int:
        """Its exit code. A hang raises TimeoutError with every thread's Python stack (SIGABRT
        makes faulthandler print them) and the end of its stderr."""
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.popen.pid, signal.SIGABRT)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            raise TimeoutError(
                f"no exit within {timeout_s:g} s; stderr:\n{self.stderr()[-12000:]}"
            ) from None

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def gone(self, timeout_s: float = 10.0) -> list[int]:
        """Processes of this command still alive after ``timeout_s`` (a killed one may linger
        a tick)."""
        deadline = time.monotonic() + timeout_s
        while (left := self.left()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def kill(self) -> None:
        """Stop everything of this command that is still there (a test's clean-up)."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in self.left():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.temp, ignore_errors=True)
