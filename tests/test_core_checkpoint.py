import os

import torch

from fedasync.checkpoint import load_checkpoint, save_checkpoint


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
