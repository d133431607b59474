"""What every RPC of the erasure server goes through: one gRPC interceptor, ``Guard``.

Like a Flower mod, it wraps each handler (the Erasure service, health checking and
reflection alike) instead of repeating checks inside them:

- a request whose bytes are not a valid message is INVALID_ARGUMENT (gRPC would answer
  INTERNAL, and the handler would never see it);
- an unexpected exception in a handler is INTERNAL with a short fixed message, logged with
  its traceback here; no call ever answers UNKNOWN;
- streams (Watch, health Watch, reflection) are capped per principal and in all
  (RESOURCE_EXHAUSTED beyond); the slot is freed as soon as the call ends, the client
  cancels or goes away, or the server stops;
- every refused call (any status but OK and CANCELLED) is recorded: who (the principal, or
  ``unauthenticated``), the peer, the method, the code and the status details (which quote
  caller input only through ``limits.quoted``).

Not seen here: a message over ``Limits.max_message_bytes`` (gRPC refuses it before any
handler runs, RESOURCE_EXHAUSTED) and an unknown method (UNIMPLEMENTED).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from server.erasure.limits import Limits

log = logging.getLogger(__name__)

UNAUTHENTICATED = "unauthenticated"
INTERNAL_MESSAGE = "internal error in the erasure service (logged on the server)"
NOT_REFUSALS = (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED)

Metadata = Sequence[tuple[str, str | bytes]]
Who = Callable[[Metadata], str | None]
"""The principal name behind a call's metadata, or None when it has no valid token."""
Record = Callable[[str, str, str, str, str], None]
"""``record(who, peer, method, code, reason)``: keep one refusal."""


class _Malformed:
    """What the tolerant deserializer returns for bytes that are not a valid message."""


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception:
            return _Malformed()

    return parse


class Guard(grpc.ServerInterceptor):
    """Malformed input, unexpected errors, stream caps and the refusal record, for every
    RPC (see the module docstring)."""

    def __init__(self, who: Who, record: Record, limits: Limits) -> None:
        self.who, self.record, self.limits = who, record, limits
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}

    def open_streams(self) -> dict[str, int]:
        """Open streams per key (principal name, or ``unauthenticated@<host>``)."""
        with self._lock:
            return dict(self._open)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        """The method's handler wrapped in the guard (module docstring), or None without one."""
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method  # type: ignore[attr-defined]
        h: Any = handler
        if h.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(h.unary_unary, method),
                request_deserializer=_tolerant(h.request_deserializer),
                response_serializer=h.response_serializer,
            )
        if h.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(h.unary_stream, method),
                request_deserializer=_tolerant(h.request_deserializer),
                response_serializer=h.response_serializer,
            )
        if h.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._stream(h.stream_stream, method),
                request_deserializer=h.request_deserializer,
                response_serializer=h.response_serializer,
            )
        return grpc.stream_unary_rpc_method_handler(
            self._unary(h.stream_unary, method),
            request_deserializer=h.request_deserializer,
            response_serializer=h.response_serializer,
        )

    # -- wrappers ----------------------------------------------------------------------

    def _unary(self, fn: Callable[[Any, Any], Any], method: str) -> Callable[[Any, Any], Any]:
        def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                self._check_parsed(request, context, method)
                return fn(request, context)
            except Exception:
                self._failed(context, method)
                raise

        return behaviour

    def _stream(
        self, fn: Callable[[Any, Any], Iterator[Any]], method: str
    ) -> Callable[[Any, Any], Iterator[Any]]:
        def behaviour(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            release: Callable[[], None] | None = None
            try:
                release = self._acquire(context, method)
                context.add_callback(release)  # the client left or the server stops
                self._check_parsed(request, context, method)
                yield from fn(request, context)
            except Exception:
                self._failed(context, method)
                raise
            finally:
                if release is not None:
                    release()

        return behaviour

    def _check_parsed(self, request: Any, context: grpc.ServicerContext, method: str) -> None:
        if isinstance(request, _Malformed):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is not a valid message for {method}",
            )

    def _failed(self, context: grpc.ServicerContext, method: str) -> None:
        """Inside ``except``: record an abort and let it go on, or turn anything else into
        INTERNAL (logged with its traceback)."""
        code = context.code()  # type: ignore[attr-defined]
        if code is None and not context.is_active():
            return  # the client left (a request stream then raises): nothing was refused
        if code is None or code is grpc.StatusCode.OK:
            log.exception("erasure service: %s failed", method)
            self._record(context, method, grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
            context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
        if code not in NOT_REFUSALS:
            details = context.details()  # type: ignore[attr-defined]
            text = details.decode(errors="replace") if isinstance(details, bytes) else details
            self._record(context, method, code, text or "")

    def _record(
        self, context: grpc.ServicerContext, method: str, code: grpc.StatusCode, reason: str
    ) -> None:
        try:
            who = self.who(context.invocation_metadata()) or UNAUTHENTICATED
            self.record(who, context.peer(), method, code.name, reason)
        except Exception:  # a refusal that cannot be written must not change the answer
            log.warning("erasure service: could not record a refusal of %s", method, exc_info=True)

    def _acquire(self, context: grpc.ServicerContext, method: str) -> Callable[[], None]:
        """Take a stream slot or abort RESOURCE_EXHAUSTED; returns an idempotent release."""
        who = self.who(context.invocation_metadata())
        key = who if who is not None else f"{UNAUTHENTICATED}@{context.peer().rsplit(':', 1)[0]}"
        lim = self.limits
        with self._lock:
            mine, total = self._open.get(key, 0), sum(self._open.values())
            if mine >= lim.streams_per_principal or total >= lim.streams_total:
                busy = mine >= lim.streams_per_principal
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"too many open streams for {key} (at most {lim.streams_per_principal})"
                    if busy
                    else f"too many open streams in all (at most {lim.streams_total})",
                )
            self._open[key] = mine + 1
        done = threading.Event()

        def release() -> None:
            with self._lock:
                if done.is_set():
                    return
                done.set()
                left = self._open[key] - 1
                if left:
                    self._open[key] = left
                else:
                    del self._open[key]

        return release
