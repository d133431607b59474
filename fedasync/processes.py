"""Processes we start, and those Ray starts for us: started in process groups, stopped by pid,
verified; Ray sessions owned by a run and the orphans of runs whose driver died (used by the
simulations, the deployment and the trainers alike, so it lives in the core).

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
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger("fedasync")

FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}
"""Set in every process a deployment starts: no telemetry (a POST that can hold a process 4 s
at exit), no update check (a request to flower.ai), no installs of the app's dependencies."""

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
        env: dict[str, str] | None = None,
    ) -> Proc:
        """Start ``cmd`` in ``home`` (its FLWR_HOME, cwd and, under tmp/, its TMPDIR); output to
        ``home/<name>.log``, or to a pipe read by the caller when ``pipe``; ``env`` adds to the
        environment (``FLOWER_ENV`` and the marker are always set)."""
        tmp = home / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        # the command's folder and this interpreter's (a command run through a wrapper, such as
        # ``ip netns exec``, still finds the environment's tools: the SuperLink its SuperExec)
        bins = dict.fromkeys(
            [str(Path(cmd[0]).parent)] * Path(cmd[0]).is_absolute()
            + [str(Path(sys.executable).parent)]
        )
        full_env = {
            **os.environ,
            "PATH": os.pathsep.join([*bins, os.environ.get("PATH", "")]),
            "FLWR_HOME": str(home),
            "TMPDIR": str(tmp),
            **FLOWER_ENV,
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
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

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) each live started process has used so far, by name
        (its own, not its children's; Linux /proc)."""
        out = {}
        for p in self.procs:
            if p.popen.poll() is None and (cpu := cpu_seconds(p.popen.pid)) is not None:
                out[p.name] = cpu
        return out

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


def pids_with_env(name: str, value: str, *, prefix: bool = False) -> list[int]:
    """Processes (not this one) whose environment has ``name=value`` (with ``prefix``: a value
    that starts with ``value``)."""
    needle = f"{name}={value}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(needle) for v in env) if prefix else needle in env:
            pids.append(int(entry.name))
    return pids


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (None: gone, or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, exited but not reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# ---------------------------------------------------------------- orphans of earlier runs
RAY_SESSION_ENV = "FEDASYNC_RAY_SESSION"
"""Environment variable whose value, a private Ray's temp folder, marks every process of it."""

RAY_TMP_PREFIX = "fa-ray-"
"""How the name of a private Ray's temp folder starts (made by the simulation launcher)."""

OWNER_FILE = "fedasync-owner"
"""In a private Ray's temp folder: ``<pid> <time_ns>`` of the driver that made it."""


def owner_token() -> str:
    """``<pid>:<time_ns>`` of this process, now: names the owner of what it starts."""
    return f"{os.getpid()}:{time.time_ns()}"


def write_owner(session: Path) -> None:
    """Record this process as the owner of the Ray temp folder ``session``."""
    (session / OWNER_FILE).write_text(owner_token().replace(":", " ") + "\n")


def owner_alive(pid: int, since_ns: int) -> bool:
    """Whether the process that wrote ``<pid>:<since_ns>`` still runs: ``pid`` is alive and
    started before ``since_ns`` (a recycled pid belongs to a process started later)."""
    if not alive(pid):
        return False
    started = _start_time_s(pid)
    return started is None or started <= since_ns / 1e9 + 1.0


def _start_time_s(pid: int) -> float | None:
    """Wall-clock time (s since the epoch) at which ``pid`` started, from /proc."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return int(line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return None


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _name(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.split(b"\0", 1)[0].decode(errors="replace").strip() or "?"


def _ray_session_of(pid: int, env: dict[str, str]) -> Path | None:
    """The private Ray temp folder ``pid`` belongs to: its marker variable or, for a Ray
    process that lost it, a file it holds open (its logs) or its working folder in one."""
    marked = env.get(RAY_SESSION_ENV)
    if marked:
        return Path(marked)
    name = _name(pid)
    if not (name.startswith("ray::") or "/ray/" in name):
        return None
    proc = Path(f"/proc/{pid}")
    try:
        links = [os.readlink(proc / "cwd")]
        links += [os.readlink(fd) for fd in (proc / "fd").iterdir()]
    except OSError:
        return None
    for link in links:
        parts = Path(link).parts
        for i, part in enumerate(parts):
            if part.startswith(RAY_TMP_PREFIX):
                return Path(*parts[: i + 1])
    return None


def _ray_owner(session: Path) -> tuple[int, int] | None:
    try:
        pid, ns = (session / OWNER_FILE).read_text().split()
        return int(pid), int(ns)
    except (OSError, ValueError):
        return None


def _deploy_owner(marker: str) -> tuple[int, int] | None:
    """``<work>:<pid>:<time_ns>`` (deploy local's marker) -> (pid, time_ns)."""
    try:
        _, pid, ns = marker.rsplit(":", 2)
        return int(pid), int(ns)
    except ValueError:
        return None


class Orphan(NamedTuple):
    """A process left by a fedasync run whose driver is gone."""

    what: str
    """Its name and whose it is, for the log."""
    ray_session: Path | None
    """The private Ray temp folder it belongs to (None: a deployment's process)."""


def find_orphans() -> dict[int, Orphan]:
    """Processes left by earlier fedasync runs whose driver is gone, by pid.

    A process is provably ours when it belongs to a private Ray whose temp folder (named
    ``fa-ray-*``) holds an owner file naming a driver that no longer runs, or carries a
    ``deploy local`` marker naming such a driver. A Ray started by anyone else (``ray start``, a
    cluster we attached to) has neither, and a run still going has a live owner: both are left
    alone. Only this user's processes are looked at. Linux only (/proc).
    """
    found: dict[int, Orphan] = {}
    if not Path("/proc").is_dir():
        return found
    me, uid = os.getpid(), os.getuid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            if entry.stat().st_uid != uid or not alive(pid):
                continue
        except OSError:
            continue
        env = _environ(pid)
        session = _ray_session_of(pid, env)
        if session is not None and session.name.startswith(RAY_TMP_PREFIX):
            owner = _ray_owner(session)
            if owner is not None and not owner_alive(*owner):
                found[pid] = Orphan(f"{_name(pid)} of Ray session {session}", session)
            continue
        marker = env.get(MARKER_ENV, "")
        owner = _deploy_owner(marker)
        if owner is not None and not owner_alive(*owner):
            found[pid] = Orphan(f"{_name(pid)} of deployment {marker.rsplit(':', 2)[0]}", None)
    return found


def sweep_orphans(grace_s: float = 2.0) -> dict[int, Orphan]:
    """Stop what ``find_orphans`` finds (SIGTERM, then SIGKILL after ``grace_s``: Ray's agents
    ignore SIGTERM), remove their Ray temp folders, and log one line; return what was stopped."""
    found = find_orphans()
    if not found:
        return found
    for pid in found:
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in found):
        time.sleep(0.1)
    for pid in found:
        if alive(pid):
            _kill(pid, signal.SIGKILL)
    for session in {o.ray_session for o in found.values() if o.ray_session is not None}:
        shutil.rmtree(session, ignore_errors=True)
    log.warning(
        "stopped %d process(es) left by earlier runs whose driver is gone: %s",
        len(found),
        "; ".join(f"{pid} {o.what}" for pid, o in sorted(found.items())),
    )
    return found


def session_pids(session: str) -> list[int]:
    """Live processes of the private Ray whose temp folder is ``session``: those that carry its
    marker variable and Ray's agents that lost it but hold its files (the DashboardAgent and
    RuntimeEnvAgent that a raylet stopped mid-start leaves behind: seen after a Ctrl-C while
    Ray was starting)."""
    found = set(pids_with_env(RAY_SESSION_ENV, session))
    me, uid, want = os.getpid(), os.getuid(), Path(session)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in found or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            if entry.stat().st_uid != uid:
                continue
        except OSError:
            continue
        if _ray_session_of(pid, _environ(pid)) == want and alive(pid):
            found.add(pid)
    return sorted(found)


def stop_session_processes(
    session: str, grace_s: float = 10.0, level: int = logging.WARNING
) -> None:
    """Stop, by pid, every process of this run's Ray session.

    Every process of a private Ray (GCS, raylet, and the workers, which Ray re-parents to
    init) inherits ``FEDASYNC_RAY_SESSION=<session>`` from this process; Ray's agents that lost
    it are found by the files they hold (``session_pids``). An attached cluster's
    processes were started by ``ray start``, not by us, and never carry it: they are left alone.
    ``ray.shutdown()`` asks a private Ray's processes to exit but does not wait for the
    workers; a leftover one could outlive the command and hang CI. Wait ``grace_s``, then
    SIGTERM, then SIGKILL what is left, logged at ``level`` (INFO after a Ctrl-C, when
    leftovers are expected). Linux only (/proc).
    """
    if not Path("/proc").is_dir():
        return
    deadline = time.monotonic() + grace_s
    signals = [signal.SIGTERM, signal.SIGKILL, signal.SIGKILL]
    quiet = 0
    while quiet < 2:  # two scans in a row with nothing left: a worker spawned late is caught
        left = session_pids(session)
        if not left:
            quiet += 1
            time.sleep(0.3)
            continue
        quiet = 0
        if time.monotonic() < deadline:
            time.sleep(0.2)
            continue
        if not signals:
            log.error("Ray processes %s survived SIGKILL", left)
            return
        sig = signals.pop(0)
        log.log(
            level, "stopping %d leftover Ray process(es) with %s: %s", len(left), sig.name, left
        )
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(1.0)
