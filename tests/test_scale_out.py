"""Scale-out: a simulation attached to a Ray cluster that is already running.

The test starts a one-node Ray head itself (``ray start --head --block``, 2 CPUs, its log in
tmp_path and its temp folder in a short private folder under /tmp: Ray's socket paths must
stay under 108 bytes, which pytest's tmp_path leaves no room for), runs a small fedasync simulation and its sync baseline against it (two
Ray jobs in a row: the second one shows the first left the cluster usable), checks the head's
processes survived and its CPUs are free again, then stops the head by pid and checks that
none of its processes is left. ``ray stop`` is not used: it stops every Ray process of this
user on the machine, other people's sessions included.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from fedasync.processes import Processes, alive
from server.config import EngineConfig
from simulations.config import load_config
from simulations.launcher import ray_init_args, simulate

RAY = Path(sys.executable).parent / "ray"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_head(procs: Processes, address: str, log: Path, timeout_s: float = 60.0) -> None:
    """Until ``ray start`` says the head runs and its GCS port accepts connections."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert procs.procs[0].popen.poll() is None, f"ray start exited:\n{procs.procs[0].tail()}"
        if "Ray runtime started" in log.read_text(errors="replace"):
            with socket.create_connection((host, int(port)), timeout=5.0):
                return
        time.sleep(0.5)
    raise AssertionError(f"the Ray head did not come up in {timeout_s} s:\n{log.read_text()}")


def _free_cpus(address: str, want: float, timeout_s: float = 30.0) -> float:
    """The cluster's available CPUs, polled until they reach ``want`` (actors take a moment
    to exit after their job ends)."""
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            free = float(ray.available_resources().get("CPU", 0.0))
            if free >= want or time.monotonic() > deadline:
                return free
            time.sleep(0.5)
    finally:
        ray.shutdown()


def test_ray_init_args_private_and_attached():
    # Prepare
    private, attached = EngineConfig(num_cpus=3), EngineConfig(ray_address="10.0.0.5:6379")
    # Execute
    p, a = ray_init_args(private, "/tmp/fa-ray-x"), ray_init_args(attached, "/tmp/fa-ray-x")
    # Assert: a private Ray is local whatever RAY_ADDRESS says; attaching passes only the address
    quiet = {"include_dashboard": False, "log_to_driver": False}
    assert p == {**quiet, "address": "local", "num_cpus": 3, "_temp_dir": "/tmp/fa-ray-x"}
    assert a == {**quiet, "address": "10.0.0.5:6379"}


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["engine.ray_address=10.0.0.5:6379", "engine.num_cpus=2"], "engine.num_cpus"),
        (["engine.ray_address=ray://10.0.0.5:10001"], "engine.ray_address"),
    ],
)
def test_config_refuses_what_an_attached_run_cannot_do(overrides, says):
    with pytest.raises(ValueError, match=says):
        load_config(None, overrides)


@pytest.mark.slow
def test_simulation_attached_to_a_running_ray_head(tmp_path, monkeypatch):
    # Prepare: a Ray head of our own, every process of it marked for the stop by pid
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    address = f"127.0.0.1:{_free_port()}"
    home = tmp_path / "head"
    ray_tmp = tempfile.mkdtemp(prefix="fa-head-")
    procs = Processes(f"scale-out-{uuid.uuid4().hex[:8]}")
    head = procs.start(
        "ray-head",
        [
            str(RAY),
            "start",
            "--head",
            "--block",
            f"--port={address.rsplit(':', 1)[1]}",
            "--num-cpus=2",
            "--num-gpus=0",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={ray_tmp}",
        ],
        home,
    )
    try:
        _wait_for_head(procs, address, head.log)
        head_pids = set(procs.scan())
        cfg = load_config(
            None,
            [
                f"run.out_dir={tmp_path}",
                "run.name=attached",
                "run.budget_s=24",
                "run.progress=false",
                "silos.count=4",
                "client.local_steps=2",
                "data.max_samples=400",
                "server.eval_every=4",
                "server.checkpoint_every=0",
                "server.evaluate_silos=false",
                f"engine.ray_address={address}",
                "lab.compare_sync=true",
            ],
        )
        # Execute: the run and its sync baseline, two Ray jobs on the one cluster
        summary = simulate(cfg)
        # Assert: both finished with accepted updates; the cluster is intact and idle again
        assert summary["updates_accepted"] > 4 and summary["versions"] > 4
        baseline = json.loads(
            (tmp_path / "attached" / "baseline-sync" / "summary.json").read_text()
        )
        assert baseline["mode"] == "sync" and baseline["updates_accepted"] >= 4
        assert all(alive(p) for p in head_pids), "the run stopped none of the cluster's processes"
        assert _free_cpus(address, want=2.0) == 2.0, "the runs' actors released the CPUs"
    finally:
        left = procs.stop(grace_s=5.0)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, f"the head's processes {left} survived the stop"
    assert not [p for p in procs.seen if alive(p)], "no process of the head is left"
