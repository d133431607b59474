"""A server's checkpoint: what it holds, how it is written, read and checked.

A checkpoint is everything the loop needs to continue as if it had never stopped
(``CheckpointState``): the global weights and version, the jobs in flight (re-sent
identically), the byte offset of metrics.jsonl, the loop's own state (the clock, the budget's
origin) and, under ``parts``, each part's ``state_dict`` by name (``compose``; ``restore``
hands each back its own). The loop (server/loop.py) names its parts and writes and resumes
checkpoints; this module knows no part. All randomness is derived from (seed, silo, job id),
so there is no generator state to save. Files are written atomically with a SHA-256 digest
and verified when read (fedasync.checkpoint); ``check_resumable`` tells, before any engine
starts, whether a run can continue from one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import torch

from fedasync.checkpoint import load_checkpoint, save_checkpoint
from fedasync.errors import CheckpointError

FORMAT = 2
"""Format 2: the server's state is its own (``loop``) plus each part's ``state_dict``."""
CHECKPOINT_FILE = "checkpoint.pt"
"""The checkpoint's name in the run folder (``<run.out_dir>/<run.name>/checkpoint.pt``)."""


@dataclass
class CheckpointState:
    """A server checkpoint as ``server_state`` returns it, typed where it is read
    before a server exists (the mode and the model, checked by ``check_resumable``)."""

    mode: str
    version: int
    params: dict[str, Any]
    jobs: list[dict[str, Any]]
    """The train jobs in flight, to re-send identically."""
    events_offset: int
    """metrics.jsonl's length at the checkpoint (a resume truncates what came after)."""
    loop: dict[str, Any] = field(default_factory=dict)
    parts: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The fields as ``load_server_state`` takes them."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_dict(self) -> dict[str, Any]:
        """What the file holds: the fields and the format."""
        return {"format": FORMAT, **self.as_dict()}


def save_state(path: Path, state: CheckpointState) -> None:
    """Write ``state`` to ``path`` atomically, sealed with its digest."""
    save_checkpoint(path, state.to_dict())


def load_state(path: Path) -> CheckpointState:
    """The verified server state in ``path``; CheckpointError (naming the file) otherwise."""
    d = load_checkpoint(path)
    if d.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} is of server format {d.get('format')!r}, this fedasync reads "
            f"{FORMAT}; use the fedasync that wrote it, or set run.resume=false"
        )
    d.pop("format")
    try:
        return CheckpointState(**d)
    except TypeError as e:
        raise CheckpointError(
            f"checkpoint {path} does not hold a server state ({e}); set run.resume=false"
        ) from e


def check_resumable(path: Path, mode: str, model: dict[str, torch.Tensor]) -> None:
    """Refuse, before anything starts, a checkpoint a run of ``mode`` whose global model has
    the keys, shapes and dtypes of ``model`` cannot continue from: missing a digest, damaged,
    non-finite, of another server mode, or of another model. A missing file is fine (the run
    starts afresh). Raises CheckpointError naming the file and the key to change."""
    if not path.exists():
        return
    state = load_state(path)
    check_mode(path, state, mode)
    have = {k: (tuple(v.shape), v.dtype) for k, v in state.params.items()}
    want = {k: (tuple(v.shape), v.dtype) for k, v in model.items()}
    if have != want:
        differ = sorted(set(have) ^ set(want)) or sorted(k for k in have if have[k] != want[k])
        raise CheckpointError(
            f"checkpoint {path} holds another model than this run's (first difference: "
            f"{differ[0]}); set data.benchmark/data.network as in the run that wrote it, "
            "or run.resume=false"
        )


class Stateful(Protocol):
    """A part of the server that a checkpoint holds: what it is, and how it comes back."""

    def state_dict(self) -> Any:
        """The part's state (None: nothing to keep)."""
        ...

    def load_state_dict(self, state: Any) -> None:
        """Restore what ``state_dict`` returned."""
        ...


@dataclass
class Part:
    """A part whose state is read through callables: ``Stateful`` for one that needs more
    than itself to say its state (the dispatcher, the model and its version)."""

    state: Callable[[], Any]
    load: Callable[[Any], None]

    def state_dict(self) -> Any:
        """``state()``."""
        return self.state()

    def load_state_dict(self, state: Any) -> None:
        """``load(state)``."""
        self.load(state)


def compose(parts: Mapping[str, Stateful]) -> dict[str, Any]:
    """Each part's ``state_dict`` under its name, as ``torch.optim.Optimizer`` combines its
    groups."""
    return {name: part.state_dict() for name, part in parts.items()}


def restore(parts: Mapping[str, Stateful], saved: Mapping[str, Any]) -> None:
    """Hand each part back its own, in ``parts``' order. A part the checkpoint has no state
    for (None: a run that could not erase, no evaluation scored yet; absent: written before
    the part existed) keeps the fresh state it was built with."""
    for name, part in parts.items():
        if saved.get(name) is not None:
            part.load_state_dict(saved[name])


def check_mode(path: Path, state: CheckpointState, mode: str) -> None:
    """CheckpointError when ``state`` (read from ``path``) is not of ``server.mode=mode``."""
    if state.mode != mode:
        raise CheckpointError(
            f"checkpoint {path} is of server.mode={state.mode}, the run is "
            f"server.mode={mode}; set server.mode={state.mode}, or run.resume=false"
        )
