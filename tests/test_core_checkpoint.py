import os
import zipfile

import pytest
import torch

from fedasync.checkpoint import load_checkpoint, save_checkpoint, seal, state_digest
from fedasync.errors import CheckpointError


def _assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_checkpoint_round_trip_and_atomic_overwrite(tmp_path):
    # Prepare
    state = {
        "version": 12,
        "params": {"w": torch.randn(3, 2), "n": torch.tensor(4)},
        "silos": ["a", "b"],
        "nested": {"weights": [0.5, 1.0], "name": "run", "flag": True, "none": None},
    }
    path = tmp_path / "sub" / "ckpt.pt"

    # Execute
    save_checkpoint(path, {"old": 1})
    save_checkpoint(path, state)
    loaded = load_checkpoint(path)

    # Assert
    _assert_same(loaded, state)
    assert os.listdir(path.parent) == ["ckpt.pt"]  # no temp files left behind


def _tensor_record_offset(path) -> int:
    """Byte offset of the first tensor's data inside a torch zip (its headers left intact)."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename and i.file_size >= 16)
    raw = path.read_bytes()
    name_len = int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    return info.header_offset + 30 + name_len + extra_len


@pytest.mark.parametrize("fill", [b"\x00", b"\xff"])
def test_overwritten_tensor_bytes_are_refused(tmp_path, fill):
    # Prepare: zip headers and pickle intact, 16 bytes of the tensor data overwritten
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"params": {"w": torch.full((8, 8), 0.5)}, "version": 3})
    raw = bytearray(path.read_bytes())
    at = _tensor_record_offset(path)
    raw[at : at + 16] = fill * 16
    path.write_bytes(bytes(raw))

    # Execute / Assert: zeros are finite, so only the digest can tell
    with pytest.raises(CheckpointError, match=r"ckpt\.pt.*digest"):
        load_checkpoint(path)


def test_truncated_and_missing_checkpoints_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"params": {"w": torch.randn(32, 32)}})
    path.write_bytes(path.read_bytes()[:500])

    with pytest.raises(CheckpointError, match=r"ckpt\.pt"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"nothere\.pt"):
        load_checkpoint(tmp_path / "nothere.pt")


def test_non_finite_values_are_refused_naming_the_key(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"params": {"w": torch.tensor([1.0, float("nan")])}})

    with pytest.raises(CheckpointError, match=r"params\.w.*non-finite"):
        load_checkpoint(path)


def test_checkpoint_without_digest_is_refused_until_sealed(tmp_path):
    # Prepare: a checkpoint written before digests were stored (a plain torch.save)
    path = tmp_path / "old.pt"
    state = {"params": {"w": torch.randn(4)}, "version": 7}
    torch.save(state, path)

    # Execute / Assert: refused, then sealed by the command the message names, then loaded
    with pytest.raises(CheckpointError, match="fedasync checkpoint seal"):
        load_checkpoint(path)
    seal(path)
    _assert_same(load_checkpoint(path), state)


def test_seal_refuses_a_non_finite_checkpoint(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"w": torch.tensor([float("inf")])}, path)

    with pytest.raises(CheckpointError, match="non-finite"):
        seal(path)
    with pytest.raises(CheckpointError, match="no digest"):
        load_checkpoint(path)


def test_digest_covers_every_kind_of_value():
    # Prepare
    base = {"t": torch.arange(4.0), "i": 3, "f": 0.5, "s": "a", "l": [1, (2, None)], "b": True}

    # Execute / Assert: any change anywhere changes the digest; equal content, equal digest
    same = {**base, "t": torch.arange(4.0)}
    assert state_digest(base) == state_digest(same)
    for change in (
        {"t": torch.arange(4.0).double()},
        {"t": torch.arange(4.0).reshape(2, 2)},
        {"i": 4},
        {"i": 3.0},
        {"f": 0.25},
        {"s": "b"},
        {"l": [1, [2, None]]},
        {"b": 1},
    ):
        assert state_digest({**base, **change}) != state_digest(base), change
