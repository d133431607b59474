"""The run's model snapshots: the global weights at each checkpoint, the newest few kept.

``fedasync export RUN_DIR --version N`` makes a MONAI bundle of any version kept here (or of
the checkpoint's, or of the best evaluated one, server/evaluation.py ``BestModel``). The
checkpoint holds one model and the whole loop's state, and only its newest is kept; a
snapshot is the weights alone: ``<run>/models/version-<N>.pt``, written at each checkpoint
(before it, so that a snapshot is never missing for a checkpoint's version), atomically and
sealed with its SHA-256 digest (fedasync.checkpoint). The newest ``server.keep_models`` are
kept (0: none).

- An erasure boundary deletes the snapshots of every earlier version (``drop(before=...)``):
  a model from before the boundary still carries the erased data, and no model the run keeps
  or exports may.
- A resumed run deletes those after its checkpoint's version (``drop(after=...)``): the
  run that wrote them went on past the checkpoint and stopped, and their versions are made
  again.
- A fresh run starts with none (server/app.py clears the folder).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from fedasync.checkpoint import load_checkpoint, save_checkpoint
from fedasync.errors import CheckpointError

log = logging.getLogger("fedasync.server")

MODELS_DIR = "models"
"""The snapshots' folder in the run folder."""
_NAME = re.compile(r"version-(\d+)\.pt")


def snapshot_name(version: int) -> str:
    """The file name of version ``version``'s snapshot."""
    return f"version-{version}.pt"


class ModelStore:
    """``folder``'s snapshots, the newest ``keep`` kept (see the module docstring)."""

    def __init__(self, folder: Path, keep: int):
        self.folder = folder
        self.keep = keep

    def versions(self) -> list[int]:
        """The versions kept, oldest first."""
        if not self.folder.is_dir():
            return []
        found = (_NAME.fullmatch(p.name) for p in self.folder.iterdir())
        return sorted(int(m.group(1)) for m in found if m is not None)

    def save(self, version: int, params: dict[str, torch.Tensor]) -> None:
        """Keep ``params`` as version ``version`` (the same version again replaces it), then
        delete the oldest beyond ``keep``."""
        if self.keep <= 0:
            return
        save_checkpoint(
            self.folder / snapshot_name(version), {"version": version, "params": params}
        )
        for old in self.versions()[: -self.keep]:
            self._delete(old)

    def load(self, version: int) -> dict[str, torch.Tensor]:
        """Version ``version``'s weights (verified); CheckpointError naming the file."""
        path = self.folder / snapshot_name(version)
        state = load_checkpoint(path)
        if state.get("version") != version or not isinstance(state.get("params"), dict):
            raise CheckpointError(f"model snapshot {path} does not hold version {version}")
        params: dict[str, Any] = state["params"]
        return params

    def drop(self, *, before: int | None = None, after: int | None = None) -> None:
        """Delete the snapshots of versions below ``before`` and above ``after``."""
        for v in self.versions():
            if (before is not None and v < before) or (after is not None and v > after):
                self._delete(v)

    def _delete(self, version: int) -> None:
        (self.folder / snapshot_name(version)).unlink(missing_ok=True)
