"""The pieces of `fedasync deploy local` that need no SuperLink: stopping process trees (also
detached and stubborn ones), the files Flower reads, and what is measured from the events."""

from __future__ import annotations

import json
import time

import pytest

from server.config import from_container
from simulations.config import to_container
from simulations.deploy import FEDERATION, run_config_toml, write_cli_config
from simulations.deploy_progress import EventTail, measurements, round_trips
from simulations.processes import Processes, alive


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
    back = from_container(json.loads(parsed["config-json"]))
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
