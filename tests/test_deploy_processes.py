"""The pieces of `fedasync deploy local` that need no SuperLink: stopping process trees (also
detached and stubborn ones), the files Flower reads, the command lines it builds (privacy
ledgers), what it records, and what is measured from the events."""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import simulations.coordinator as coordinator
import simulations.deploy as deploy
from clients.privacy import ledger_path
from fedasync.processes import Proc, Processes, _kill, alive, find_orphans, sweep_orphans
from protocol.keys import PRIVACY_DB
from server.run_config import config_from_run_config, run_config_toml
from simulations.certs import CertPaths
from simulations.config import to_container
from simulations.deploy import SYNC_NOT_RUN, deploy_local, privacy_ledgers
from simulations.deploy_progress import EventTail, measurements, round_trips
from simulations.flower_commands import FEDERATION, DeployError, supernode_command, write_cli_config


def _wait_for(pred, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_stop_reaches_detached_descendants(tmp_path):
    # Prepare: a shell whose child moves to a session of its own (as Flower's SuperExec does)
    procs = Processes(marker=f"test-{tmp_path}")
    procs.start("tree", ["/bin/sh", "-c", "setsid sleep 300 & sleep 300"], tmp_path / "tree")
    _wait_for(lambda: len(procs.scan()) == 3)  # sh, sleep, detached sleep
    seen = set(procs.seen)
    # Execute
    left = procs.stop(grace_s=2.0)
    # Assert
    assert left == []
    assert not [p for p in seen if alive(p)]
    assert procs.scan() == []


def test_stop_kills_what_ignores_sigterm(tmp_path):
    procs = Processes(marker=f"test-{tmp_path}")
    procs.start("stubborn", ["/bin/sh", "-c", 'trap "" TERM; sleep 300'], tmp_path / "s")
    _wait_for(lambda: len(procs.scan()) == 2)
    t0 = time.monotonic()
    left = procs.stop(grace_s=0.5)
    assert left == [] and procs.scan() == []
    assert time.monotonic() - t0 < 10.0


def test_each_process_gets_its_own_home_temp_and_log(tmp_path):
    procs = Processes(marker="m")
    p = procs.start("env", ["/bin/sh", "-c", 'echo "$FLWR_HOME $TMPDIR"'], tmp_path / "h")
    p.popen.wait(10)
    procs.stop(grace_s=1.0)
    home, tmp = p.log.read_text().split()
    assert home == str(tmp_path / "h") and tmp == str(tmp_path / "h" / "tmp")


def test_run_config_file_carries_the_config_through_flowers_parser(small_cfg, tmp_path):
    from flwr.common.config import parse_config_args

    # Prepare
    cfg = small_cfg("silos.count=2", 'run.name=a "quoted" name')
    path = tmp_path / "run-config.toml"
    path.write_text(run_config_toml(cfg))
    # Execute
    parsed = parse_config_args([str(path)])
    back = config_from_run_config(parsed)
    # Assert
    assert to_container(back) == to_container(cfg)


def test_cli_config_is_a_tls_connection_for_flower(tmp_path, monkeypatch):
    from flwr.cli.flower_config import read_superlink_connection

    ca = tmp_path / "ca.pem"
    write_cli_config(tmp_path / "home", 43210, ca)
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    conn = read_superlink_connection(None)
    assert conn.name == FEDERATION
    assert conn.address == "127.0.0.1:43210"
    assert conn.root_certificates == str(ca.resolve())
    assert conn.insecure is False


def test_round_trips_are_times_between_a_silos_takes():
    # Prepare: training starts with the version-0 eval at t=10; silo 0 replies at 20 and 32,
    # silo 1 at 25 (rejected) and 41
    events = [
        {"event": "roster", "t": 9.0},
        {"event": "eval", "t": 10.0},
        {"event": "update", "t": 20.0, "silo": 0},
        {"event": "reject", "t": 25.0, "silo": 1},
        {"event": "update", "t": 32.0, "silo": 0},
        {"event": "update", "t": 41.0, "silo": 1},
        {"event": "end", "t": 42.0},
    ]
    # Execute
    trips = round_trips(events)
    m = measurements(events)
    # Assert
    assert trips == {0: [10.0, 12.0], 1: [15.0, 16.0]}
    assert m["round_trip_s"]["count"] == 4
    assert m["round_trip_s"]["mean"] == pytest.approx(53.0 / 4)
    assert m["round_trip_s"]["min"] == 10.0 and m["round_trip_s"]["max"] == 16.0
    assert m["roster_s"] == 9.0
    assert m["updates_per_wall_s"] == pytest.approx(3 / 32.0)


def test_round_trips_start_at_the_roster_when_the_silos_evaluate():
    # Prepare: a federated evaluation: no version-0 eval, the first eval after updates
    events = [
        {"event": "roster", "t": 9.0},
        {"event": "update", "t": 20.0, "silo": 0},
        {"event": "update", "t": 23.0, "silo": 1},
        {"event": "eval", "t": 30.0, "version": 2},
        {"event": "update", "t": 32.0, "silo": 0},
    ]
    # Execute
    trips = round_trips(events)
    # Assert: measured from the roster, none negative
    assert trips == {0: [11.0, 12.0], 1: [14.0]}


def test_event_tail_waits_for_whole_lines_and_follows_a_new_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = EventTail(path)
    assert tail.poll() == []
    path.write_text('{"event": "start", "t": 0}\n{"event": "ro')
    assert [e["event"] for e in tail.poll()] == ["start"]
    with open(path, "a") as f:
        f.write('ster", "t": 1}\n')
    assert [e["event"] for e in tail.poll()] == ["roster"]
    path.write_text('{"event": "start", "t": 0}\n')  # a new run's log
    assert [e["event"] for e in tail.poll()] == ["start"]


def _node_config(cmd: list[str]) -> dict:
    """A SuperNode command line's node config as the SuperNode itself parses it."""
    from flwr.common.config import parse_config_args

    return parse_config_args([cmd[cmd.index("--node-config") + 1]])


def test_supernode_node_config_names_the_silos_own_ledger(tmp_path):
    # Prepare: a ledger folder whose path Flower's parser must not split or unquote
    paths = CertPaths(tmp_path / "certs", 3)
    ledgers = privacy_ledgers(tmp_path / "ledgers 'of' the silos", 3)
    # Execute
    configs = {
        s: _node_config(supernode_command(8000, 9094, paths, s, 3, ledgers[s])) for s in range(3)
    }
    # Assert: each SuperNode has its own file, which is where its ClientApp keeps its ledger
    for s, node in configs.items():
        want = tmp_path / "ledgers 'of' the silos" / f"silo-{s}.sqlite"
        assert node == {"partition-id": s, "num-partitions": 3, PRIVACY_DB: str(want)}
        assert ledger_path(node, {"privacy-dir": "/elsewhere"}, s) == want
    folder = tmp_path / "ledgers 'of' the silos"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    # without a ledger the node config is what it was
    assert _node_config(supernode_command(8000, 9094, paths, 1, 3)) == {
        "partition-id": 1,
        "num-partitions": 3,
    }
    with pytest.raises(DeployError, match="double quote"):
        supernode_command(8000, 9094, paths, 0, 3, tmp_path / 'a"b.sqlite')


def test_ledger_folder_is_made_0700_and_an_existing_one_kept(tmp_path):
    made = tmp_path / "a" / "privacy"
    privacy_ledgers(made, 1)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    (made / "silo-0.sqlite").write_bytes(b"ledger")
    assert privacy_ledgers(made, 2) == {0: made / "silo-0.sqlite", 1: made / "silo-1.sqlite"}
    assert (made / "silo-0.sqlite").read_bytes() == b"ledger", "a silo's ledger is kept"


class _FakeProcesses(Processes):
    """Records what deploy_local starts; ``flwr run`` 'runs' by writing the summary."""

    started: list[tuple[str, list[str]]] = []
    run_dir: Path

    def start(self, name, cmd, home, *, pipe=False, env=None):
        type(self).started.append((name, list(cmd)))
        home.mkdir(parents=True, exist_ok=True)
        if name == "flwr-run":
            summary = {"mode": "fedasync", "versions": 0, "per_silo": {}}
            (self.run_dir / "summary.json").write_text(json.dumps(summary))
        popen = subprocess.Popen(["true"], stdout=subprocess.PIPE if pipe else None, text=True)
        popen.wait()
        return Proc(name, popen, home / f"{name}.log")

    def scan(self):
        return []

    def stop(self, grace_s=10.0):
        return []


@pytest.mark.parametrize(("privacy_dir", "compare_sync"), [(None, True), ("mine", False)])
def test_deploy_local_gives_supernodes_ledgers_and_says_sync_is_not_run(
    small_cfg, tmp_path, monkeypatch, privacy_dir, compare_sync
):
    # Prepare: every process is a stand-in (no SuperLink, no SuperNodes, no flwr run)
    cfg = small_cfg("silos.count=2", f"lab.compare_sync={str(compare_sync).lower()}")
    run_dir = tmp_path / "t"
    _FakeProcesses.started, _FakeProcesses.run_dir = [], run_dir
    monkeypatch.setattr(deploy, "Processes", _FakeProcesses)
    monkeypatch.setattr(
        deploy,
        "start_superlink",
        lambda procs, work, paths, where=None, **kw: (
            procs.start("superlink", ["true"], work / "superlink"),
            1,
        ),
    )
    monkeypatch.setattr(
        deploy,
        "register_nodes",
        lambda procs, home, keys, wrap=list: {k: 100 + i for i, k in enumerate(keys)},
    )
    monkeypatch.setattr(coordinator, "stage_app", lambda dest, serverapp=None: dest)
    folder = None if privacy_dir is None else tmp_path / privacy_dir
    lines: list[str] = []
    # Execute
    summary = deploy_local(cfg, privacy_dir=folder, echo=lines.append)
    # Assert: each SuperNode is given its silo's ledger, in a folder only its owner can enter
    want = run_dir / "privacy" if folder is None else folder
    supernodes = {name: cmd for name, cmd in _FakeProcesses.started if name.startswith("silo-")}
    for s in range(2):
        node = _node_config(supernodes[f"silo-{s}"])
        assert node[PRIVACY_DB] == str(want / f"silo-{s}.sqlite")
        assert node["partition-id"] == s
    assert stat.S_IMODE(want.stat().st_mode) == 0o700
    recorded = json.loads((run_dir / "deploy.json").read_text())
    assert recorded["privacy_db"] == {str(s): str(want / f"silo-{s}.sqlite") for s in range(2)}
    assert summary["deployment"]["privacy_db"] == recorded["privacy_db"]
    # ...and a sync comparison asked for is said not to run, once, not silently dropped
    warned = [x for x in lines if "compare_sync" in x]
    if compare_sync:
        assert len(warned) == 1 and "benchmarks/deployment_overhead.py" in warned[0]
        assert recorded["compare_sync"] == SYNC_NOT_RUN
    else:
        assert warned == [] and recorded["compare_sync"] is False


@pytest.mark.serial  # another test's command would sweep these orphans first
def test_what_a_killed_deploy_driver_started_is_swept_by_the_next_command(tmp_path):
    # Prepare: a driver that starts a tree (one part detached, as Flower's SuperExec) and is
    # then killed before it can stop it
    driver = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from fedasync.processes import Processes, owner_token\n"
        f"procs = Processes(marker=f'{tmp_path}/deploy:{{owner_token()}}')\n"
        "procs.start('tree', ['/bin/sh', '-c', 'setsid sleep 300 & sleep 300'], "
        f"Path({str(tmp_path)!r}) / 'tree')\n"
        "print('started', flush=True)\n"
        "time.sleep(300)\n"
    )
    d = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    left: list[int] = []
    try:
        assert d.stdout is not None and d.stdout.readline().strip() == "started"
        d.kill()
        d.wait()
        _wait_for(lambda: len(orphans_of(tmp_path)) == 3)  # sh, sleep, detached sleep
        left = orphans_of(tmp_path)
        # Execute
        swept = sweep_orphans(grace_s=1.0)
        # Assert
        assert set(left) <= set(swept)
        _wait_for(lambda: not [p for p in left if alive(p)])
    finally:
        d.kill()
        for pid in left:
            _kill(pid, signal.SIGKILL)


def orphans_of(tmp_path: Path) -> list[int]:
    return [p for p, o in find_orphans().items() if f"deployment {tmp_path}/deploy" in o.what]


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.mark.parametrize("code", [0, 1])
def test_a_run_that_ends_by_itself_is_not_a_coordinator_loss(code):
    link = _sleeper()
    try:
        run = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
        run.wait(timeout=30)
        assert coordinator.coordinator_lost(run, link, settle_s=0.5) is False
        assert link.poll() is None
    finally:
        link.kill()
        link.wait()


def test_flwr_run_killed_before_its_superlink_is_seen_dead_is_a_coordinator_loss():
    """A host losing power kills its processes one at a time: flwr run can be seen dead
    while the SuperLink is not yet (CI saw this judged as a finished run)."""
    link, run = _sleeper(), _sleeper()
    try:
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=10)
        later = subprocess.Popen(
            [sys.executable, "-c", f"import os,time; time.sleep(0.5); os.kill({link.pid}, 9)"]
        )
        assert coordinator.coordinator_lost(run, link, settle_s=20.0) is True
        assert link.poll() == -signal.SIGKILL  # waited for it, not 20 s past it
        later.wait(timeout=10)
    finally:
        for p in (link, run):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_dead_superlink_is_a_coordinator_loss_at_once():
    link, run = _sleeper(), _sleeper()
    try:
        link.kill()
        link.wait(timeout=10)
        assert coordinator.coordinator_lost(run, link) is True
        assert run.poll() is None
    finally:
        run.kill()
        run.wait()


def test_a_finished_run_is_not_a_loss_when_its_superlink_went_after_it():
    link = subprocess.Popen(["true"])
    run = subprocess.Popen(["true"])
    link.wait(timeout=10)
    run.wait(timeout=10)
    assert coordinator.coordinator_lost(run, link) is False
