"""A reply whose train_* metric Flower allows but the server cannot read (a list) is rejected
as malformed, and the norm detector learns nothing from it (it used to end the run)."""

import torch
from flwr.app import Message, MetricRecord, RecordDict
from inprocess import set_task_identity

from fedasync import NormOutlierDetector, RejectReason, StalenessBound
from protocol import keys as P
from protocol import wire
from server.intake import Accepted, Job, take_reply


def _reply(train_loss):
    set_task_identity()
    metrics = MetricRecord(
        {P.SILO: 0, P.JOB_ID: 7, P.BASE_VERSION: 3, P.NUM_SAMPLES: 10, "train_loss": train_loss}
    )
    content = RecordDict({P.METRICS: metrics, P.ARRAYS: wire.encode({"w": torch.ones(4)})})
    return Message(content, dst_node_id=11, message_type="train")


def _take(reply, norms):
    job = Job(
        "m",
        silo=0,
        node_id=11,
        job_id=7,
        base_version=3,
        dispatched_at=0.0,
        finishes_at=0.0,
        wall_sent=0.0,
    )
    return take_reply(
        reply,
        job,
        version=4,
        reference={"w": torch.zeros(4)},
        roster={0: 11},
        bound=StalenessBound(),
        norms=norms,
    )


def test_an_unreadable_train_metric_is_malformed_and_teaches_the_detector_nothing():
    norms = NormOutlierDetector()
    got = _take(_reply([0.5, 0.25]), norms)
    assert not isinstance(got, Accepted)
    assert got.reason == RejectReason.MALFORMED
    assert "missing or bad field" in got.detail
    assert len(norms.state_dict()["history"]) == 0
    ok = _take(_reply(0.5), norms)
    assert isinstance(ok, Accepted) and ok.update.metrics == {"train_loss": 0.5}
