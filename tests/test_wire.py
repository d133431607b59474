"""The tensor wire format: exact round trips, packed and not, and malformed payloads refused."""

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from protocol import wire


def _model_like():
    return {
        "conv.weight": torch.randn(4, 1, 3, 3),
        "conv.bias": torch.randn(4),
        "norm.weight": torch.ones(4),
        "steps": torch.tensor(7, dtype=torch.int64),
        "head.weight": torch.randn(3, 4).t(),  # non-contiguous
        "scalar": torch.tensor(2.5),
    }


def test_packed_round_trip_is_exact():
    tensors = _model_like()
    record = wire.encode(tensors)
    assert set(record.keys()) == {wire.PACKED, wire.MANIFEST, "steps"}  # one array for all floats
    out = wire.decode(record)
    assert set(out) == set(tensors)
    for k, v in tensors.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and torch.equal(out[k], v)


def test_mixed_float_dtypes_travel_unpacked():
    tensors = {"a": torch.randn(3), "b": torch.randn(2).double()}
    record = wire.encode(tensors)
    assert wire.PACKED not in record.keys()
    out = wire.decode(record)
    assert all(torch.equal(out[k], tensors[k]) for k in tensors)


def test_plain_flower_records_decode_like_flower():
    arrays = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "f": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
        "i": np.array([7], dtype=np.int64),
    }
    record = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    ours, theirs = wire.decode(record), record.to_torch_state_dict()
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k])


def _corrupt(record, key, **changes):
    a = record[key]
    fields = {"dtype": a.dtype, "shape": a.shape, "stype": a.stype, "data": a.data, **changes}
    record[key] = Array(**fields)
    return record


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: _corrupt(r, wire.PACKED, data=r[wire.PACKED].data[:-4]),  # truncated
        lambda r: _corrupt(r, wire.PACKED, shape=(5,)),  # shape lies
        lambda r: _corrupt(r, wire.PACKED, dtype="float64"),  # dtype lies
        lambda r: _corrupt(r, wire.PACKED, data=b"garbage" * 10),
        lambda r: _corrupt(r, wire.PACKED, stype="torch.pickle"),
        lambda r: _corrupt(r, wire.PACKED, dtype="object"),
        lambda r: _corrupt(
            r, wire.MANIFEST, data=Array(np.frombuffer(b"{not json", np.uint8)).data, shape=(9,)
        ),
        lambda r: r.pop(wire.MANIFEST) and r,  # packed without manifest
        lambda r: r.__setitem__("__evil__", Array(np.zeros(1, np.float32))) or r,  # reserved name
    ],
)
def test_malformed_payload_is_refused(mutate):
    record = mutate(wire.encode(_model_like()))
    with pytest.raises((ValueError, TypeError)):
        wire.decode(record)
