import math

import pytest
import torch

from fedasync.checkpoint import load_checkpoint, save_checkpoint
from fedasync.validation import NormOutlierDetector, Rejection, RejectReason, check_tensors

REF = {
    "w": torch.zeros(2, 3),
    "b": torch.zeros(3),
    "num_batches_tracked": torch.tensor(0),
}


def _good():
    return {"w": torch.ones(2, 3), "b": torch.ones(3), "num_batches_tracked": torch.tensor(5)}


def _with(**changes):
    t = _good()
    for k, v in changes.items():
        if v is None:
            del t[k]
        else:
            t[k] = v
    return t


def test_check_tensors_accepts_matching_update():
    assert check_tensors(_good(), REF) is None
    assert check_tensors(_with(w=torch.ones(2, 3, dtype=torch.bfloat16)), REF) is None


@pytest.mark.parametrize(
    ("tensors", "reason", "name"),
    [
        (_with(extra=torch.ones(1)), RejectReason.UNEXPECTED_TENSOR, "extra"),
        (_with(b=None), RejectReason.MISSING_TENSOR, "b"),
        (_with(w=torch.ones(3, 2)), RejectReason.SHAPE_MISMATCH, "w"),
        (_with(b=torch.ones(3, dtype=torch.int64)), RejectReason.DTYPE_MISMATCH, "b"),
        (_with(num_batches_tracked=torch.tensor(1.0)), RejectReason.DTYPE_MISMATCH, "num_batches"),
        (_with(b=torch.tensor([0.0, math.nan, 0.0])), RejectReason.NON_FINITE, "b"),
        (_with(w=torch.full((2, 3), math.inf)), RejectReason.NON_FINITE, "w"),
        (_with(b=[0.0, 0.0, 0.0]), RejectReason.MALFORMED, "b"),
    ],
)
def test_check_tensors_rejections(tensors, reason, name):
    # Execute
    rej = check_tensors(tensors, REF)

    # Assert
    assert isinstance(rej, Rejection) and rej.reason is reason
    assert name in rej.detail


def test_reject_reason_values_are_strings():
    assert RejectReason.TOO_STALE == "too_stale"
    assert RejectReason("norm_outlier") is RejectReason.NORM_OUTLIER
    assert RejectReason("erased") is RejectReason.ERASED
    assert len(RejectReason) == 14


def test_norm_outlier_detector():
    # Prepare
    det = NormOutlierDetector(factor=10.0, window=3, min_history=3)

    # Execute / Assert: too little history -> accept anything finite
    assert det.check(100.0) is None
    for n in (1.0, 2.0, 3.0):
        det.observe(n)
    # median 2 -> threshold 20
    assert det.threshold() == 20.0
    assert det.check(20.0) is None
    rej = det.check(20.5)
    assert rej is not None and rej.reason is RejectReason.NORM_OUTLIER
    nan = det.check(math.nan)
    assert nan is not None and nan.reason is RejectReason.NON_FINITE
    # window 3: history becomes [2, 3, 100], median 3 -> threshold 30
    det.observe(100.0)
    assert det.history == [2.0, 3.0, 100.0] and det.threshold() == 30.0


def test_norm_outlier_round_trip(tmp_path):
    # Prepare
    det = NormOutlierDetector(factor=4.0, window=5, min_history=2)
    for n in (1.0, 5.0, 2.5):
        det.observe(n)

    # Execute
    save_checkpoint(tmp_path / "d.pt", det.state_dict())
    det2 = NormOutlierDetector()
    det2.load_state_dict(load_checkpoint(tmp_path / "d.pt"))

    # Assert
    assert det2.state_dict() == det.state_dict()
    assert det2.threshold() == det.threshold() == 10.0
