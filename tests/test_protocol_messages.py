"""The protocol's message classes: exact round trips on the legacy wire keys, every wire-level
malformation refused once with a bounded error, error replies told apart, and the client's
fault mod doing each fault."""

import copy

import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import ErrorCode
from inprocess import set_task_identity

from clients.faults import LAST_ARRAYS, inject_fault
from protocol import keys as P
from protocol import wire
from protocol.config import ClientConfig, DataConfig, Setup, SiloErasure
from protocol.messages import (
    ErrorReply,
    EvaluateReply,
    EvaluateRequest,
    Malformed,
    QueryReply,
    QueryRequest,
    TrainRefusal,
    TrainReply,
    TrainRequest,
    UnlearnReply,
    UnlearnRequest,
    read_train_reply,
)


@pytest.fixture(autouse=True)
def _stamped():
    """What Flower's runtimes set before messages are built."""
    set_task_identity()


SETUP = Setup(ClientConfig(), DataConfig(), num_silos=3, seed=5).to_json()


def _params():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 2, generator=g),
        "b": torch.randn(2, generator=g),
        "n": torch.tensor(4),
    }


def _sent(msg):
    """``msg`` as pushed: the Grid stamps a message id, which replies refer to."""
    msg.metadata.__dict__["_message_id"] = "m-1"
    return msg


def _request():
    return _sent(
        TrainRequest(SETUP, job_id=7, base_version=3, seed=11, params=_params()).to_message(9)
    )


def _reply(**metrics):
    reply = TrainReply(1, 7, 3, 40, _params(), {"train_loss": 0.5})
    msg = reply.to_message(reply_to=_request())
    msg.content[P.METRICS] = MetricRecord({**dict(msg.content[P.METRICS]), **metrics})
    return msg


def _same(a, b):
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- round trips on the wire keys
def test_train_request_round_trip_keeps_the_legacy_config():
    req = TrainRequest(SETUP, 7, 3, 11, _params(), "nan", True, ("a", "b"), True, 4, "/tmp/p")
    msg = _sent(req.to_message(9, ttl=30.0))
    assert msg.metadata.message_type == P.TRAIN and msg.metadata.dst_node_id == 9
    assert msg.metadata.ttl == 30.0
    assert dict(msg.content[P.CONFIG]) == {
        P.SETUP: SETUP, P.JOB_ID: 7, P.BASE_VERSION: 3, P.SEED: 11, P.FAULT: "nan",
        P.KEEP_REPLY: True, P.EXCLUDE: ["a", "b"], P.RELEARN: True, P.LOCAL_STEPS: 4,
        P.PRIVACY_DIR: "/tmp/p",
    }  # fmt: skip
    got = TrainRequest.from_message(msg)
    _same(got.params, req.params)
    assert got.__dict__ | {"params": None} == req.__dict__ | {"params": None}
    assert got.setup.num_silos == 3 and got.setup.client == ClientConfig()
    bare = TrainRequest.from_message(_request())
    want = {"fault": "", "keep_reply": False, "exclude": (), "local_steps": None}
    assert {k: getattr(bare, k) for k in want} == want and bare.privacy_dir is None


def test_a_shared_encoding_is_sent_as_is():
    record = wire.encode(_params())
    msg = TrainRequest(SETUP, 1, 0, 2, {}).to_message(9, arrays=record)
    assert msg.content[P.ARRAYS] is record


def test_train_reply_round_trip_and_privacy():
    msg = TrainReply(1, 7, 3, 40, _params(), {"train_loss": 0.5, P.DP_EPSILON: 1.5}).to_message(
        reply_to=_request()
    )
    assert list(msg.content[P.METRICS]) == [P.SILO, P.BASE_VERSION, P.JOB_ID, P.NUM_SAMPLES,
                                            "train_loss", P.DP_EPSILON]  # fmt: skip
    got = read_train_reply(msg)
    assert isinstance(got, TrainReply)
    assert (got.silo, got.job_id, got.base_version, got.num_samples) == (1, 7, 3, 40)
    _same(got.delta, _params())
    assert got.metrics == {"train_loss": 0.5, P.DP_EPSILON: 1.5}
    assert got.privacy is not None and got.privacy[0] == 1.5 and got.flat is not None
    with pytest.raises(ValueError, match="reserved"):
        TrainReply(1, 7, 3, 40, {}, {P.SILO: 2.0})


def test_refusal_round_trip_is_told_from_an_update():
    msg = TrainRefusal(2, 7, 3, "privacy_budget_exhausted", "spent", 3.0, 1e-5).to_message(
        reply_to=_request()
    )
    assert P.ARRAYS not in msg.content and P.NUM_SAMPLES not in msg.content[P.METRICS]
    got = read_train_reply(msg)
    assert isinstance(got, TrainRefusal)
    assert (got.silo, got.reason, got.detail, got.epsilon, got.delta) == (
        2,
        "privacy_budget_exhausted",
        "spent",
        3.0,
        1e-5,
    )
    with pytest.raises(Malformed, match="a refusal"):
        TrainReply.from_message(msg)
    with pytest.raises(Malformed, match="an update"):
        TrainRefusal.from_message(_reply())


def test_query_and_evaluate_round_trips():
    q = _sent(QueryRequest(SETUP).to_message(4))
    assert q.metadata.message_type == P.QUERY and QueryRequest.from_message(q).setup_json == SETUP
    assert QueryReply.from_message(QueryReply(2, 50).to_message(reply_to=q)) == QueryReply(2, 50)
    e = _sent(EvaluateRequest(SETUP, _params()).to_message(4))
    assert e.metadata.message_type == P.EVALUATE
    _same(EvaluateRequest.from_message(e).params, _params())
    reply = EvaluateReply(2, 50, 0.7, 0.9).to_message(reply_to=e)
    assert list(reply.content[P.METRICS]) == [P.SILO, P.NUM_SAMPLES, "loss", "score"]
    assert EvaluateReply.from_message(reply) == EvaluateReply(2, 50, 0.7, 0.9)


def test_unlearn_round_trip():
    erase = SiloErasure(method="relabel", steps=3, radius=0.5, signature_dtype="float16")
    ref = _params()
    req = UnlearnRequest(SETUP, 7, 3, 11, _params(), erase, ("s1", "s2"), reference=ref)
    msg = _sent(req.to_message(9, ttl=5.0))
    assert msg.metadata.message_type == P.UNLEARN
    assert P.loads(str(msg.content[P.CONFIG][P.UNLEARN_JSON]))["radius"] == 0.5
    got = UnlearnRequest.from_message(msg)
    assert got.erasure == erase and got.forget == ("s1", "s2") and got.reference is not None
    _same(got.reference, ref)
    assert UnlearnRequest(SETUP, 7, 3, 11, {}, erase).to_message(9).content.get(P.REFERENCE) is None
    basis = torch.randn(6, 2).half()
    out = UnlearnReply(1, 7, 3, 2, _params(), basis, ("w",), {"signature_rank": 2, "steps": 3.0})
    back = UnlearnReply.from_message(out.to_message(reply_to=msg))
    assert back.basis.dtype == torch.float16 and torch.equal(back.basis, basis)
    assert back.names == ("w",) and back.report() == {P.NUM_SAMPLES: 2.0, "signature_rank": 2.0,
                                                      "steps": 3.0}  # fmt: skip


def test_setup_json_is_the_servers_byte_for_byte(small_cfg):
    from server.clock import client_setup

    sent = client_setup(small_cfg("data.max_samples=100")).to_json()
    setup = Setup.from_json(sent)
    assert setup.to_json() == sent and setup.data.max_samples == 100
    assert setup.client.dp.delta == small_cfg().client.dp.delta


def test_setup_of_an_earlier_coordinator_is_read_at_the_settled_values(small_cfg):
    """A setup that still carries client.dp.delta, client.dp.accountant and data.test_fraction
    (they were settings) is read when they hold today's constants, refused in one line naming
    the key otherwise; today's setup no longer carries them."""
    from protocol.keys import dumps, loads
    from server.clock import client_setup

    sent = client_setup(small_cfg()).to_json()
    raw = loads(sent)
    assert "delta" not in raw["client"]["dp"] and "test_fraction" not in raw["data"]
    raw["client"]["dp"].update(delta=1e-5, accountant="rdp")
    raw["data"]["test_fraction"] = 0.2
    assert Setup.from_json(dumps(raw)).to_json() == sent
    for section, key, value in (("dp", "delta", 1e-6), ("dp", "accountant", "prv"),
                                ("data", "test_fraction", 0.3)):  # fmt: skip
        bad = copy.deepcopy(raw)
        (bad["client"]["dp"] if section == "dp" else bad["data"])[key] = value
        with pytest.raises(ValueError, match=f"{key} is fixed at"):
            Setup.from_json(dumps(bad))


def test_silo_erasure_from_the_server_config_and_its_overrides(small_cfg):
    u = small_cfg().unlearning
    erase = SiloErasure.of({"radius": 0.25, "steps": 9}, u)
    assert (erase.radius, erase.steps, erase.lr, erase.method) == (0.25, 9, u.lr, u.method)
    assert SiloErasure.from_json(erase.to_json()) == erase


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"method": "fedavg"}, "method"),
        ({"signature_dtype": "float64"}, "signature_dtype"),
        ({"radius": -1.0}, "radius"),
        ({"lr": 0}, "lr"),
        ({"signature_rank": 0}, "signature_rank"),
        ({"steps": 2.5}, "steps must be an integer"),
        ({"extra": 1}, "unknown keys"),
    ],
)
def test_silo_erasure_is_validated(change, match):
    raw = {**P.loads(SiloErasure().to_json()), **change}
    with pytest.raises(ValueError, match=match):
        SiloErasure.from_mapping(raw)


# ---------------------------------------------------------------- malformations
@pytest.mark.parametrize("key", [P.SILO, P.JOB_ID, P.BASE_VERSION, P.NUM_SAMPLES])
def test_a_missing_train_metric_is_malformed(key):
    msg = _reply()
    metrics = dict(msg.content[P.METRICS])
    del metrics[key]
    msg.content[P.METRICS] = MetricRecord(metrics)
    with pytest.raises(Malformed, match="^missing or bad field: .*" + key):
        TrainReply.from_message(msg)


@pytest.mark.parametrize("metrics", [{"train_loss": [0.5, 0.25]}, {P.SILO: [1, 2]}])
def test_a_list_valued_metric_is_malformed(metrics):
    with pytest.raises(Malformed, match="^missing or bad field"):
        TrainReply.from_message(_reply(**metrics))


def test_bad_arrays_are_malformed():
    msg = _reply()
    record = msg.content[P.ARRAYS]
    arr = record[wire.PACKED]
    record[wire.PACKED] = Array(dtype=arr.dtype, shape=arr.shape, stype=arr.stype,
                                data=arr.data[:-4])  # fmt: skip
    with pytest.raises(Malformed, match="^arrays do not decode"):
        TrainReply.from_message(msg)
    del msg.content[P.ARRAYS]
    with pytest.raises(Malformed, match="^missing or bad field: 'arrays'"):
        TrainReply.from_message(msg)
    msg.content[P.ARRAYS] = ConfigRecord({"x": 1})
    with pytest.raises(Malformed, match="not a ArrayRecord"):
        TrainReply.from_message(msg)


def test_unbounded_input_is_bounded_in_the_error():
    huge = "x" * 100_000
    msg = _reply()
    msg.content[P.ARRAYS] = ArrayRecord(
        {huge: Array(dtype="float32", shape=(1,), stype="numpy.ndarray", data=b"bad")}
    )
    with pytest.raises(Malformed) as e:
        TrainReply.from_message(msg)
    assert len(str(e.value)) <= 300 and str(e.value).startswith("arrays do not decode")
    req = _request()
    req.content[P.CONFIG][P.SETUP] = "{" + huge
    with pytest.raises(Malformed, match="^bad setup") as e:
        TrainRequest.from_message(req)
    assert len(str(e.value)) <= 300
    req.content[P.CONFIG][P.SETUP] = SETUP
    req.content[P.CONFIG][P.JOB_ID] = "9" * 10_000
    with pytest.raises(Malformed) as e:
        TrainRequest.from_message(req)
    assert len(str(e.value)) <= 300
    refusal = TrainRefusal(1, 7, 3, huge, huge).to_message(reply_to=_request())
    got = TrainRefusal.from_message(refusal)
    assert len(got.reason) <= 300 and len(got.detail) <= 300


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        (P.EXCLUDE, "abc", "'exclude-ids' must be a list"),
        (P.FAULT, 3, "'fault' must be a string"),
        (P.KEEP_REPLY, "yes", "'keep-reply' must be a boolean"),
        (P.SEED, [1, 2], "int"),
        (P.SETUP, '{"client": {}}', "bad setup"),
    ],
)
def test_a_bad_train_request_field_is_malformed(key, value, match):
    msg = _request()
    msg.content[P.CONFIG][key] = value
    with pytest.raises(Malformed, match=match):
        TrainRequest.from_message(msg)


def test_a_bad_unlearn_reply_is_malformed():
    req = _sent(UnlearnRequest(SETUP, 7, 3, 11, _params(), SiloErasure()).to_message(9))

    def reply(basis, names=("w",)):
        return UnlearnReply(1, 7, 3, 2, _params(), basis, names).to_message(reply_to=req)

    for basis in (
        torch.randn(6),
        torch.full((6, 2), float("nan")),
        torch.ones(6, 2, dtype=torch.int64),
    ):
        with pytest.raises(Malformed, match="not a finite \\(d, k\\) matrix"):
            UnlearnReply.from_message(reply(basis))
    msg = reply(torch.randn(6, 2))
    del msg.content[P.CONFIG][P.SIGNATURE_NAMES]
    with pytest.raises(Malformed, match="signature-names"):
        UnlearnReply.from_message(msg)
    msg = reply(torch.randn(6, 2))
    msg.content[P.SIGNATURE] = wire.encode({"other": torch.randn(6, 2)})
    with pytest.raises(Malformed, match="exactly 'basis'"):
        UnlearnReply.from_message(msg)
    bad = _sent(UnlearnRequest(SETUP, 7, 3, 11, _params(), SiloErasure()).to_message(9))
    bad.content[P.CONFIG][P.UNLEARN_JSON] = '{"method": "pga"}'
    with pytest.raises(Malformed, match="missing keys"):
        UnlearnRequest.from_message(bad)


@pytest.mark.parametrize("cls", [TrainReply, TrainRefusal, QueryReply, EvaluateReply, UnlearnReply])
def test_an_error_reply_is_an_error_reply_not_malformed(cls):
    reason = (
        "Traceback (most recent call last):\n" + "  frame\n" * 5000 + "RuntimeError: " + "y" * 999
    )
    msg = Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason=reason), reply_to=_request())
    with pytest.raises(ErrorReply) as e:
        cls.from_message(msg)
    assert e.value.offline and e.value.code == ErrorCode.NODE_UNAVAILABLE
    assert e.value.first_line == "Traceback (most recent call last):"
    assert e.value.last_line.startswith("RuntimeError: yyy") and len(e.value.last_line) == 300
    assert len(str(e.value)) < 400
    other = Message(Error(code=0, reason="boom"), reply_to=_request())
    with pytest.raises(ErrorReply) as e:
        read_train_reply(other)
    assert not e.value.offline and e.value.last_line == "boom"


# ---------------------------------------------------------------- the fault mod
def _ctx():
    return Context(run_id=1, node_id=9, node_config={"partition-id": 1}, state=RecordDict(),
                   run_config={})  # fmt: skip


def _faulty(fault, keep=False):
    req = TrainRequest(SETUP, 7, 3, 11, _params(), fault=fault, keep_reply=keep)
    return _sent(req.to_message(9))


class _Handler:
    def __init__(self, reply=None):
        self.calls, self.reply = 0, reply

    def __call__(self, msg, context):
        self.calls += 1
        if self.reply is not None:
            return self.reply(msg)
        delta = {"w": torch.ones(3, 2), "b": torch.ones(2), "n": torch.tensor(4)}
        return TrainReply(1, 7 + self.calls, 3, 40, delta, {"train_loss": 0.5}).to_message(
            reply_to=msg
        )


def test_no_fault_passes_the_reply_through():
    ctx, replies = _ctx(), []

    def handler(msg, context):
        replies.append(_Handler()(msg, context))
        return replies[-1]

    out = inject_fault(_faulty(""), ctx, handler)
    assert replies == [out], "the handler's own reply object"
    assert LAST_ARRAYS not in ctx.state


def test_crash_raises_before_training():
    handler = _Handler()
    with pytest.raises(RuntimeError, match="fault injection"):
        inject_fault(_faulty("crash"), _ctx(), handler)
    assert handler.calls == 0


@pytest.mark.parametrize(
    "fault", ["nan", "wrong_shape", "huge_norm", "future_version", "unknown_silo"]
)
def test_tampering_faults_corrupt_the_reply(fault):
    got = TrainReply.from_message(inject_fault(_faulty(fault), _ctx(), _Handler()))
    w = got.delta["w"]
    assert got.metrics == {"train_loss": 0.5} and torch.equal(got.delta["n"], torch.tensor(4))
    if fault == "nan":
        assert bool(w.isnan().all()) and torch.equal(got.delta["b"], torch.ones(2))
    elif fault == "wrong_shape":
        assert w.shape == (5,) and torch.equal(got.delta["b"], torch.ones(2))
    elif fault == "huge_norm":
        assert torch.equal(w, torch.full((3, 2), 1e4)) and torch.equal(
            got.delta["b"], torch.full((2,), 1e4)
        )
    else:
        assert torch.equal(w, torch.ones(3, 2))
    assert got.base_version == (1003 if fault == "future_version" else 3)
    assert got.silo == (10_001 if fault == "unknown_silo" else 1)


def test_replay_sends_the_kept_reply_without_training():
    ctx, handler = _ctx(), _Handler()
    first = inject_fault(_faulty("replay", keep=True), ctx, handler)  # nothing kept yet: trains
    assert handler.calls == 1 and LAST_ARRAYS in ctx.state
    kept = TrainReply.from_message(first)
    again = inject_fault(_faulty("replay"), ctx, handler)
    assert handler.calls == 1, "a replay does not train"
    got = TrainReply.from_message(again)
    assert got.job_id == kept.job_id == 8 and again.metadata.reply_to_message_id == "m-1"
    _same(got.delta, kept.delta)


def test_a_kept_reply_is_the_tampered_one_and_refusals_are_left_alone():
    ctx = _ctx()
    inject_fault(_faulty("huge_norm", keep=True), ctx, _Handler())
    kept = wire.decode(copy.deepcopy(ctx.state[LAST_ARRAYS]))
    assert torch.equal(kept["w"], torch.full((3, 2), 1e4))
    refusal = TrainRefusal(1, 7, 3, "no_training_data", "none left")
    out = inject_fault(
        _faulty("nan", keep=True), _ctx(), _Handler(lambda m: refusal.to_message(reply_to=m))
    )
    assert TrainRefusal.from_message(out) == refusal


def test_the_client_apps_train_handler_carries_the_mod():
    from clients.app import app

    with pytest.raises(RuntimeError, match="fault injection: silo crashed"):
        app(_faulty("crash"), _ctx())
