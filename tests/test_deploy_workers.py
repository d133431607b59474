"""Warm ClientApp workers and the SuperNode's capped sleeps (issue 16's fast path).

The fast tests hold the Flower internals they rely on (fail loudly when an upgrade moved
them), the sleep caps and the supervisor's restarts; the slow one runs a real deployment
(SuperLink, SuperNodes over TLS, one warm worker each) and checks that one process served
many messages with the FAB's code, and that a killed worker is started again.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import simulations.deploy as deploy
import simulations.flower_commands as flower_commands
import simulations.node as node
import simulations.supernode as supernode
import simulations.worker as worker
from fedasync.events import read_events
from fedasync.processes import MARKER_ENV, Processes, alive
from protocol.transport import FlowerInternalsMoved, cap_sleep, short_backoff

SCI = "flwr.supernode.start_client_internal"


def test_every_flower_internal_the_worker_uses_is_where_flwr_142_has_it():
    # Execute
    found = worker.check_flower_internals()
    # Assert: the runtime API calls, Flower's own task steps and the loader are all there
    for name in ("pull_task_input", "push_message", "push_task_output", "AcquireTaskRequest"):
        assert callable(found[name])
    assert str(found["TaskType"].CLIENT_APP) == worker.CLIENT_APP_TASK
    supernode.check_sleeps(importlib.import_module(SCI))  # raises if the sleeps moved


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("flwr.superlink.grid.http_grid", "pull_objects"),  # the ServerApp's reply pulls
        (SCI, "pull_objects"),  # the SuperNode's message pulls
        ("flwr.supernode.runtime.run_clientapp", "pull_and_inflate_object_from_tree"),
    ],
)
def test_object_pulls_retry_after_10_ms_where_flower_waits_a_second(monkeypatch, module, name):
    # Prepare: the module restored after the test
    mod = importlib.import_module(module)
    monkeypatch.setattr(mod, name, getattr(mod, name))
    flower_default = inspect.signature(getattr(mod, name)).parameters["initial_backoff"].default
    # Execute (twice: idempotent)
    short_backoff(mod, name)
    short_backoff(mod, name)
    # Assert
    patched = getattr(mod, name)
    assert flower_default == 1 and patched.keywords == {"initial_backoff": 0.01, "backoff_cap": 0.2}
    assert not isinstance(patched.func, functools.partial)


def test_the_fedavg_baselines_3_s_reply_poll_is_capped_at_the_servers_poll(monkeypatch):
    # Prepare: Flower's send_and_receive module, restored after the test; sleeps recorded
    http_grid = importlib.import_module("flwr.superlink.grid.http_grid")
    assert "time.sleep(3)" in inspect.getsource(http_grid.HttpGrid.send_and_receive)
    monkeypatch.setattr(http_grid, "time", time)
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    # Execute
    cap_sleep(http_grid, 0.05)
    cap_sleep(http_grid, 0.05)  # idempotent
    http_grid.time.sleep(3)
    # Assert
    assert slept == [0.05] and http_grid.time.time is time.time


def test_a_moved_internal_fails_at_start_naming_what_is_missing(monkeypatch):
    # Prepare: an upgrade that renamed one of Flower's task steps
    run_clientapp = importlib.import_module("flwr.supernode.runtime.run_clientapp")
    monkeypatch.delattr(run_clientapp, "push_message")
    # Execute / Assert
    with pytest.raises(FlowerInternalsMoved, match=r"run_clientapp\.push_message"):
        worker.check_flower_internals()


def test_sleeps_that_moved_refuse_to_start(tmp_path):
    # Prepare: a SuperNode module whose loop no longer sleeps 3 s
    path = tmp_path / "fake_supernode.py"
    path.write_text("import time\n\n\ndef loop():\n    time.sleep(2)\n    time.sleep(0.5)\n")
    spec = importlib.util.spec_from_file_location("fake_supernode", path)
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    # Execute / Assert
    with pytest.raises(FlowerInternalsMoved, match=r"time\.sleep\(3\)"):
        supernode.check_sleeps(fake)


def test_idle_sleeps_start_short_and_double_while_idle_other_waits_are_capped(monkeypatch):
    # Prepare: the module restored after the test; every real sleep recorded, not slept
    sci = importlib.import_module(SCI)
    monkeypatch.setattr(sci, "time", time)
    monkeypatch.setattr(sci, "pull_objects", sci.pull_objects)
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    # Execute: five idle pulls in a row, a message handled (a 0.5 s wait), idle again
    supernode.cap_sleeps(idle_s=0.05, push_s=0.02, idle_max_s=0.5)
    for _ in range(5):
        sci.time.sleep(3)
    sci.time.sleep(0.5)
    sci.time.sleep(3)
    sci.time.sleep(0.01)
    # Assert: 0.05 doubling to the 0.5 cap; the streak ends with the message
    assert slept == [0.05, 0.1, 0.2, 0.4, 0.5, 0.02, 0.05, 0.01]
    assert sci.time.monotonic is time.monotonic
    assert sci.time is not time and time.sleep == slept.append  # only that module's copy
    supernode.cap_sleeps(idle_s=0.01, push_s=0.01, idle_max_s=0.01)  # adjusts, not wraps
    sci.time.sleep(3)
    assert slept[-1] == 0.01


def test_a_run_that_stops_mid_fetch_fails_the_fetch_so_flower_drops_message_and_task(monkeypatch):
    # Prepare: the SuperNode's module restored after the test; its fetch of a message's objects
    # raising what Flower's fleet connection raises once the run is no longer running
    from flwr.supercore.run import RunNotRunningException

    sci = importlib.import_module(SCI)
    monkeypatch.setattr(sci, "time", time)
    calls: list[tuple] = []

    def fetch(ids, pull_object_fn, initial_backoff=1.0, backoff_cap=10.0):
        calls.append((ids, {"initial_backoff": initial_backoff, "backoff_cap": backoff_cap}))
        if ids == ["gone"]:
            raise RunNotRunningException()
        return {i: b"x" for i in ids}

    monkeypatch.setattr(sci, "pull_objects", fetch)
    # Execute (twice: idempotent, one wrapper)
    supernode.cap_sleeps()
    wrapped = sci.pull_objects
    supernode.cap_sleeps()
    # Assert: still the short backoff; a stopped run is an ordinary error (Flower's
    # `except Exception` path deletes the message and its objects and finishes the task),
    # which RunNotRunningException, a BaseException caught apart, was not
    assert sci.pull_objects is wrapped
    assert wrapped(["a"], pull_object_fn=None) == {"a": b"x"}
    assert calls[-1][1] == {"initial_backoff": 0.01, "backoff_cap": 0.2}
    with pytest.raises(supernode.RunStopped, match="run stopped") as e:
        wrapped(["gone"], pull_object_fn=None)
    assert isinstance(e.value, Exception)
    assert isinstance(e.value.__cause__, RunNotRunningException)


def test_a_moved_stopped_run_path_refuses_to_start(tmp_path):
    # Prepare: a SuperNode module whose fetch no longer finishes the task on failure
    path = tmp_path / "fake_sci.py"
    path.write_text(
        "def pull_objects(ids, pull_object_fn):\n    return {}\n\n\n"
        "def _pull_and_store_message():\n    try:\n        pull_objects([], None)\n"
        "    except Exception:\n        pass\n"
    )
    spec = importlib.util.spec_from_file_location("fake_sci", path)
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    # Execute / Assert
    with pytest.raises(FlowerInternalsMoved, match=r"state\.finish_task"):
        supernode.fail_stopped_runs(fake)


@pytest.mark.parametrize(
    "bad",
    [
        ["--idle-s"],
        ["--idle-s", "x"],
        ["--push-s", "0"],
        ["--heartbeat-s", "5"],
        ["--push-s", "30"],
    ],
)
def test_launcher_rejects_bad_caps(bad):
    with pytest.raises(SystemExit):
        supernode.split_args(bad)


def test_launcher_passes_everything_else_to_flower():
    opts, rest = supernode.split_args(["--superlink", "h:1", "--idle-s", "0.2", "--x"])
    assert opts == {
        "--idle-s": 0.2,
        "--idle-max-s": 0.5,
        "--push-s": 0.02,
        "--retry-max-s": 2.0,
        "--heartbeat-s": 30.0,
    }
    assert rest == ["--superlink", "h:1", "--x"]


def test_supernode_command_isolates_only_for_warm_workers(tmp_path):
    from simulations.certs import CertPaths

    paths = CertPaths(tmp_path, 1)
    warm = deploy.supernode_command(1, 2, paths, 0, 1, workers="warm")
    cold = deploy.supernode_command(1, 2, paths, 0, 1, workers="flower")
    assert warm[1:3] == ["-m", "simulations.supernode"] and cold[1:3] == warm[1:3]
    assert warm[-2:] == ["--isolation", "process"] and "--isolation" not in cold
    with pytest.raises(deploy.DeployError, match="workers must be one of"):
        deploy.supernode_command(1, 2, paths, 0, 1, workers="x" * 10_000)


def _supervisor(tmp_path, monkeypatch, script: str, **kw):
    """A supervisor of two stand-in workers (``script``): the supervisor is what is tested."""
    monkeypatch.setattr(node, "worker_command", lambda port: [sys.executable, "-c", script])
    procs = Processes(marker=f"{tmp_path}:test")
    lines: list[str] = []
    homes = {0: tmp_path / "silo-0", 1: tmp_path / "silo-1"}
    sup = node.WorkerSupervisor(procs, homes, {0: 1, 1: 2}, lines.append, **kw)
    return procs, sup, lines


def test_supervisor_starts_an_exited_worker_again(tmp_path, monkeypatch):
    # Prepare: two workers; silo 1's is killed, silo 0's runs on
    script = "import time\ntime.sleep(60)\n"
    procs, sup, lines = _supervisor(tmp_path, monkeypatch, script)
    try:
        sup.start()
        sup.workers[1].popen.kill()
        sup.workers[1].popen.wait()
        first = sup.workers[1].popen.pid
        # Execute
        restarted = sup.check()
        # Assert
        assert restarted == 1 and sup.workers[1].popen.pid != first
        assert sup.workers[1].popen.poll() is None and sup.workers[0].popen.poll() is None
        assert any("silo 1's worker exited" in x for x in lines)
        assert sup.check() == 0 and sup.restarts == 1
    finally:
        assert procs.stop(grace_s=2.0) == []


def test_supervisor_gives_up_on_a_worker_that_cannot_start(tmp_path, monkeypatch):
    # Prepare: a worker that exits at once, every time
    procs, sup, _ = _supervisor(tmp_path, monkeypatch, "raise SystemExit(3)", max_restarts=2)
    try:
        sup.start()
        with pytest.raises(node.NodeError, match=r"worker exited 3 times"):
            for _ in range(50):
                for p in sup.workers.values():
                    p.popen.wait()
                sup.check()
    finally:
        assert procs.stop(grace_s=2.0) == []


def _worker_pid(run_dir: Path, silo: int) -> int | None:
    """The pid of ``silo``'s warm worker in the deployment of ``run_dir``."""
    home = str(run_dir / "deploy" / f"silo-{silo}")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(entry / "cwd")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        marked = any(v.startswith(f"{MARKER_ENV}={run_dir}".encode()) for v in env)
        if marked and b"simulations.worker" in cmd and cwd == home:
            return int(entry.name)
    return None


@pytest.mark.slow
def test_warm_workers_serve_many_messages_and_a_killed_one_is_started_again(small_cfg, tmp_path):
    # Prepare: 2 silos until 8 versions; silo 0's worker is killed once training runs
    cfg = small_cfg(
        "silos.count=2", "run.budget_s=240", "run.max_versions=8", "data.max_samples=300"
    )
    run_dir = tmp_path / "t"
    result: dict = {}

    def run() -> None:
        try:
            result["summary"] = deploy.deploy_local(cfg, echo=lambda line: None)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    # Execute
    thread.start()
    killed = None
    deadline = time.monotonic() + 200
    while killed is None and time.monotonic() < deadline and thread.is_alive():
        events = (
            read_events(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
        )
        if any(e["event"] == "update" and e.get("silo") == 0 for e in events):
            killed = _worker_pid(run_dir, 0)
            if killed is not None:
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.2)
    thread.join(timeout=300)
    # Assert: the run finished with both silos' updates and nothing left running
    assert "error" not in result, result.get("error")
    summary = result["summary"]
    d = summary["deployment"]
    assert killed is not None and not alive(killed)
    assert summary["versions"] == 8
    # the only reply refused is the killed worker's, when the kill cut its upload short (the
    # SuperLink then has no complete reply: a client error); silo 1 loses nothing
    refused = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "reject"]
    assert summary["updates_rejected_total"] == len(refused) <= 1
    assert all(e["silo"] == 0 and e["reason"] == "client_error" for e in refused), refused
    assert d["workers"] == "warm" and d["worker_restarts"] >= 1
    assert d["left_running"] == [] and [p for p in d["pids"] if alive(p)] == []
    assert d["cpu_s"]["superlink"] > 0 and d["cpu_s"]["supernodes"] > 0
    # ...silo 1's worker served every one of its messages in one process, with the FAB's code
    log = (run_dir / "deploy" / "silo-1" / "worker-1.log").read_text()
    served = [int(x.split("(")[1].split()[0]) for x in log.splitlines() if " in this worker)" in x]
    assert len(served) >= 3 and served == list(range(1, len(served) + 1))
    loaded = [x for x in log.splitlines() if "loaded FAB" in x]
    assert len(loaded) == 1, "the app is loaded once per worker"
    apps = str(run_dir / "deploy" / "silo-1" / "apps")
    assert f"from {apps}" in loaded[0] and "clients.app" in loaded[0]
    dropped = loaded[0].split("loaded from elsewhere: ")[1].split(", ")
    assert "protocol.transport" in dropped, "the worker's own import of an app package is dropped"
    # ...and no per-message ClientApp process was started (Flower's SuperExec is not running)
    node_log = (run_dir / "deploy" / "silo-1" / "silo-1.log").read_text()
    assert "flwr-clientapp" not in node_log


@pytest.mark.slow
def test_fedasync_node_runs_a_supernode_and_its_worker_and_stops_both(tmp_path):
    # Prepare: a SuperLink with the hospital's key registered
    from simulations.certs import write_certs

    paths = write_certs(tmp_path / "certs", 1)
    procs = Processes(marker=f"{tmp_path}:link")
    home = tmp_path / "hospital"
    out = tmp_path / "node.txt"
    proc = None
    try:
        _, port = deploy.start_superlink(procs, tmp_path, paths)
        deploy.write_cli_config(tmp_path / "cli", port, paths.ca_cert)
        keys = {"silo-0": paths.node_public_key(0)}
        (node_id,) = deploy.register_nodes(procs, tmp_path / "cli", keys).values()
        (runtime_port,) = flower_commands.free_ports(1)
        cmd = [sys.executable, "-m", "simulations.cli", "node"]
        cmd += ["--superlink", f"127.0.0.1:{port}", "--root-certificates", str(paths.ca_cert)]
        cmd += ["--auth-key", str(paths.node_key(0)), "--node-config", "partition-id=0"]
        cmd += ["--port", str(runtime_port), "--home", str(home)]
        # Execute: the hospital's one command, until its worker serves
        with open(out, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        worker_log = home / "worker-0.log"
        while not (worker_log.exists() and "serving" in worker_log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.3)
        node_log = (home / "supernode.log").read_text()
        while f"SuperNode ID: {node_id}" not in node_log:
            assert time.monotonic() < deadline, node_log
            time.sleep(0.3)
            node_log = (home / "supernode.log").read_text()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        lines = out.read_text().splitlines()
        started = [int(x.split("(pid ")[1].split(")")[0]) for x in lines if "(pid " in x]
        # Assert: connected with its registered key over TLS, and all of it stopped
        assert rc == 143, out.read_text()
        assert len(started) == 2 and not any(alive(p) for p in started)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        assert procs.stop(grace_s=10.0) == []


def test_a_task_whose_run_was_stopped_is_dropped_and_the_worker_goes_on(monkeypatch):
    """flwr stop: Flower's HTTP client, refused with 401 on the task's token, sends its own
    process SIGINT. The warm worker drops the task in hand (no reply, its end reported) and
    serves the next one, where Flower's one-task ClientApp process would exit; between tasks a
    SIGINT is Ctrl-C."""
    from simulations.worker import Worker

    worker = Worker("127.0.0.1:1")  # (nothing is dialled: the runtime calls are stand-ins)
    seen: dict[str, object] = {}

    class Client:
        def close(self) -> None:
            seen["closed"] = True

    class Heartbeat:
        is_running = False

        def __init__(self, fn) -> None:
            pass

        def start(self) -> None:
            pass

    def pull_task_input(client):
        os.kill(os.getpid(), signal.SIGINT)  # as Flower's retry does on a 401
        for _ in range(200):  # the signal lands at the next bytecode: in this loop
            time.sleep(0.05)
        seen["not interrupted"] = True
        raise AssertionError("the task was not dropped")

    monkeypatch.setattr(worker, "_client", lambda component, token=None: Client())
    worker.f = {
        **worker.f,
        "HeartbeatSender": Heartbeat,
        "make_task_heartbeat_fn_http": lambda client: None,
        "pull_task_input": pull_task_input,
        "push_message": lambda *a: seen.setdefault("replied", a),
        "push_task_output": lambda client, context, status, details: seen.setdefault(
            "status", status
        ),
    }
    previous = signal.signal(signal.SIGINT, worker.drop_task)
    try:
        worker.run_task("token", 7)
        assert "not interrupted" not in seen and "replied" not in seen
        assert seen["status"] == worker.f["SubStatus"].FAILED and seen["closed"]
        assert worker.tasks == 1 and not worker.in_task
        with pytest.raises(KeyboardInterrupt):  # between tasks: Ctrl-C, as ever
            worker.drop_task(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_heartbeat_a_supernode_announces_is_the_launchers(monkeypatch):
    """The SuperLink marks a dead node offline after two of the intervals its SuperNode
    announced; `set_heartbeat` sets both the interval announced and the one kept."""
    import flwr.supercore.heartbeat as heartbeat
    import flwr.supernode.fleet_http_connection as connection

    from simulations.supernode import HEARTBEAT_MODULES, set_heartbeat, split_args

    for module in (heartbeat, connection):
        monkeypatch.setattr(module, "HEARTBEAT_DEFAULT_INTERVAL", module.HEARTBEAT_DEFAULT_INTERVAL)
    opts, _ = split_args(["--heartbeat-s", "10"])
    set_heartbeat(opts["--heartbeat-s"])
    assert heartbeat.HEARTBEAT_DEFAULT_INTERVAL == connection.HEARTBEAT_DEFAULT_INTERVAL == 10.0
    assert {m.__name__ for m in (heartbeat, connection)} == set(HEARTBEAT_MODULES)
    monkeypatch.delattr(connection, "HEARTBEAT_DEFAULT_INTERVAL")
    with pytest.raises(FlowerInternalsMoved, match="HEARTBEAT_DEFAULT_INTERVAL"):
        set_heartbeat(10.0)


def test_a_supernode_that_lost_the_superlink_tries_again_at_most_2_s_apart(monkeypatch):
    """Flower's retries double up to 20 s: after a 60 s partition a hospital came back up to
    26 s after its link did. The launcher caps the wait between two tries."""
    import flwr.supercore.retry.http_retry as http_retry

    from simulations.supernode import cap_retry_delay, split_args

    monkeypatch.setattr(http_retry, "MAX_RETRY_DELAY", http_retry.MAX_RETRY_DELAY)
    opts, rest = split_args(["--superlink", "x:1"])
    assert opts["--retry-max-s"] == 2.0 and rest == ["--superlink", "x:1"]
    cap_retry_delay(opts["--retry-max-s"])
    waits = http_retry.make_simple_http_retry_invoker().wait_gen_factory()
    assert max(next(waits) for _ in range(12)) <= 2.0
    monkeypatch.delattr(http_retry, "MAX_RETRY_DELAY")
    with pytest.raises(FlowerInternalsMoved, match="MAX_RETRY_DELAY"):
        cap_retry_delay(2.0)
