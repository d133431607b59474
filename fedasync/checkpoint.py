"""Atomic, verified checkpoint files for the core's state dicts.

No paper. Departures from a plain ``torch.save``:

- Atomic: the file is written to a temporary file in the same directory, fsynced, then moved
  into place with ``os.replace``, so a crash never leaves a half-written checkpoint under the
  final name.
- Verified: the file holds ``{"fedasync_checkpoint": 1, "sha256": ..., "state": state}``, the
  digest being SHA-256 over the state's content (every tensor's dtype, shape and bytes, every
  number, string and container, in order; see :func:`state_digest`). It lives inside the file,
  so it is written by the same atomic replace. Loading recomputes it and refuses a mismatch:
  tensor bytes overwritten behind intact zip headers (which ``torch.load`` accepts) are
  caught, and so are truncated or unreadable files.
- Finite: a state with a NaN or infinite value in any floating tensor is refused (naming the
  key): resuming it would make every later update non-finite.
- Files without a digest (written before digests existed) are refused too, since damage in
  them cannot be detected; :func:`seal` (``fedasync checkpoint seal FILE``) adds the digest
  to such a file after checking that its values are finite: the user's explicit "I trust
  this file".

Loading uses ``weights_only=True``: states must be made of tensors, numbers, strings, bools,
None, lists, tuples and dicts (all ``state_dict()`` methods of this package comply). Every
refusal is a :class:`fedasync.errors.CheckpointError` whose message names the file.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from fedasync.errors import CheckpointError
from fedasync.flat import FlatParams

ENVELOPE = "fedasync_checkpoint"
"""Key marking a verified checkpoint file; its value is the envelope's format number."""
ENVELOPE_FORMAT = 1


def state_digest(state: Any) -> str:
    """Hex SHA-256 of a state's content: tensors (dtype, shape, bytes), numbers, strings,
    bools, None, lists, tuples and dicts (keys and values, in order)."""
    h = hashlib.sha256()
    _feed(h, state)
    return h.hexdigest()


def _feed(h: Any, x: Any) -> None:
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(x, Mapping):
        h.update(f"D{len(x)}:".encode())
        for k, v in x.items():
            _feed(h, k)
            _feed(h, v)
    elif isinstance(x, list | tuple):
        h.update(f"{'L' if isinstance(x, list) else 'U'}{len(x)}:".encode())
        for v in x:
            _feed(h, v)
    elif isinstance(x, float):
        h.update(f"F{x.hex()};".encode())
    else:  # bool, int, str, bytes, None; dtypes, devices and the like have stable reprs
        h.update(f"{type(x).__name__}{x!r};".encode())


def _non_finite_key(x: Any, prefix: str = "") -> str | None:
    """Dotted key of the first floating tensor holding a NaN or infinity, or None."""
    if isinstance(x, torch.Tensor):
        if (x.is_floating_point() or x.is_complex()) and not bool(torch.isfinite(x).all()):
            return prefix or "<state>"
        return None
    items: Any = ()
    if isinstance(x, Mapping):
        items = x.items()
    elif isinstance(x, list | tuple):
        items = enumerate(x)
    for k, v in items:
        found = _non_finite_key(v, f"{prefix}.{k}" if prefix else str(k))
        if found is not None:
            return found
    return None


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Atomically write ``state`` with its digest to ``path`` (creating the parent directory).
    Flat parameters (:class:`fedasync.flat.FlatParams`) are written as plain dicts."""
    state = _plain(state)
    _write(
        os.fspath(path), {ENVELOPE: ENVELOPE_FORMAT, "sha256": state_digest(state), "state": state}
    )


def _plain(obj: Any) -> Any:
    """``obj`` with every FlatParams in it a plain dict (``weights_only`` loads no subclass)."""
    if isinstance(obj, FlatParams):
        return dict(obj)
    if type(obj) is dict:
        return {k: _plain(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_plain(v) for v in obj)
    return obj


def _write(path: str, obj: dict[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename durable; not supported on every platform
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _read(path: str) -> Any:
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not a zip, a damaged pickle, a disallowed type
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({first}): it is damaged or not a fedasync "
            "checkpoint; restore it from a copy, or delete it to start afresh"
        ) from e


def _refuse_non_finite(path: str, state: Any) -> None:
    key = _non_finite_key(state)
    if key is not None:
        raise CheckpointError(
            f"checkpoint {path}: {key} holds non-finite values (NaN or inf), so every update "
            "based on it would be too; resume from an earlier copy, or delete it to start afresh"
        )


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and verify a checkpoint written by :func:`save_checkpoint` onto the CPU.

    Raises CheckpointError (naming the file and what to do) when the file is missing,
    unreadable, does not match its digest, has no digest, or holds non-finite values.
    """
    path = os.fspath(path)
    obj = _read(path)
    if not (isinstance(obj, dict) and ENVELOPE in obj):
        raise CheckpointError(
            f"checkpoint {path} has no digest (written before checkpoints carried one), so "
            "damage to it cannot be detected; if you trust it, run "
            f"`fedasync checkpoint seal {path}`, or delete it to start afresh"
        )
    if obj[ENVELOPE] != ENVELOPE_FORMAT or not isinstance(obj.get("state"), dict):
        raise CheckpointError(
            f"checkpoint {path} is of envelope format {obj[ENVELOPE]!r}, this fedasync reads "
            f"{ENVELOPE_FORMAT}; use the fedasync that wrote it, or delete it to start afresh"
        )
    state = obj["state"]
    if state_digest(state) != obj.get("sha256"):
        raise CheckpointError(
            f"checkpoint {path} does not match its SHA-256 digest: its bytes were changed after "
            "it was written; restore it from a copy, or delete it to start afresh"
        )
    _refuse_non_finite(path, state)
    return state


def seal(path: str | os.PathLike[str]) -> None:
    """Add a digest to a checkpoint written without one (after checking it is finite)."""
    path = os.fspath(path)
    obj = _read(path)
    if isinstance(obj, dict) and ENVELOPE in obj:
        load_checkpoint(path)  # already sealed: verify it instead
        return
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(obj).__name__}, not a dict")
    _refuse_non_finite(path, obj)
    save_checkpoint(path, obj)
