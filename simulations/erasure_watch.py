"""A hospital's node follows its own silo's erasure requests on the coordinator's erasure
service, so that a training job the erasure made obsolete stops at its next local step.

Flower 1.42's SuperNode pulls one message at a time: the erasure's ``train.unlearn`` reaches
the node only after it has replied to the training job it runs, which for a straggler can be
minutes. The erasure service already tells each silo about its own requests, over TLS and with
the silo's own token (``Watch``). ``ErasureWatcher`` holds that stream open in the node's
process and, whenever one of the silo's requests enters ``erasing`` (the server has cancelled
the silo's job and sent the erasure), writes the time it did to the node's stop file
(``clients.preempt.write_stop``). The ClientApp's training loop checks that file before each
step and stops a job sent before that time (``clients.preempt.JobStop``); its error reply is
dropped by the server, and the SuperNode then pulls the erasure.

The stream resumes after the last event it saw when the service goes away (a coordinator
restart) and comes back: the watcher retries with a growing pause, logging once per outage.
It never stops the node: without the service a job just runs to its end, as without it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from clients.preempt import STOP_FILE, write_stop
from server.erasure.gen import erasure_pb2 as pb
from server.erasure.gen import erasure_pb2_grpc

if TYPE_CHECKING:
    from server.config import FedAsyncConfig
    from simulations.certs import CertPaths

log = logging.getLogger("fedasync.node")

MAX_TOKEN_CHARS = 1024
"""A longer token file is refused (a token is 43 characters)."""


class WatchError(ValueError):
    """The watcher cannot be set up (a bad address or token file)."""


def read_token(path: Path) -> str:
    """The bearer token in ``path`` (one line); WatchError when missing, empty or too long."""
    try:
        raw = path.read_bytes()[: MAX_TOKEN_CHARS + 1]
    except OSError as e:
        raise WatchError(f"cannot read the erasure token file {path}: {e.strerror}") from e
    token = raw.decode("utf-8", "replace").strip()
    if not token or len(token) > MAX_TOKEN_CHARS or any(c.isspace() for c in token):
        raise WatchError(f"{path} does not hold one erasure token (one line, no spaces)")
    return token


def check_address(address: str) -> str:
    """``address`` when it is HOST:PORT with a port in range, else WatchError (bounded)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise WatchError(f"the erasure service's address must be HOST:PORT, not {address[:80]!r}")
    return address


class ErasureWatcher:
    """Follow the erasure requests a silo's token may see and write each one's start into
    ``stop_file``. ``start`` runs it on a daemon thread; ``stop`` ends it (and its stream)."""

    def __init__(
        self,
        address: str,
        token: str,
        stop_file: Path,
        *,
        root_certificates: bytes | None = None,
        retry_s: float = 0.5,
        retry_max_s: float = 10.0,
        on_stop: Callable[[str, float], None] | None = None,
    ) -> None:
        self.address, self.token, self.stop_file = check_address(address), token, stop_file
        self.root_certificates = root_certificates
        self.retry_s, self.retry_max_s = retry_s, retry_max_s
        self.on_stop = on_stop
        self.next_seq = 0
        """The first event seq the next stream asks for (resumes after the last one seen)."""
        self.connected = threading.Event()
        """Set while a stream is open: from the service's answer (its headers, sent as it
        accepts the watch) until the stream fails (a test waits for it)."""
        self.signalled: list[str] = []
        """Request ids whose start was written to the stop file, oldest first."""
        self._done = threading.Event()
        self._call: grpc.Future | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="erasure-watch", daemon=True)

    def start(self) -> ErasureWatcher:
        """Start following the stream; returns self."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop following: cancel the open stream and wait up to ``timeout`` for the thread."""
        self._done.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _channel(self) -> grpc.Channel:
        if self.root_certificates is None:
            return grpc.insecure_channel(self.address)
        creds = grpc.ssl_channel_credentials(root_certificates=self.root_certificates)
        return grpc.secure_channel(self.address, creds)

    def _run(self) -> None:
        pause, outage = self.retry_s, ""
        while not self._done.is_set():
            try:
                with self._channel() as channel:
                    self._follow(erasure_pb2_grpc.ErasureStub(channel))
                pause, outage = self.retry_s, ""
            except grpc.RpcError as e:
                self.connected.clear()
                if self._done.is_set():
                    return
                code = e.code() if hasattr(e, "code") else None
                why = f"{getattr(code, 'name', code)}: {str(e.details() if hasattr(e, 'details') else e)[:200]}"
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    log.error("erasure watch refused (%s): this node's jobs will not stop", why)
                    return  # a wrong token does not get better by retrying
                if why != outage:
                    log.warning(
                        "erasure watch on %s lost (%s): retrying every %.1f-%.0fs",
                        self.address,
                        why,
                        self.retry_s,
                        self.retry_max_s,
                    )
                    outage = why
            except Exception as e:  # noqa: BLE001 - the node trains on without the watch
                log.warning("erasure watch failed: %s", str(e)[:300])
            if self._done.wait(pause):
                return
            pause = min(pause * 2, self.retry_max_s)

    def _follow(self, stub: erasure_pb2_grpc.ErasureStub) -> None:
        metadata = [("authorization", f"Bearer {self.token}")]
        call = stub.Watch(pb.WatchRequest(from_seq=self.next_seq), metadata=metadata)
        with self._lock:
            if self._done.is_set():
                call.cancel()
                return
            self._call = call
        call.initial_metadata()  # the service's answer (its headers), or the call's end
        if call.done():
            for _ in call:  # refused or gone: raises its error
                pass
            return
        log.info("following this silo's erasure requests on %s", self.address)
        self.connected.set()
        for event in call:
            self.next_seq = event.seq + 1
            if event.state != pb.ERASING:
                continue
            at = (event.time_ms + 1) / 1000.0  # the end of its millisecond (jobs sent before)
            if write_stop(self.stop_file, event.request_id, at):
                self.signalled.append(event.request_id)
                log.info(
                    "erasure %s of silo %d started: a training job sent before stops at its "
                    "next local step",
                    event.request_id[:40],
                    event.silo,
                )
                if self.on_stop is not None:
                    self.on_stop(event.request_id, at)


def start_watches(
    cfg: FedAsyncConfig, run_dir: Path, paths: CertPaths, since: float
) -> list[ErasureWatcher] | None:
    """Each silo's erasure watch, as ``fedasync node --erasure-service`` runs it (its own
    token, TLS with the deployment's CA), once the ServerApp has written where its erasure
    service listens (``run_dir/erasure_address``, not older than ``since``); None until then.
    Without the service: no watches (an empty list)."""
    if not cfg.unlearning.service:
        return []
    at = run_dir / "erasure_address"
    try:
        if at.stat().st_mtime < since:
            return None  # an earlier run's
        address = at.read_text().strip()
    except OSError:
        return None
    if not address:
        return None
    folder = Path(cfg.unlearning.credentials or run_dir / "credentials.json").parent
    ca = paths.ca_cert.read_bytes()
    watches = []
    for s in range(cfg.silos.count):
        try:
            token = read_token(folder / f"silo-{s}.token")
        except WatchError as e:  # credentials the user made: the tokens are theirs to hand out
            log.warning("silo %d follows no erasure requests: %s", s, e)
            continue
        stop_file = run_dir / "deploy" / f"silo-{s}" / STOP_FILE
        watches.append(ErasureWatcher(address, token, stop_file, root_certificates=ca).start())
    return watches
