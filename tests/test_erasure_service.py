"""The erasure service over real gRPC: status codes, nothing written on error, offline silos,
Watch, visibility per principal, health checking and reflection."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from server.erasure.auth import Authorizer, Principal
from server.erasure.catalog import StaticCatalog
from server.erasure.gen import erasure_pb2 as pb
from server.erasure.gen import erasure_pb2_grpc
from server.erasure.service import SERVICE_NAME, ErasureService, serve
from server.erasure.states import State
from server.erasure.store import ErasureStore

TOKENS = {"admin": "tok-admin", **{f"silo-{i}": f"tok-silo-{i}" for i in range(4)}}
C = grpc.StatusCode


class Env:
    """A running service on 127.0.0.1 with a 4-silo catalog (silo 3 offline)."""

    def __init__(self, tmp_path):
        self.store = ErasureStore(tmp_path / "erasure.sqlite")
        principals = [(TOKENS["admin"], Principal("admin", "admin"))] + [
            (TOKENS[f"silo-{i}"], Principal(f"silo-{i}", "silo", i)) for i in range(4)
        ]
        self.catalog = StaticCatalog(
            samples={i: {f"p{i}-{j}" for j in range(10)} for i in range(4)},
            version=42,
            offline={3},
        )
        self.service = ErasureService(
            self.store, Authorizer.from_tokens(principals), self.catalog, poll_s=0.05
        )
        self.server, self.port = serve(self.service, "127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = erasure_pb2_grpc.ErasureStub(self.channel)

    def call(self, method: str, msg, who: str | None = "admin", token: str | None = None, **kw):
        token = token if token is not None else TOKENS.get(who or "", "")
        md = [("authorization", f"Bearer {token}")] if token else []
        return getattr(self.stub, method)(msg, metadata=md, timeout=kw.pop("timeout", 10), **kw)

    def submit(self, silo, ids=(), who="admin", **kw):
        """Samples ``ids`` of ``silo``; the whole silo when there are none."""
        kw.setdefault("whole_silo", not ids)
        return self.call("Submit", pb.SubmitRequest(silo=silo, sample_ids=list(ids), **kw), who)

    def rows(self) -> tuple[int, int]:
        return len(self.store.list()), len(self.store.audit())

    def close(self):
        self.channel.close()
        self.server.stop(0).wait()
        self.store.close()


@pytest.fixture
def env(tmp_path):
    e = Env(tmp_path)
    try:
        yield e
    finally:
        e.close()


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


def test_submit_returns_the_persisted_request(env):
    r = env.submit(1, ["p1-3", "p1-4"], who="silo-1", reason="consent withdrawn")
    assert len(r.id) == 32 and r.state == pb.QUEUED and r.requester == "silo-1"
    assert list(r.sample_ids) == ["p1-3", "p1-4"] and not r.whole_silo
    assert r.model_version_at_submit == 42 and r.boundary_version == -1
    stored = env.store.get(r.id)
    assert stored is not None and stored.reason == "consent withdrawn"
    assert env.store.audit(r.id)[0].requester == "silo-1"
    assert env.call("Get", pb.GetRequest(id=r.id), "silo-1") == r


@pytest.mark.parametrize(
    "who, token, silo, ids, code, words",
    [
        (None, None, 0, [], C.UNAUTHENTICATED, "credentials"),
        (None, "not-a-token", 0, [], C.UNAUTHENTICATED, "credentials"),
        ("silo-1", None, 0, [], C.PERMISSION_DENIED, "silo-1 may not erase data of silo 0"),
        ("silo-1", None, 7, [], C.PERMISSION_DENIED, "silo 7"),
        ("admin", None, 7, [], C.NOT_FOUND, "unknown silo 7"),
        ("admin", None, -1, [], C.NOT_FOUND, "unknown silo -1"),
        ("silo-0", None, 0, ["p0-1", "zz1", "zz2"], C.INVALID_ARGUMENT, "'zz1', 'zz2'"),
        ("silo-0", None, 0, [f"x{i}" for i in range(8)], C.INVALID_ARGUMENT, "(+3 more)"),
        ("silo-0", None, 0, ["p0-1", ""], C.INVALID_ARGUMENT, "empty"),
    ],
)
def test_bad_submits_get_a_clear_status_and_write_nothing(env, who, token, silo, ids, code, words):
    env.submit(2, ["p2-0"])  # something already there
    before = env.rows()
    md = [("authorization", f"Bearer {token or TOKENS.get(who or '', '')}")]
    if who is None and token is None:
        md = []
    with pytest.raises(grpc.RpcError) as info:
        msg = pb.SubmitRequest(silo=silo, sample_ids=ids, whole_silo=not ids)
        env.stub.Submit(msg, metadata=md, timeout=10)
    assert info.value.code() == code
    assert words in info.value.details()
    assert env.rows() == before


def test_already_erased_cases(env):
    whole = env.submit(0)
    samples = env.submit(1, ["p1-0", "p1-1"], who="silo-1")
    before = env.rows()
    # a second whole-silo request while one is pending, and samples of a pending whole silo
    assert _code(lambda: env.submit(0)) == C.ALREADY_EXISTS
    assert _code(lambda: env.submit(0, ["p0-1"], who="silo-0")) == C.ALREADY_EXISTS
    # samples already covered by a pending request (even mixed with new ones)
    with pytest.raises(grpc.RpcError) as info:
        env.submit(1, ["p1-5", "p1-1"], who="silo-1")
    assert info.value.code() == C.ALREADY_EXISTS and "'p1-1'" in info.value.details()
    assert env.rows() == before
    # once verified, still already erased
    for s in (State.ERASING, State.CALIBRATING, State.VERIFIED):
        env.store.transition(whole.id, s, actor="server", model_version=43)
    assert _code(lambda: env.submit(0)) == C.ALREADY_EXISTS
    # a failed request frees its samples again
    env.store.transition(samples.id, State.FAILED, actor="server", model_version=43, detail="x")
    assert env.submit(1, ["p1-1"], who="silo-1").state == pb.QUEUED


def test_idempotent_retry_returns_the_same_id(env):
    a = env.submit(2, ["p2-1"], who="silo-2", idempotency_key="k-1")
    b = env.submit(2, ["p2-1"], who="silo-2", idempotency_key="k-1")
    assert a.id == b.id and env.rows() == (1, 1)
    # the same key with another body is refused, and writes nothing
    assert _code(lambda: env.submit(2, ["p2-2"], who="silo-2", idempotency_key="k-1")) == (
        C.INVALID_ARGUMENT
    )
    assert env.rows() == (1, 1)


def test_offline_silo_is_accepted_and_waits_queued(env):
    r = env.submit(3, ["p3-0"], who="silo-3")
    assert r.state == pb.QUEUED
    assert "offline" in env.store.audit(r.id)[0].detail
    assert [u.id for u in env.store.unfinished()] == [r.id]


def test_get_unknown_and_invisible(env):
    r = env.submit(1, ["p1-0"])
    assert _code(lambda: env.call("Get", pb.GetRequest(id="nope"))) == C.NOT_FOUND
    assert _code(lambda: env.call("Get", pb.GetRequest(id=r.id), "silo-0")) == C.NOT_FOUND
    assert _code(lambda: env.call("Get", pb.GetRequest(id=r.id), None)) == C.UNAUTHENTICATED
    assert env.call("Get", pb.GetRequest(id=r.id), "silo-1").id == r.id


def test_list_visibility_and_filters(env):
    a = env.submit(0, ["p0-0"], who="silo-0")
    b = env.submit(1, ["p1-0"])  # by the admin, about silo 1
    c = env.submit(1, ["p1-1"], who="silo-1")
    env.store.transition(c.id, State.ERASING, actor="server", model_version=43)

    def ids(who, **kw):
        return [r.id for r in env.call("List", pb.ListRequest(**kw), who).requests]

    assert ids("admin") == [a.id, b.id, c.id]
    assert ids("silo-1") == [b.id, c.id]
    assert ids("silo-0") == [a.id]
    assert ids("silo-2") == []
    assert ids("admin", silo=1) == [b.id, c.id]
    assert ids("admin", states=[pb.ERASING]) == [c.id]
    assert ids("silo-1", states=[pb.QUEUED, pb.VERIFIED]) == [b.id]
    assert _code(lambda: ids("silo-1", silo=0)) == C.PERMISSION_DENIED
    assert _code(lambda: ids(None)) == C.UNAUTHENTICATED


def _drive(store, rid, delay=0.05):
    def run():
        for s in (State.ERASING, State.CALIBRATING, State.VERIFIED):
            time.sleep(delay)
            store.transition(rid, s, actor="server", model_version=50, detail=s.value)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_watch_streams_the_lifecycle_and_ends_at_the_terminal_state(env):
    other = env.submit(2, ["p2-0"])
    r = env.submit(1, ["p1-0"], who="silo-1")
    driver = _drive(env.store, r.id)
    try:
        events = list(env.call("Watch", pb.WatchRequest(request_id=r.id), "silo-1"))
    finally:
        driver.join()
    assert [e.state for e in events] == [pb.QUEUED, pb.ERASING, pb.CALIBRATING, pb.VERIFIED]
    assert {e.request_id for e in events} == {r.id} and other.id != r.id
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    assert events[-1].model_version == 50 and events[-1].actor == "server"
    # replay from a seq: only what follows; past the end of a finished request: ends at once
    later = list(env.call("Watch", pb.WatchRequest(request_id=r.id, from_seq=events[2].seq)))
    assert [e.state for e in later] == [pb.CALIBRATING, pb.VERIFIED]
    after = events[-1].seq + 1
    assert list(env.call("Watch", pb.WatchRequest(request_id=r.id, from_seq=after))) == []
    # a seq that no event has reached yet (or a negative one) is a mistake, not a wait
    for bad in (after + 1, 10_000, -1):
        msg = pb.WatchRequest(request_id=r.id, from_seq=bad)
        assert _code(lambda m=msg: list(env.call("Watch", m))) == C.INVALID_ARGUMENT


def test_watch_all_filters_by_principal_and_stops_on_cancel(env):
    a = env.submit(0, ["p0-0"])
    b = env.submit(1, ["p1-0"])
    stream = env.call("Watch", pb.WatchRequest(), "silo-1", timeout=30)
    first = next(stream)
    env.store.transition(a.id, State.ERASING, actor="server", model_version=43)
    env.store.transition(b.id, State.ERASING, actor="server", model_version=43)
    second = next(stream)
    stream.cancel()
    assert (first.request_id, first.state) == (b.id, pb.QUEUED)
    assert (second.request_id, second.state) == (b.id, pb.ERASING)
    assert _code(lambda: list(env.call("Watch", pb.WatchRequest(request_id=a.id), "silo-1"))) == (
        C.NOT_FOUND
    )


def test_health_and_reflection(env):
    health = health_pb2_grpc.HealthStub(env.channel)
    for name in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    db = ProtoReflectionDescriptorDatabase(env.channel)
    services = set(db.get_services())
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services
    assert db.FindFileContainingSymbol(SERVICE_NAME).name == "fedasync/erasure/v1/erasure.proto"
    assert SERVICE_NAME == "fedasync.erasure.v1.Erasure"


def test_whole_silo_by_ids_on_an_offline_silo_says_both_and_keeps_the_reason(env):
    r = env.submit(3, sorted(env.catalog.samples[3]), who="silo-3", reason="left the study")
    assert r.whole_silo and list(r.sample_ids) == [] and r.reason == "left the study"
    detail = env.store.audit(r.id)[0].detail
    assert "erased as the whole silo" in detail and "offline" in detail
    assert detail.endswith("reason: left the study")
    # a plain request keeps its reason as the detail, as before
    plain = env.submit(1, ["p1-0"], reason="why")
    assert env.store.audit(plain.id)[0].detail == "why"
