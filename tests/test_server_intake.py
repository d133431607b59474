"""Strict decoding of reply arrays: exact round trips, and malformed payloads refused."""

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from server.intake import decode_arrays


def test_round_trip_matches_flower_decoder():
    # Prepare: C- and Fortran-ordered arrays, several dtypes
    arrays = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "f": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
        "i": np.array([7], dtype=np.int64),
        "s": np.array(2.5, dtype=np.float32),
    }
    record = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    # Execute
    ours = decode_arrays(record)
    theirs = record.to_torch_state_dict()
    # Assert
    assert list(ours) == list(theirs)
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k])


@pytest.mark.parametrize(
    "mutate",
    [
        lambda a: Array(dtype=a.dtype, shape=a.shape, stype=a.stype, data=a.data[:-4]),  # truncated
        lambda a: Array(dtype=a.dtype, shape=(5, 5), stype=a.stype, data=a.data),  # shape lies
        lambda a: Array(dtype="float64", shape=a.shape, stype=a.stype, data=a.data),  # dtype lies
        lambda a: Array(dtype=a.dtype, shape=a.shape, stype=a.stype, data=b"garbage" * 10),
        lambda a: Array(dtype=a.dtype, shape=a.shape, stype="torch.pickle", data=a.data),
        lambda a: Array(dtype="object", shape=a.shape, stype=a.stype, data=a.data),
    ],
)
def test_malformed_payload_is_refused(mutate):
    good = Array(np.ones((3, 4), dtype=np.float32))
    with pytest.raises((ValueError, TypeError)):
        decode_arrays(ArrayRecord({"w": mutate(good)}))
