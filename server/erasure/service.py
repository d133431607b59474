"""The erasure gRPC service (``fedasync.erasure.v1.Erasure``) and ``serve`` to run it.

Submit checks the caller and the request, then writes it to the store (one committed
transaction) and only then answers, so an acknowledged request survives any crash. Every
rejected call writes nothing to the requests and audit tables; it is recorded in the
store's refusals table instead (``guard.Guard``). Status codes:

- missing or unknown token: UNAUTHENTICATED (checked first); a token not allowed for that
  silo: PERMISSION_DENIED (checked once the request's shape and sizes are valid)
- a malformed message (bytes that are not the request type), a field over its limit
  (``limits.Limits``), an unknown or unspecified enum value, a Submit without ``silo`` or
  without an explicit scope (``whole_silo`` xor ``sample_ids``), an empty sample id, a
  ``from_seq`` out of range: INVALID_ARGUMENT. Errors quote caller input cut to a few dozen
  characters (``limits.quoted``)
- unknown silo: NOT_FOUND; unknown sample ids: INVALID_ARGUMENT (names up to 5)
- already erased or pending (the whole silo, or any of the sample ids): ALREADY_EXISTS
- an idempotency key reused with a different body: INVALID_ARGUMENT
- sample ids that (with those already erased or pending) cover every sample of the silo:
  accepted as a whole-silo erasure (``whole_silo`` set, the audit row says why), so no
  erasure leaves a silo training on no data
- an offline silo is accepted and stays QUEUED until the training server sees it return
- a message over ``Limits.max_message_bytes``, or more open streams than
  ``Limits.streams_per_principal`` / ``streams_total``: RESOURCE_EXHAUSTED
- ListRefusals by a silo: PERMISSION_DENIED (admin only)
- Certificate of a request the caller may not see: NOT_FOUND (as Get); one over
  ``Limits.max_certificate_bytes``: RESOURCE_EXHAUSTED
- anything unexpected: INTERNAL with a fixed message (the traceback is logged); never UNKNOWN

Silo principals see only requests about their own silo (others are NOT_FOUND); the admin
sees all, and a request's certificate (``certificate.py``: built from the store and the run's
event log, ``events``) is for the admin and the request's silo alone. The training server
drives the lifecycle with ``ErasureStore.transition``;
``Watch`` streams those changes from the store's change feed and ends when its request is
finished, when the client goes away, or when the server stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from server.erasure.auth import Authorizer, Principal, bearer_token
from server.erasure.catalog import Catalog
from server.erasure.certificate import build, to_json
from server.erasure.certificate_html import render
from server.erasure.gen import erasure_pb2 as pb
from server.erasure.gen import erasure_pb2_grpc
from server.erasure.guard import Guard, Metadata
from server.erasure.limits import Limits, named, quoted
from server.erasure.states import State, is_terminal
from server.erasure.store import ErasureStore, Event, Request

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Erasure"].full_name  # fedasync.erasure.v1.Erasure
STATE_VALUES = frozenset(v.number for v in pb.State.DESCRIPTOR.values) - {pb.STATE_UNSPECIFIED}
log = logging.getLogger(__name__)


def from_pb_state(value: int) -> State:
    """The ``State`` a protobuf ``State`` value names (callers drop STATE_UNSPECIFIED first)."""
    return State[pb.State.Name(value)]


def request_to_pb(r: Request) -> pb.ErasureRequest:
    """A stored request as its ``ErasureRequest`` message."""
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
    """An audit event as its ``ErasureEvent`` message."""
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
    there; new events, the client leaving and the server stopping wake it at once. ``events``:
    the run's event log (``metrics.jsonl``), which certificates read beside the store (None,
    or a file not there yet: certificates without it, saying what that leaves out).
    """

    def __init__(
        self,
        store: ErasureStore,
        authorizer: Authorizer,
        catalog: Catalog,
        *,
        poll_s: float = 0.5,
        limits: Limits | None = None,
        events: Path | None = None,
    ) -> None:
        self.store = store
        self.events = events
        self.authorizer = authorizer
        self.catalog = catalog
        self.poll_s = poll_s
        self.limits = limits or Limits()
        # Checks and insert of one submit must not interleave with another's.
        self._submit_lock = threading.Lock()

    def who(self, metadata: Metadata) -> str | None:
        """The principal name behind ``metadata``, or None (for ``guard.Guard``)."""
        principal = self.authorizer.principal(bearer_token(metadata))
        return None if principal is None else principal.name

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

    def _visible_or_abort(
        self, context: grpc.ServicerContext, principal: Principal, rid: str
    ) -> Request:
        """Request ``rid`` (its id checked first) if ``principal`` may see it; NOT_FOUND
        otherwise, also when it exists (a silo learns nothing of another's requests)."""
        self._check_request_id(context, rid)
        r = self._visible(principal, rid)
        if r is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no erasure request {quoted(rid)}")
        assert r is not None  # (abort raises)
        return r

    def _check_len(self, context: grpc.ServicerContext, what: str, text: str, limit: int) -> None:
        if len(text) > limit:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{what} is {len(text)} characters long (at most {limit})",
            )

    def _check_request_id(self, context: grpc.ServicerContext, rid: str) -> None:
        self._check_len(context, "request id", rid, self.limits.max_request_id_chars)

    def _check_submit(self, request: pb.SubmitRequest, context: grpc.ServicerContext) -> None:
        """Shape and size of a Submit, before anything is looked up."""
        lim, bad = self.limits, grpc.StatusCode.INVALID_ARGUMENT
        if not request.HasField("silo"):
            context.abort(bad, "silo is required")
        n = len(request.sample_ids)
        if request.whole_silo and n:
            context.abort(bad, "give either whole_silo or sample_ids, not both")
        if not request.whole_silo and not n:
            context.abort(
                bad, "say what to erase: whole_silo = true, or a non-empty list of sample_ids"
            )
        if n > lim.max_sample_ids:
            context.abort(bad, f"{n} sample ids in one request (at most {lim.max_sample_ids})")
        long = [s for s in request.sample_ids if len(s) > lim.max_sample_id_chars]
        if long:
            context.abort(
                bad,
                f"{len(long)} sample id(s) longer than {lim.max_sample_id_chars} characters: "
                + named(long, 1),
            )
        if any(not s for s in request.sample_ids):
            context.abort(bad, "sample ids must not be empty")
        self._check_len(context, "reason", request.reason, lim.max_reason_chars)
        self._check_len(context, "idempotency key", request.idempotency_key, lim.max_key_chars)

    def Submit(self, request: pb.SubmitRequest, context: grpc.ServicerContext) -> pb.ErasureRequest:
        """Accept an erasure request; the answer comes once it is committed (see the module)."""
        principal = self._principal(context)
        self._check_submit(request, context)
        silo, ids = request.silo, list(dict.fromkeys(request.sample_ids))
        key = request.idempotency_key or None
        if not self.authorizer.may_erase(principal, silo):
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{principal.name} may not erase data of silo {silo}",
            )
        if silo not in self.catalog.silo_ids():
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown silo {silo}")
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
                    + named(done),
                )
            known = self.catalog.sample_ids(silo)
            unknown = [s for s in ids if s not in known]
            if unknown:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{len(unknown)} unknown sample id(s) in silo {silo}: " + named(unknown),
                )
            everything = bool(ids) and known <= covered.union(ids)
            return self._store_submit(
                principal, silo, ids, key, request.reason, context, everything=everything
            )

    def _store_submit(
        self,
        principal: Principal,
        silo: int,
        ids: list[str],
        key: str | None,
        reason: str,
        context: grpc.ServicerContext,
        *,
        everything: bool = False,
    ) -> pb.ErasureRequest:
        notes = []
        if everything:
            notes.append(
                f"the {len(ids)} sample id(s) cover every remaining sample of silo {silo}"
                " (with those already erased or pending): erased as the whole silo"
            )
        if not self.catalog.is_online(silo):
            notes.append(f"silo {silo} is offline; the request waits queued until it returns")
        detail = "; ".join(notes + [f"reason: {reason}"] if reason else notes) if notes else reason
        try:
            r, created = self.store.submit(
                silo,
                ids,
                principal.name,
                self.catalog.model_version(),
                idempotency_key=key,
                reason=reason,
                detail=detail,
                whole_silo=everything,
            )
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if created:
            what = "whole silo" if r.whole_silo else f"{len(r.sample_ids)} sample(s)"
            log.info("erasure %s submitted by %s: silo %d, %s", r.id, r.requester, silo, what)
        return request_to_pb(r)

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.ErasureRequest:
        """One request by id; NOT_FOUND also when the caller may not see it."""
        r = self._visible_or_abort(context, self._principal(context), request.id)
        return request_to_pb(r)

    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        """Requests oldest first, by silo and states; a silo caller gets only its own silo's."""
        principal = self._principal(context)
        silo = request.silo if request.HasField("silo") else None
        if silo is not None and not self.authorizer.may_see(principal, silo):
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{principal.name} may not see requests of silo {silo}",
            )
        if not principal.is_admin:
            silo = principal.silo
        if len(request.states) > self.limits.max_states:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.states)} states in the filter (at most {self.limits.max_states})",
            )
        wrong = sorted({int(s) for s in request.states} - STATE_VALUES)
        if wrong:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"no such state filter: {wrong[:5]} (STATE_UNSPECIFIED and unknown values are"
                " no filter)",
            )
        states = [from_pb_state(s) for s in request.states] or None
        rows = self.store.list(silo=silo, states=states)
        return pb.ListResponse(requests=[request_to_pb(r) for r in rows])

    def Watch(
        self, request: pb.WatchRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ErasureEvent]:
        """Stream the audit events from seq ``from_seq`` on (of one request, or all the caller may
        see) until the request is finished, the client goes away or the server stops."""
        principal = self._principal(context)
        self._check_request_id(context, request.request_id)
        rid = request.request_id or None
        if rid is not None and self._visible(principal, rid) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no erasure request {quoted(rid)}")
        newest = self.store.last_seq
        if not 0 <= request.from_seq <= newest + 1:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"from_seq {request.from_seq} is out of range (0 to {newest + 1}, the newest"
                " event's seq + 1)",
            )
        gone = threading.Event()

        def leave() -> None:
            gone.set()
            self.store.wake()

        context.add_callback(leave)  # the client went away or the server stops
        context.send_initial_metadata(())  # the watch is accepted: a follower knows it is on
        seq = max(request.from_seq, 1) - 1
        while context.is_active() and not gone.is_set():
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
            self.store.wait_for_change(seq, self.poll_s, stop=gone.is_set)

    def Certificate(
        self, request: pb.CertificateRequest, context: grpc.ServicerContext
    ) -> pb.CertificateResponse:
        """The certificate of one request, as JSON and HTML: the admin's, or the request's
        silo's; NOT_FOUND for anyone else (as Get); RESOURCE_EXHAUSTED when it is larger than
        ``Limits.max_certificate_bytes``."""
        principal = self._principal(context)
        r = self._visible_or_abort(context, principal, request.request_id)
        events = self.events if self.events is not None and self.events.is_file() else None
        cert = build(self.store, r.id, events=events)
        text, page = to_json(cert), render(cert)
        size = len(text.encode()) + len(page.encode())
        if size > self.limits.max_certificate_bytes:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the certificate of request {r.id} is {size} bytes (at most "
                f"{self.limits.max_certificate_bytes}): build it from the run folder, "
                "fedasync erase certificate ID --run RUN_DIR --out DIR",
            )
        log.info("erasure %s: certificate sent to %s", r.id, principal.name)
        return pb.CertificateResponse(json=text, html=page)

    def ListRefusals(
        self, request: pb.ListRefusalsRequest, context: grpc.ServicerContext
    ) -> pb.ListRefusalsResponse:
        """Admin only: the newest ``limit`` refused calls (100 when 0) and the counts per (who,
        method, code)."""
        principal = self._principal(context)
        if not principal.is_admin:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"{principal.name} may not list refusals"
            )
        if not 0 <= request.limit <= self.limits.max_refusals:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"limit {request.limit} is out of range (0 to {self.limits.max_refusals})",
            )
        rows = self.store.refusals(request.limit or 100)
        return pb.ListRefusalsResponse(
            refusals=[pb.Refusal(**vars(r)) for r in rows],
            counts=[pb.RefusalCount(**vars(c)) for c in self.store.refusal_counts()],
        )


def serve(
    service: ErasureService,
    address: str,
    *,
    server_credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server with the Erasure service, health checking and reflection.

    Binds ``address`` (``host:0`` picks a free port), insecure unless ``server_credentials``
    are given, starts it and returns ``(server, port)``. Stop it with ``server.stop(grace)``:
    open streams end then.

    Every RPC goes through ``guard.Guard``. Each open stream holds one worker thread, so the
    pool has ``Limits.streams_total`` threads for streams plus ``Limits.unary_workers`` that
    streams can never take: health checks and unary calls still run with every stream
    open. (gRPC's ``maximum_concurrent_rpcs`` is not used: it would refuse unary calls and
    health checks as well.)
    """
    lim = service.limits
    guard = Guard(service.who, service.store.record_refusal, lim)
    server = grpc.server(
        ThreadPoolExecutor(max_workers=lim.workers, thread_name_prefix="erasure"),
        interceptors=[guard],
        options=[("grpc.max_receive_message_length", lim.max_message_bytes)],
    )
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
