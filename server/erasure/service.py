"""The erasure gRPC service (``fedasync.erasure.v1.Erasure``) and ``serve`` to run it.

Submit checks the caller and the request, then writes it to the store (one committed
transaction) and only then answers, so an acknowledged request survives any crash. Every
rejected call writes nothing. Status codes:

- missing or unknown token: UNAUTHENTICATED; a token not allowed for that silo:
  PERMISSION_DENIED
- unknown silo: NOT_FOUND; unknown sample ids: INVALID_ARGUMENT (names up to 5)
- already erased or pending (the whole silo, or any of the sample ids): ALREADY_EXISTS
- an idempotency key reused with a different body: INVALID_ARGUMENT
- an offline silo is accepted and stays QUEUED until the training server sees it return

Silo principals see only requests about their own silo (others are NOT_FOUND); the admin
sees all. The training server drives the lifecycle with ``ErasureStore.transition``;
``Watch`` streams those changes from the store's change feed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from server.erasure.auth import Authorizer, Principal, bearer_token
from server.erasure.catalog import Catalog
from server.erasure.gen import erasure_pb2 as pb
from server.erasure.gen import erasure_pb2_grpc
from server.erasure.states import State, is_terminal
from server.erasure.store import ErasureStore, Event, Request

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Erasure"].full_name  # fedasync.erasure.v1.Erasure
log = logging.getLogger(__name__)


def _named(ids: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(s) for s in ids[:limit])
    return shown + (f" (+{len(ids) - limit} more)" if len(ids) > limit else "")


def from_pb_state(value: int) -> State:
    return State[pb.State.Name(value)]


def request_to_pb(r: Request) -> pb.ErasureRequest:
    return pb.ErasureRequest(
        id=r.id,
        silo=r.silo,
        sample_ids=list(r.sample_ids),
        whole_silo=r.whole_silo,
        state=r.state.name,
        failure_reason=r.failure_reason,
        requester=r.requester,
        created_at_ms=r.created_at_ms,
        updated_at_ms=r.updated_at_ms,
        model_version_at_submit=r.model_version_at_submit,
        boundary_version=r.boundary_version,
        metrics=r.metrics,
        reason=r.reason,
    )


def event_to_pb(e: Event) -> pb.ErasureEvent:
    return pb.ErasureEvent(
        seq=e.seq,
        request_id=e.request_id,
        state=e.state.name,
        model_version=e.model_version,
        time_ms=e.time_ms,
        detail=e.detail,
        metrics=e.metrics,
        silo=e.silo,
        actor=e.actor,
    )


class ErasureService(erasure_pb2_grpc.ErasureServicer):
    """Implements the Erasure RPCs over an ``ErasureStore``.

    ``poll_s`` bounds how long a ``Watch`` blocks between checks that its client is still
    there; new events wake it at once.
    """

    def __init__(
        self,
        store: ErasureStore,
        authorizer: Authorizer,
        catalog: Catalog,
        *,
        poll_s: float = 0.5,
    ) -> None:
        self.store = store
        self.authorizer = authorizer
        self.catalog = catalog
        self.poll_s = poll_s
        # Checks and insert of one submit must not interleave with another's.
        self._submit_lock = threading.Lock()

    def _principal(self, context: grpc.ServicerContext) -> Principal:
        principal = self.authorizer.principal(bearer_token(context.invocation_metadata()))
        if principal is None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or invalid credentials: send metadata 'authorization: Bearer <token>'",
            )
        assert principal is not None
        return principal

    def _visible(self, principal: Principal, request_id: str) -> Request | None:
        r = self.store.get(request_id) if request_id else None
        return r if r is not None and self.authorizer.may_see(principal, r.silo) else None

    def Submit(self, request: pb.SubmitRequest, context: grpc.ServicerContext) -> pb.ErasureRequest:
        principal = self._principal(context)
        silo, ids = request.silo, list(dict.fromkeys(request.sample_ids))
        key = request.idempotency_key or None
        if not self.authorizer.may_erase(principal, silo):
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{principal.name} may not erase data of silo {silo}",
            )
        if silo not in self.catalog.silo_ids():
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown silo {silo}")
        if any(not s for s in ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sample ids must not be empty")
        with self._submit_lock:
            if key is not None and self.store.find_by_key(principal.name, key) is not None:
                return self._store_submit(principal, silo, ids, key, request.reason, context)
            whole, covered = self.store.erased(silo)
            if whole:
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"silo {silo} is already erased or its whole-silo erasure is pending",
                )
            done = [s for s in ids if s in covered]
            if done:
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"{len(done)} sample id(s) of silo {silo} already erased or pending: "
                    + _named(done),
                )
            known = self.catalog.sample_ids(silo)
            unknown = [s for s in ids if s not in known]
            if unknown:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{len(unknown)} unknown sample id(s) in silo {silo}: " + _named(unknown),
                )
            return self._store_submit(principal, silo, ids, key, request.reason, context)

    def _store_submit(
        self,
        principal: Principal,
        silo: int,
        ids: list[str],
        key: str | None,
        reason: str,
        context: grpc.ServicerContext,
    ) -> pb.ErasureRequest:
        detail = reason
        if not self.catalog.is_online(silo):
            detail = f"silo {silo} is offline; the request waits queued until it returns" + (
                f"; reason: {reason}" if reason else ""
            )
        try:
            r, created = self.store.submit(
                silo,
                ids,
                principal.name,
                self.catalog.model_version(),
                idempotency_key=key,
                reason=reason,
                detail=detail,
            )
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if created:
            what = "whole silo" if r.whole_silo else f"{len(r.sample_ids)} sample(s)"
            log.info("erasure %s submitted by %s: silo %d, %s", r.id, r.requester, silo, what)
        return request_to_pb(r)

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.ErasureRequest:
        principal = self._principal(context)
        r = self._visible(principal, request.id)
        if r is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no erasure request {request.id!r}")
        assert r is not None
        return request_to_pb(r)

    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        principal = self._principal(context)
        silo = request.silo if request.HasField("silo") else None
        if silo is not None and not self.authorizer.may_see(principal, silo):
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{principal.name} may not see requests of silo {silo}",
            )
        if not principal.is_admin:
            silo = principal.silo
        if any(s == pb.STATE_UNSPECIFIED for s in request.states):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "STATE_UNSPECIFIED is no filter")
        states = [from_pb_state(s) for s in request.states] or None
        rows = self.store.list(silo=silo, states=states)
        return pb.ListResponse(requests=[request_to_pb(r) for r in rows])

    def Watch(
        self, request: pb.WatchRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ErasureEvent]:
        principal = self._principal(context)
        rid = request.request_id or None
        if rid is not None and self._visible(principal, rid) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no erasure request {rid!r}")
        seq = max(request.from_seq, 1) - 1
        while context.is_active():
            events = self.store.events_since(seq, rid, limit=256)
            for e in events:
                seq = e.seq
                if self.authorizer.may_see(principal, e.silo):
                    yield event_to_pb(e)
                if rid is not None and is_terminal(e.state):
                    return
            if events:
                continue
            if rid is not None:
                r = self.store.get(rid)
                if r is not None and is_terminal(r.state):
                    return  # from_seq lies past its terminal event
            self.store.wait_for_change(seq, self.poll_s)


def serve(
    service: ErasureService,
    address: str,
    *,
    server_credentials: grpc.ServerCredentials | None = None,
    max_workers: int = 8,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server with the Erasure service, health checking and reflection.

    Binds ``address`` (``host:0`` picks a free port), insecure unless ``server_credentials``
    are given, starts it and returns ``(server, port)``. Stop it with ``server.stop(grace)``.
    Each open ``Watch`` holds one of the ``max_workers`` threads.
    """
    server = grpc.server(ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="erasure"))
    erasure_pb2_grpc.add_ErasureServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    if server_credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, server_credentials)
    if port == 0:
        raise RuntimeError(f"could not bind the erasure service to {address}")
    server.start()
    log.info("erasure service listening on port %d", port)
    return server, port
