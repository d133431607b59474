"""Every way a `fedasync simulate` run ends leaves nothing behind and says what happened.

Finished, Ctrl-C (SIGINT to the whole process group, as a terminal sends it), SIGTERM, an
exception inside the run, and the driver killed (kill -9, whose leftovers the next run stops).
The slow tests start the real command with a private Ray (a few silos, a tiny model) and keep
Ray's and Flower's folders in tmp_path; every process carries a marker variable of the test, by
which the test finds (and in the end kills) whatever is left. The fast tests check which
processes the orphan sweep takes for ours.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from commands import MARKER, Command

from fedasync import processes
from fedasync.processes import (
    MARKER_ENV,
    OWNER_FILE,
    RAY_SESSION_ENV,
    RAY_TMP_PREFIX,
    alive,
    find_orphans,
    sweep_orphans,
)

REPO = Path(__file__).resolve().parents[1]
BASE = [
    "run.name=r",
    "lab.compare_sync=false",
    "run.progress=false",
    "silos.count=2",
    "lab.speed.profile=uniform",
    "client.local_steps=2",
    "client.batch_size=16",
    "data.max_samples=300",
    "server.eval_every=2",
    "server.checkpoint_every=0",
    "server.evaluate_silos=false",
    "engine.num_cpus=2",
]
# a bug inside the run: the server's fold raises once three versions are made
FAIL_AT_V3 = """
import sys
import server.loop as loop
new_version = loop.AsyncServer._new_version
def failing(self, params):
    if self.version >= 3:
        raise RuntimeError("injected failure")
    new_version(self, params)
loop.AsyncServer._new_version = failing
from simulations.cli import main
sys.exit(main(sys.argv[1:]))
"""

# a failure in Flower's simulation runtime (it logs a traceback and wraps it in its own errors)
FAIL_IN_RUNTIME = """
import sys
from flwr.server.superlink.fleet.vce.backend import raybackend
def failing(self, app_fn):
    raise RuntimeError("injected failure")
raybackend.RayBackend.build = failing
from simulations.cli import main
sys.exit(main(sys.argv[1:]))
"""


class Run(Command):
    """One ``fedasync simulate`` (or ``python -c code``) in a session of its own; its output
    in files under ``tmp``, its run folder ``tmp/r``."""

    def __init__(
        self, tmp: Path, *overrides: str, code: str | None = None, argv: list[str] | None = None
    ):
        args = argv or ["simulate", f"run.out_dir={tmp}", *BASE, *overrides]
        super().__init__(tmp, args, argv=[sys.executable, "-c", code, *args] if code else None)
        self.run_dir = tmp / "r"

    def wait_training(self, timeout_s: float = 300.0) -> None:
        """Until the first update is folded (or fail with the run's stderr)."""
        metrics = self.run_dir / "metrics.jsonl"
        self.wait_for(
            lambda: metrics.exists() and '"event": "update"' in metrics.read_text(),
            "the first update",
            timeout_s,
        )

    def wait(self, timeout_s: float = 120.0) -> int:
        """Its exit code (the timeout only guards against a hang). A hang fails with every
        thread's Python stack, the end of stderr and the run log's end."""
        try:
            return super().wait(timeout_s)
        except TimeoutError as e:
            log = self.run_dir / "run.log"
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no run.log)"
            pytest.fail(f"{e}\nrun.log:\n{tail}")


def _one_line(stderr: str, start: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith(start)]
    assert len(lines) == 1, f"one line starting {start!r} on stderr:\n{stderr}"
    return lines[0]


def _no_traceback(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert "*** SIG" not in stderr and "Fatal Python error" not in stderr, stderr


def _last_version(run_dir: Path) -> int:
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return max(e["version"] for e in events if "version" in e)


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_run_with_a_checkpoint_and_one_line(tmp_path, sig, code):
    # Prepare: the erasure service on (its threads kept the process alive before)
    run = Run(tmp_path, "run.budget_s=100000", "unlearning.service=true",
              "unlearning.address=127.0.0.1:0")  # fmt: skip
    try:
        run.wait_training()
        # Execute: Ctrl-C reaches the whole foreground group; SIGTERM (kill) only the driver
        if sig == signal.SIGINT:
            os.killpg(run.popen.pid, sig)
        else:
            run.popen.send_signal(sig)
        rc = run.wait()
        # Assert
        err = run.stderr()
        assert rc == code, err
        _no_traceback(err)
        line = _one_line(err, f"fedasync: stopped by {sig.name}")
        ckpt = run.run_dir / "checkpoint.pt"
        assert ckpt.exists(), "the stop writes a checkpoint"
        assert f"at version {_last_version(run.run_dir)} " in line
        assert str(ckpt) in line and "run.resume=true" in line
        assert not run.gone(), "no process of the run is left"
        assert run.seen, "the run's processes were seen while it ran"
        if sig == signal.SIGINT:  # the command the line gives goes on from where it stopped
            _check_resume(tmp_path, line)
        port = (run.run_dir / "erasure_address").read_text().strip()
        import socket

        host, p = port.rsplit(":", 1)
        with pytest.raises(OSError), socket.create_connection((host, int(p)), timeout=2):
            pass
    finally:
        run.kill()


def _check_resume(tmp: Path, line: str) -> None:
    stopped_at = _last_version(tmp / "r")
    events = [json.loads(x) for x in (tmp / "r" / "metrics.jsonl").read_text().splitlines()]
    budget = max(e["t"] for e in events if "t" in e) + 15.0
    argv = line.split("resume with: fedasync ", 1)[1].split()
    resumed = Run(tmp / "resumed", argv=[*argv, f"run.budget_s={budget}"])
    resumed.run_dir = tmp / "r"
    try:
        assert resumed.wait(timeout_s=300) == 0, resumed.stderr()
        events = [json.loads(x) for x in (tmp / "r" / "metrics.jsonl").read_text().splitlines()]
        (resume,) = [e for e in events if e["event"] == "resume"]
        assert resume["version"] == stopped_at
        assert _last_version(tmp / "r") > stopped_at
        assert not resumed.gone()
    finally:
        resumed.kill()


@pytest.mark.slow
@pytest.mark.parametrize("code", [FAIL_AT_V3, FAIL_IN_RUNTIME], ids=["server", "runtime"])
def test_an_exception_in_the_run_is_one_line_and_the_traceback_is_in_the_log(tmp_path, code):
    run = Run(tmp_path, "run.budget_s=100000", code=code)
    try:
        rc = run.wait(timeout_s=300)
        err = run.stderr()
        assert rc == 1, err
        _no_traceback(err)
        line = _one_line(err, "fedasync: the run failed")
        assert "RuntimeError: injected failure" in line
        assert str(run.run_dir / "run.log") in line
        log = (run.run_dir / "run.log").read_text()
        assert "Traceback" in log and "injected failure" in log
        assert not run.gone(), "no process of the run is left"
    finally:
        run.kill()


@pytest.mark.slow
@pytest.mark.serial  # another test's run would sweep these orphans first
def test_a_killed_driver_leaves_orphans_that_the_next_run_stops(tmp_path):
    # Prepare: a run whose driver is killed
    killed = Run(tmp_path / "killed", "run.budget_s=100000")
    nxt = planted = None
    try:
        killed.wait_training()
        killed.popen.send_signal(signal.SIGKILL)
        killed.wait()
        time.sleep(5.0)  # what dies with the driver has died by now
        # Which of Ray's processes outlive a kill -9 is a race (they share the driver's fate
        # through their parents, and under load all of them may be gone by now; a flake hunt
        # round saw none). So the test plants one that always does: a process of the killed
        # run's Ray session, as Ray's agents are, with the test's marker (so `left` sees it).
        (session,) = killed.temp.glob(f"{RAY_TMP_PREFIX}*")
        planted = subprocess.Popen(
            ["sleep", "300"],
            env={**os.environ, RAY_SESSION_ENV: str(session), MARKER: killed.marker},
            start_new_session=True,
        )
        deadline = time.monotonic() + 30.0  # until it has exec'd with its environment
        while planted.pid not in (orphans := killed.left()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert planted.pid in orphans, "precondition: the killed run has an orphan"
        # Execute: the next run (which ends normally)
        nxt = Run(tmp_path / "next", "run.budget_s=20")
        rc = nxt.wait(timeout_s=300)
        # Assert
        err = nxt.stderr()
        assert rc == 0, err
        _no_traceback(err)
        line = _one_line(err, "WARNING fedasync: stopped")
        assert all(str(p) in line for p in orphans), line
        assert not [p for p in orphans if alive(p)], "the orphans are stopped"
        assert not killed.gone() and not nxt.gone(), "nothing of either run is left"
        assert "outputs:" in nxt.out.read_text(), "a finished run says where its outputs are"
        assert (nxt.run_dir / "summary.json").exists()
        assert planted.wait(timeout=5) is not None
    finally:
        if planted is not None:
            planted.kill()
            planted.wait()
        killed.kill()
        if nxt is not None:
            nxt.kill()


# ---------------------------------------------------------------- which processes are ours


def _sleeper(tmp: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["sleep", "300"], env={**os.environ, **env}, cwd=tmp, start_new_session=True
    )


def _session(tmp: Path, name: str, owner: str | None) -> Path:
    session = tmp / name
    session.mkdir()
    if owner is not None:
        (session / OWNER_FILE).write_text(owner + "\n")
    return session


@pytest.mark.serial  # another test's run would sweep the fake orphan first
def test_the_sweep_stops_only_processes_whose_fedasync_driver_is_gone(tmp_path):
    # Prepare: a driver that is gone (a child that exited), and this live one
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone_owner = f"{dead.pid} {time.time_ns()}"
    live_owner = f"{os.getpid()} {time.time_ns()}"
    orphan_dir = _session(tmp_path, "fa-ray-orphan", gone_owner)
    procs = {
        "orphan": _sleeper(tmp_path, **{RAY_SESSION_ENV: str(orphan_dir)}),
        "live run": _sleeper(
            tmp_path, **{RAY_SESSION_ENV: str(_session(tmp_path, "fa-ray-live", live_owner))}
        ),
        "no owner file": _sleeper(
            tmp_path, **{RAY_SESSION_ENV: str(_session(tmp_path, "fa-ray-old", None))}
        ),
        "not a fedasync folder": _sleeper(
            tmp_path, **{RAY_SESSION_ENV: str(_session(tmp_path, "ray-user", gone_owner))}
        ),
        "deploy orphan": _sleeper(tmp_path, **{MARKER_ENV: f"/w/deploy:{dead.pid}:1"}),
        "live deploy": _sleeper(
            tmp_path, **{MARKER_ENV: f"/w/deploy:{os.getpid()}:{time.time_ns()}"}
        ),
        "test marker": _sleeper(tmp_path, **{MARKER_ENV: f"test-{tmp_path}"}),
        "unmarked": _sleeper(tmp_path),
    }
    try:
        time.sleep(0.2)
        # Execute
        found = sweep_orphans(grace_s=1.0)
        # Assert
        ours = {procs["orphan"].pid, procs["deploy orphan"].pid}
        assert ours <= set(found)  # (a real orphan on this machine would be stopped too)
        for name, p in procs.items():
            if p.pid in ours:
                assert p.wait(timeout=5) is not None, name
            else:
                assert p.pid not in found and p.poll() is None, name
        assert not orphan_dir.exists(), "an orphaned Ray folder is removed"
        assert (tmp_path / "fa-ray-live").exists()
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_a_recycled_pid_is_not_a_live_owner():
    # this process started before now: it owns what it wrote now, not what was written before
    assert processes.owner_alive(os.getpid(), time.time_ns())
    assert not processes.owner_alive(os.getpid(), 10**9)  # 1970: a process that was long gone


@pytest.mark.serial  # another test's run would sweep the fake orphan first
def test_a_ray_process_that_lost_its_marker_is_found_by_the_files_it_holds(tmp_path):
    # Prepare: a process titled like Ray's agents, without the variable, holding a session log
    dead = subprocess.Popen(["true"])
    dead.wait()
    session = _session(tmp_path, "fa-ray-x", f"{dead.pid} {time.time_ns()}")
    log = session / "session_1" / "logs" / "raylet.out"
    log.parent.mkdir(parents=True)
    log.write_text("")
    env = {k: v for k, v in os.environ.items() if k != RAY_SESSION_ENV}
    script = f"f = open({str(log)!r}); import time; time.sleep(300)"
    cmd = ["bash", "-c", 'exec -a ray::DashboardAgent "$0" -c "$1"', sys.executable, script]
    p = subprocess.Popen(cmd, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 20
        while p.pid not in find_orphans():
            assert time.monotonic() < deadline, "not found"
            time.sleep(0.1)
        orphan = find_orphans()[p.pid]
        assert "ray::DashboardAgent" in orphan.what and orphan.ray_session == session
    finally:
        p.kill()
        p.wait()


# ---------------------------------------------------------------- the line, without an engine


def _fake_simulate(exc: BaseException):
    def simulate(cfg, *, verbose=False):
        raise exc

    return simulate


def test_a_server_app_that_does_not_stop_in_time_does_not_hold_the_exit(
    small_cfg, monkeypatch, capsys
):
    # Prepare: Ctrl-C arrived while the ServerApp was busy outside a poll for too long
    from simulations import launcher

    cfg = small_cfg()
    stopped = launcher.Interrupted(signal.SIGTERM)
    stopped.server_left_running = True
    monkeypatch.setattr(launcher, "simulate", _fake_simulate(stopped))
    exits: list[int] = []
    monkeypatch.setattr(launcher.os, "_exit", exits.append)
    # Execute
    code = launcher.run(cfg)
    # Assert: the line first, then an exit that does not join Flower's thread
    assert exits == [143] and code == 143
    err = capsys.readouterr().err
    assert _one_line(err, "fedasync: stopped by SIGTERM before training")
    assert "no checkpoint yet" in err


def test_a_failure_is_one_line_naming_the_cause_under_flowers_wrapping(
    small_cfg, monkeypatch, capsys
):
    from simulations import launcher

    cfg = small_cfg()
    try:
        try:
            raise ValueError("the cause")
        except ValueError as cause:
            raise RuntimeError("An error was encountered. Ending simulation.") from cause
    except RuntimeError as wrapped:
        monkeypatch.setattr(launcher, "simulate", _fake_simulate(wrapped))
    launcher.setup_logging(Path(cfg.run.out_dir) / cfg.run.name)
    try:
        assert launcher.run(cfg) == 1
    finally:
        for h in list(logging.getLogger("fedasync").handlers):
            logging.getLogger("fedasync").removeHandler(h)
            h.close()
    err = capsys.readouterr().err
    assert "ValueError: the cause" in _one_line(err, "fedasync: the run failed before training")
    _no_traceback(err)
    assert "Traceback" in (Path(cfg.run.out_dir) / cfg.run.name / "run.log").read_text()


def test_the_engines_ray_backend_stops_only_after_its_message_workers(monkeypatch):
    """A signal can leave Flower's message workers in a Ray call while the engine terminates
    its Ray backend (ray.shutdown: Ray then ends the process with exit code 1)."""
    import threading

    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.server.superlink.fleet.vce.backend import raybackend

    from simulations.launcher import _EngineWorkers

    left = threading.Event()
    seen: list[bool] = []
    monkeypatch.setattr(vce_api, "worker", lambda: (time.sleep(0.5), left.set()))
    monkeypatch.setattr(raybackend.RayBackend, "terminate", lambda self: seen.append(left.is_set()))
    with _EngineWorkers(wait_s=20.0):
        t = threading.Thread(target=vce_api.worker)
        t.start()
        time.sleep(0.1)  # the worker is in its call
        raybackend.RayBackend.terminate(None)  # type: ignore[arg-type]
    t.join()
    assert seen == [True]  # terminated after the worker left, not 20 s later either
    assert vce_api.worker is not None and raybackend.RayBackend.terminate.__name__ == "<lambda>"
