"""A deployed node's training job stops between two local steps once its silo's erasure has
started (clients/preempt.py), told by the node's watch on the erasure service
(simulations/erasure_watch.py). Fast: a real erasure service over TLS, no Flower processes
(end to end over a deployment: tests/test_deploy_faults.py, its run C)."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

from clients.local import train_local
from clients.preempt import (
    MAX_STOP_BYTES,
    STOP_FILE_ENV,
    JobStop,
    Preempted,
    read_stop,
    write_stop,
)
from medical_data.federation import SiloData
from server.erasure.auth import Authorizer
from server.erasure.catalog import StaticCatalog
from server.erasure.service import ErasureService, serve
from server.erasure.states import State
from server.erasure.store import ErasureStore
from server.erasure_setup import service_tls
from simulations.certs import write_certs
from simulations.deploy import prepare_erasure
from simulations.erasure_watch import ErasureWatcher, WatchError, check_address, read_token


def test_a_job_sent_before_its_silos_erasure_started_stops_and_one_sent_after_does_not(tmp_path):
    # Prepare
    stop = tmp_path / "erasure-stop.json"
    before, after = JobStop(stop, sent_at=100.0), JobStop(stop, sent_at=300.0)
    # Execute / Assert: no file, no stop
    before.check(0, 10)
    assert write_stop(stop, "r1", 200.0)
    # ...the erasure started at 200: the job sent at 100 is obsolete, the one at 300 is not
    with pytest.raises(Preempted, match="after 3 of 10 local steps: erasure r1"):
        before.check(3, 10)
    after.check(3, 10)
    assert before.sleep(5.0) is True  # at once: already stopped
    assert after.sleep(0.01) is False
    # ...an older erasure written later does not move the time back
    assert not write_stop(stop, "r0", 150.0)
    assert read_stop(stop).request_id == "r1"  # type: ignore[union-attr]
    assert write_stop(stop, "r2", 400.0)
    with pytest.raises(Preempted, match="r2"):
        after.check(4, 10)


@pytest.mark.parametrize(
    "content",
    [b"", b'{"request_id": "r', b"[1, 2]", b'{"erasing_at": 9e9}', b" " * (MAX_STOP_BYTES + 1)],
)
def test_a_torn_or_foreign_stop_file_stops_nothing(tmp_path, content):
    stop = tmp_path / "erasure-stop.json"
    stop.write_bytes(content)
    JobStop(stop, sent_at=0.0).check(0, 1)
    assert read_stop(stop) is None


def test_the_stop_file_is_read_from_the_environment_and_absent_means_never(tmp_path, monkeypatch):
    stop = tmp_path / "s.json"
    write_stop(stop, "r", 50.0)
    monkeypatch.delenv(STOP_FILE_ENV, raising=False)
    JobStop.from_env(sent_at=1.0).check(0, 1)  # (simulation: no stop file)
    monkeypatch.setenv(STOP_FILE_ENV, str(stop))
    with pytest.raises(Preempted):
        JobStop.from_env(sent_at=1.0).check(0, 1)


def test_a_change_within_a_job_is_seen_at_the_next_step(tmp_path):
    # Prepare: the file is read once, then changes while the job runs (a new inode each time)
    stop = tmp_path / "erasure-stop.json"
    write_stop(stop, "old", 10.0)
    job = JobStop(stop, sent_at=20.0)
    job.check(0, 5)
    # Execute
    write_stop(stop, "new", 30.0)
    # Assert
    with pytest.raises(Preempted, match="after 1 of 5 local steps: erasure new"):
        job.check(1, 5)


def test_local_training_stops_before_the_step_its_check_refuses():
    data = SiloData(
        0,
        "x",
        np.zeros((8, 1, 4, 4), np.float32),
        np.zeros(8, np.int64),
        np.array([str(i) for i in range(8)]),
    )
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 2))
    ran: list[int] = []

    def stop(step: int, steps: int) -> None:
        if step == 2:
            raise Preempted(f"after {step} of {steps}")
        ran.append(step)

    kw = {"steps": 5, "lr": 0.1, "batch_size": 4, "task": "classification", "seed": 0}
    with pytest.raises(Preempted, match="after 2 of 5"):
        train_local(model, data, stop=stop, **kw)
    assert ran == [0, 1]


# -- the node's watch on the erasure service ------------------------------------------------


@pytest.fixture
def service(small_cfg, tmp_path):
    """The erasure service as a deployment's ServerApp serves it (TLS with the SuperLink's
    certificate, per-silo tokens), two requests queued, one per silo."""
    paths = write_certs(tmp_path / "certs", 2)
    cfg = prepare_erasure(
        small_cfg("silos.count=2", "unlearning.service=true"), tmp_path / "erasure", paths
    )
    store = ErasureStore(tmp_path / "e.sqlite")
    catalog = StaticCatalog(samples={0: {"a"}, 1: {"b"}})
    service = ErasureService(store, Authorizer.from_file(cfg.unlearning.credentials), catalog)
    servers = [serve(service, "127.0.0.1:0", server_credentials=service_tls(cfg))]
    reqs = {s: store.submit(s, None, f"silo-{s}", 0)[0].id for s in (0, 1)}

    class Svc:
        def __init__(self):
            self.store, self.reqs, self.ca = store, reqs, paths.ca_cert.read_bytes()
            self.port = servers[0][1]

        def token(self, silo: int) -> str:
            return read_token(tmp_path / "erasure" / f"silo-{silo}.token")

        def start_erasing(self, silo: int) -> None:
            store.transition(
                reqs[silo], State.ERASING, actor="server", model_version=3, detail="sent"
            )

        def stop(self) -> None:
            servers[-1][0].stop(0).wait()

        def restart(self) -> None:
            servers.append(
                serve(service, f"127.0.0.1:{self.port}", server_credentials=service_tls(cfg))
            )

    svc = Svc()
    try:
        yield svc
    finally:
        svc.stop()
        store.close()


def _wait(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_the_watch_writes_its_own_silos_erasure_start_and_no_other(service, tmp_path):
    # Prepare: silo 1's node follows the service with its own token
    stop = tmp_path / "node-1" / "erasure-stop.json"
    stop.parent.mkdir()
    watch = ErasureWatcher(
        f"127.0.0.1:{service.port}", service.token(1), stop, root_certificates=service.ca
    ).start()
    try:
        assert watch.connected.wait(10.0)
        # Execute: silo 0's erasure starts (silo 1 may not see it), then silo 1's
        service.start_erasing(0)
        t0 = time.time()
        service.start_erasing(1)
        # Assert: the file names silo 1's request, at the time it entered erasing
        assert _wait(lambda: read_stop(stop) is not None)
        got = read_stop(stop)
        assert got is not None and got.request_id == service.reqs[1]
        assert t0 - 1.0 <= got.erasing_at <= time.time() + 1.0
        assert watch.signalled == [service.reqs[1]]
        # ...a job sent before is stopped, one sent now is not
        with pytest.raises(Preempted):
            JobStop(stop, sent_at=t0 - 5.0).check(1, 2)
        JobStop(stop, sent_at=time.time() + 0.01).check(1, 2)
    finally:
        watch.stop()
    assert not watch._thread.is_alive()


def test_the_watch_resumes_after_a_coordinator_restart(service, tmp_path, caplog):
    # Prepare: the watch is open, then the service goes away
    stop = tmp_path / "erasure-stop.json"
    watch = ErasureWatcher(
        f"127.0.0.1:{service.port}",
        service.token(1),
        stop,
        root_certificates=service.ca,
        retry_s=0.05,
        retry_max_s=0.2,
    ).start()
    try:
        assert watch.connected.wait(10.0)
        with caplog.at_level(logging.WARNING, logger="fedasync.node"):
            service.stop()
            assert _wait(lambda: not watch.connected.is_set())
            service.start_erasing(1)  # meanwhile (the store outlives the service)
            # Execute: the service comes back on its address
            service.restart()
            # Assert: the event written meanwhile reaches the node, once
            assert _wait(lambda: read_stop(stop) is not None)
        assert read_stop(stop).request_id == service.reqs[1]  # type: ignore[union-attr]
        assert watch.signalled == [service.reqs[1]]
        lost = [r for r in caplog.records if "erasure watch" in r.getMessage()]
        assert lost and len(lost) <= 2, "one line per outage, not one per try"
    finally:
        watch.stop()


def test_a_refused_token_ends_the_watch_with_one_error(service, tmp_path, caplog):
    stop = tmp_path / "erasure-stop.json"
    with caplog.at_level(logging.ERROR, logger="fedasync.node"):
        watch = ErasureWatcher(
            f"127.0.0.1:{service.port}", "not-a-token", stop, root_certificates=service.ca
        ).start()
        watch._thread.join(10.0)
    assert not watch._thread.is_alive()
    assert any("refused" in r.getMessage() for r in caplog.records)
    assert not stop.exists()


def test_bad_watch_settings_are_refused_with_bounded_messages(tmp_path):
    long = "h" * 10_000
    with pytest.raises(WatchError) as e:
        check_address(long)
    assert len(str(e.value)) < 200
    for bad in ("host", "host:0", "host:99999", ":80"):
        with pytest.raises(WatchError):
            check_address(bad)
    with pytest.raises(WatchError, match="cannot read"):
        read_token(tmp_path / "missing.token")
    (tmp_path / "big.token").write_text("x" * 5000)
    with pytest.raises(WatchError, match="one erasure token"):
        read_token(tmp_path / "big.token")
    (tmp_path / "ok.token").write_text("abc\n")
    assert read_token(tmp_path / "ok.token") == "abc"


def test_a_node_needs_a_token_with_its_erasure_service(tmp_path):
    import argparse

    from simulations.node import NodeError, start_watch

    args = argparse.Namespace(
        erasure_service="127.0.0.1:1", erasure_token="", root_certificates=str(tmp_path / "ca")
    )
    with pytest.raises(NodeError, match="needs --erasure-token"):
        start_watch(args, tmp_path)
    args.erasure_service = ""
    assert start_watch(args, tmp_path) is None
