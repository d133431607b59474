"""The erasure service as an outsider sees it: only what server reflection tells, raw bytes
where a polite client would never send them, and every abuse an outsider tried.

The client here never imports the project's generated code or its CLI: it learns the
service from reflection (``ProtoReflectionDescriptorDatabase`` in a pool of its own),
builds messages with ``message_factory`` and calls methods through ``channel.unary_unary`` /
``channel.unary_stream``. The server is the project's own, in process on a free port.
"""

from __future__ import annotations

import stat
import sys
import time
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

import server.erasure.refusals as refusals_module
from server.erasure.auth import Authorizer, Principal
from server.erasure.catalog import StaticCatalog
from server.erasure.limits import Limits
from server.erasure.service import ErasureService, serve
from server.erasure.store import ErasureStore

PACKAGE = "fedasync.erasure.v1"
TOKENS = {"admin": "tok-admin", **{f"silo-{i}": f"tok-silo-{i}" for i in range(4)}}
C = grpc.StatusCode
MAX_DETAILS = 1024  # no error message may echo a caller's big input back


class Outsider:
    """A client that knows nothing but the address: everything else comes from reflection."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(self.channel))
        self.service = self.pool.FindServiceByName(f"{PACKAGE}.Erasure")

    def msg(self, name: str, **fields: Any) -> Any:
        cls = message_factory.GetMessageClass(self.pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
        return cls(**fields)

    def call(self, method: str, request: Any, who: str | None = "admin", timeout: float = 10):
        """Call ``method`` with a message or raw bytes; a stream comes back as its iterator."""
        m = self.service.FindMethodByName(method)
        path = f"/{self.service.full_name}/{method}"
        out = message_factory.GetMessageClass(m.output_type)
        raw = isinstance(request, bytes)
        kw = {
            "request_serializer": (lambda b: b) if raw else (lambda x: x.SerializeToString()),
            "response_deserializer": out.FromString,
        }
        stub = (
            self.channel.unary_stream(path, **kw)
            if m.server_streaming
            else self.channel.unary_unary(path, **kw)
        )
        token = TOKENS.get(who or "", who)
        md = [("authorization", f"Bearer {token}")] if who else None
        return stub(request, metadata=md, timeout=timeout)

    def refused(self, method: str, request: Any, who: str | None = "admin") -> grpc.RpcError:
        """The error of a call that must fail (a stream is read to its end)."""
        with pytest.raises(grpc.RpcError) as info:
            reply = self.call(method, request, who)
            if self.service.FindMethodByName(method).server_streaming:
                list(reply)
        err = info.value
        assert len(err.details() or "") <= MAX_DETAILS, f"{len(err.details())} characters"
        return err


class Env:
    """The project's erasure server on 127.0.0.1 (4 silos of 10 samples), an outsider."""

    def __init__(self, tmp_path, limits: Limits | None = None, poll_s: float = 0.05) -> None:
        self.path = tmp_path / "erasures.sqlite"
        self.store = ErasureStore(self.path)
        principals = [(TOKENS["admin"], Principal("admin", "admin"))] + [
            (TOKENS[f"silo-{i}"], Principal(f"silo-{i}", "silo", i)) for i in range(4)
        ]
        self.catalog = StaticCatalog(
            samples={i: {f"p{i}-{j}" for j in range(10)} for i in range(4)}
        )
        self.service = ErasureService(
            self.store,
            Authorizer.from_tokens(principals),
            self.catalog,
            poll_s=poll_s,
            limits=limits,
        )
        self.server, port = serve(self.service, "127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.out = Outsider(self.address)

    def rows(self) -> tuple[int, int]:
        return len(self.store.list()), len(self.store.audit())

    def close(self) -> None:
        self.out.channel.close()
        self.server.stop(0).wait()
        self.store.close()


@pytest.fixture
def env(tmp_path):
    e = Env(tmp_path)
    try:
        yield e
    finally:
        e.close()


def _healthy(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


# -- 1. the scope of a Submit is explicit --------------------------------------------------


def test_an_empty_submit_erases_nothing(env):
    o = env.out
    cases = [
        b"",  # the empty message: proto3 would read it as silo 0, no samples
        o.msg("SubmitRequest", silo=0),  # silo 0 explicitly, still no scope
        o.msg("SubmitRequest", silo=1, reason="forget me"),
        o.msg("SubmitRequest", whole_silo=True),  # no silo
        o.msg("SubmitRequest", silo=1, whole_silo=True, sample_ids=["p1-0"]),  # both
    ]
    for request in cases:
        assert o.refused("Submit", request).code() == C.INVALID_ARGUMENT
    assert env.rows() == (0, 0)
    # explicit: the whole silo, or samples
    whole = o.call("Submit", o.msg("SubmitRequest", silo=0, whole_silo=True))
    some = o.call("Submit", o.msg("SubmitRequest", silo=1, sample_ids=["p1-0"]))
    assert (whole.silo, whole.whole_silo, list(whole.sample_ids)) == (0, True, [])
    assert (some.silo, some.whole_silo, list(some.sample_ids)) == (1, False, ["p1-0"])


def test_sample_ids_covering_the_silo_erase_the_whole_silo(env):
    o = env.out
    every = sorted(env.catalog.samples[1])
    r = o.call("Submit", o.msg("SubmitRequest", silo=1, sample_ids=every, idempotency_key="k"))
    assert r.whole_silo and list(r.sample_ids) == []
    assert "cover every remaining sample of silo 1" in env.store.audit(r.id)[0].detail
    # a retry of the same body with the same key is the same request, not a conflict
    again = o.call("Submit", o.msg("SubmitRequest", silo=1, sample_ids=every, idempotency_key="k"))
    assert again.id == r.id and env.rows() == (1, 1)
    # the sibling: the last samples of a silo whose others are already pending
    first = o.call(
        "Submit", o.msg("SubmitRequest", silo=2, sample_ids=[f"p2-{j}" for j in range(8)])
    )
    assert not first.whole_silo
    last = o.call("Submit", o.msg("SubmitRequest", silo=2, sample_ids=["p2-8", "p2-9"]))
    assert last.whole_silo and env.store.erased(2)[0]
    # fewer than all stay sample-level
    part = o.call("Submit", o.msg("SubmitRequest", silo=3, sample_ids=["p3-0", "p3-1"]))
    assert not part.whole_silo and list(part.sample_ids) == ["p3-0", "p3-1"]


# -- 3. sizes ------------------------------------------------------------------------------


def test_huge_fields_are_refused_without_being_echoed_or_stored(env):
    o, lim = env.out, Limits()
    big = "x" * 3_000_000
    cases = [
        ("Submit", o.msg("SubmitRequest", silo=0, sample_ids=[big])),
        ("Submit", o.msg("SubmitRequest", silo=0, sample_ids=["p0-1", "y" * 300])),
        ("Submit", o.msg("SubmitRequest", silo=0, whole_silo=True, reason=big)),
        ("Submit", o.msg("SubmitRequest", silo=0, whole_silo=True, idempotency_key="k" * 200)),
        ("Submit", o.msg("SubmitRequest", silo=0, sample_ids=["a"] * (lim.max_sample_ids + 1))),
        ("Get", o.msg("GetRequest", id=big)),
        ("Watch", o.msg("WatchRequest", request_id=big)),
        ("Watch", o.msg("WatchRequest", from_seq=-1)),
        ("Watch", o.msg("WatchRequest", from_seq=2**62)),
        ("List", o.msg("ListRequest", states=[1] * (lim.max_states + 1))),
        ("ListRefusals", o.msg("ListRefusalsRequest", limit=10**6)),
    ]
    for method, request in cases:
        err = o.refused(method, request)
        assert err.code() == C.INVALID_ARGUMENT, (method, err.code(), err.details()[:200])
    # an unknown id a few KiB long is quoted, cut short
    err = o.refused("Submit", o.msg("SubmitRequest", silo=0, sample_ids=["z" * 200]))
    assert err.code() == C.INVALID_ARGUMENT and "(200 characters)" in err.details()
    # a message over the size limit never reaches a handler
    over = o.msg("SubmitRequest", silo=0, sample_ids=["q" * 200] * 25_000)
    assert o.refused("Submit", over).code() == C.RESOURCE_EXHAUSTED
    assert env.rows() == (0, 0)


# -- 4. enum values and anything unexpected --------------------------------------------------


def test_unknown_enum_values_are_invalid_not_unknown(env):
    o = env.out
    # ListRequest.states is field 2 (repeated enum): 99 and 0 sent as raw varints
    for raw in (b"\x10\x63", b"\x10\x00", b"\x12\x02\x01\x63"):
        err = o.refused("List", raw)
        assert err.code() == C.INVALID_ARGUMENT, err.details()


def test_malformed_bytes_are_invalid_argument(env):
    garbage = b"\xff\xff\xff\xff\x0f"
    for method in ("Submit", "Get", "List", "Watch", "ListRefusals", "Certificate"):
        err = env.out.refused(method, garbage)
        assert err.code() == C.INVALID_ARGUMENT, (method, err.code())
    assert env.rows() == (0, 0)


def test_a_handler_bug_answers_internal_never_unknown(env, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(env.store, "list", broken)
    err = env.out.refused("List", env.out.msg("ListRequest"))
    assert err.code() == C.INTERNAL and "secret" not in err.details()
    assert [(r.code, r.method) for r in env.store.refusals()] == [
        ("INTERNAL", f"/{PACKAGE}.Erasure/List")
    ]


# -- credentials and other silos' data -----------------------------------------------------


def test_tokens_and_other_silos(env):
    o = env.out
    whole0 = o.msg("SubmitRequest", silo=0, whole_silo=True)
    assert o.refused("Submit", whole0, who=None).code() == C.UNAUTHENTICATED
    assert o.refused("Submit", whole0, who="forged").code() == C.UNAUTHENTICATED
    assert o.refused("Submit", whole0, who="silo-1").code() == C.PERMISSION_DENIED
    mine = o.call("Submit", o.msg("SubmitRequest", silo=0, sample_ids=["p0-0"]), who="silo-0")
    assert o.refused("Get", o.msg("GetRequest", id=mine.id), who="silo-1").code() == C.NOT_FOUND
    watch = o.msg("WatchRequest", request_id=mine.id)
    assert o.refused("Watch", watch, who="silo-1").code() == C.NOT_FOUND
    assert o.refused("List", o.msg("ListRequest", silo=0), who="silo-1").code() == (
        C.PERMISSION_DENIED
    )
    assert o.refused("ListRefusals", o.msg("ListRefusalsRequest"), who="silo-0").code() == (
        C.PERMISSION_DENIED
    )
    assert env.rows() == (1, 1)


# -- 6. refusals leave a bounded trace -----------------------------------------------------


def test_refusals_are_recorded_and_bounded(env, monkeypatch):
    o = env.out
    o.refused("Submit", o.msg("SubmitRequest", silo=0, whole_silo=True), who="forged")
    o.refused("Submit", o.msg("SubmitRequest", silo=0, whole_silo=True), who="silo-1")
    o.refused("Submit", o.msg("SubmitRequest", silo=0, sample_ids=["w" * 250]), who="silo-0")
    o.refused("Get", b"\xff\xff", who="silo-2")
    rows = env.store.refusals()
    assert [(r.who, r.method.rsplit("/", 1)[1], r.code) for r in rows] == [
        ("silo-2", "Get", "INVALID_ARGUMENT"),
        ("silo-0", "Submit", "INVALID_ARGUMENT"),
        ("silo-1", "Submit", "PERMISSION_DENIED"),
        ("unauthenticated", "Submit", "UNAUTHENTICATED"),
    ]
    assert all(r.peer.startswith("ipv4:127.0.0.1:") for r in rows)
    assert all(len(r.reason) <= refusals_module.REFUSAL_TEXT for r in rows)
    assert "w" * 50 not in rows[1].reason  # the caller's input is not kept
    # the admin sees them (newest first) and their counts
    reply = o.call("ListRefusals", o.msg("ListRefusalsRequest", limit=2))
    assert [r.who for r in reply.refusals] == ["silo-2", "silo-0"]
    assert sum(c.count for c in reply.counts) == 4
    # a flood keeps only the newest rows, and counts every refusal
    monkeypatch.setattr(refusals_module, "REFUSALS_KEPT", 5)
    for _ in range(12):
        o.refused("Get", o.msg("GetRequest", id="nope"), who="silo-3")
    kept = env.store.refusals(limit=1000)
    assert len(kept) == 5 and {r.who for r in kept} == {"silo-3"}
    counts = {
        (c.who, c.method.rsplit("/", 1)[1], c.code): c.count for c in env.store.refusal_counts()
    }
    assert counts[("silo-3", "Get", "NOT_FOUND")] == 12
    assert sum(counts.values()) == 4 + 12


# -- 5. streams cannot starve anyone -------------------------------------------------------


def test_a_stream_flood_does_not_starve_health_or_unary_calls(env):
    o = env.out
    for silo in range(4):  # an event every principal may read
        o.call("Submit", o.msg("SubmitRequest", silo=silo, sample_ids=[f"p{silo}-0"]))
    streams = []
    try:
        refused = []
        for who in TOKENS:
            for _ in range(4):
                s = o.call("Watch", o.msg("WatchRequest"), who=who, timeout=20)
                streams.append(s)
                try:
                    next(s)  # the first event: the stream is open on the server
                except grpc.RpcError as e:
                    refused.append((who, e.code()))
        # health and unary calls still answer at once
        assert _healthy(env.address)
        # two per principal admitted, the rest refused
        assert sorted(refused) == sorted((w, C.RESOURCE_EXHAUSTED) for w in TOKENS for _ in (0, 1))
        r = o.call("Submit", o.msg("SubmitRequest", silo=1, sample_ids=["p1-1"]), timeout=5)
        assert r.silo == 1
        # unauthenticated health watches are capped per peer host as well
        health = health_pb2_grpc.HealthStub(o.channel)
        # one at a time, each open on the server before the next starts: started together,
        # the server may admit them in any order
        first = []
        for _ in range(2):
            watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=60)
            streams.append(watch)
            first.append(next(watch).status)
        assert first[0] == first[1] == health_pb2.HealthCheckResponse.SERVING
        third = health.Watch(health_pb2.HealthCheckRequest(), timeout=60)
        streams.append(third)
        with pytest.raises(grpc.RpcError) as info:
            next(third)
        assert info.value.code() == C.RESOURCE_EXHAUSTED
        assert _healthy(env.address)
    finally:
        for s in streams:
            s.cancel()


def test_global_stream_cap_and_streams_end_when_the_client_leaves(tmp_path):
    # poll_s is long: only the client leaving (or the server stopping) can end a Watch soon
    e = Env(tmp_path, Limits(streams_total=3, unary_workers=2), poll_s=600)
    o, streams = e.out, []
    try:
        o.call("Submit", o.msg("SubmitRequest", silo=0, sample_ids=["p0-0"]))
        for who in ("admin", "admin", "silo-0"):
            streams.append(o.call("Watch", o.msg("WatchRequest"), who=who, timeout=120))
            next(streams[-1])
        with pytest.raises(grpc.RpcError) as info:
            next(o.call("Watch", o.msg("WatchRequest"), who="silo-0", timeout=120))
        assert info.value.code() == C.RESOURCE_EXHAUSTED and "in all" in info.value.details()
        assert _healthy(e.address)
        # the client goes away: its slot is free again at once
        streams[0].cancel()
        deadline, again = time.monotonic() + 10, None
        while again is None and time.monotonic() < deadline:
            s = o.call("Watch", o.msg("WatchRequest"), who="silo-0", timeout=120)
            try:
                next(s)
                again = s
            except grpc.RpcError:
                time.sleep(0.05)
        assert again is not None
        streams.append(again)
    finally:
        for s in streams:
            s.cancel()
        o.channel.close()
        e.server.stop(0).wait()
    # the server stopped: no handler thread is left inside Watch (poll_s is 600 s)
    deadline = time.monotonic() + 10
    while _watch_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _watch_threads() == 0
    e.store.close()


def _watch_threads() -> int:
    n = 0
    for frame in sys._current_frames().values():
        f: Any = frame
        while f is not None:
            if f.f_code is ErasureService.Watch.__code__:
                n += 1
                break
            f = f.f_back
    return n


# -- 7. file modes ---------------------------------------------------------------------------


def test_the_store_files_are_private(env):
    env.out.call("Submit", env.out.msg("SubmitRequest", silo=0, whole_silo=True))
    for suffix in ("", "-wal", "-shm"):
        path = env.path.with_name(env.path.name + suffix)
        assert path.exists() and stat.S_IMODE(path.stat().st_mode) == 0o600, suffix
