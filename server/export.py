"""``fedasync export RUN_DIR --version N``: a MONAI bundle of any version a run folder keeps.

A run folder keeps the weights of these versions: the newest ``server.keep_models``
snapshots (``<run>/models/``, server/models.py), the checkpoint's (``checkpoint.pt``) and the
best evaluated one (kept in the checkpoint). ``kept_versions`` lists them, ``export`` writes
the bundle (server/bundle.py) from them, the run's description (``<run>/models/run.json``),
its evaluations (the ``eval`` events of metrics.jsonl) and its erasure store (the erasure
requests the version honours, and those applied after it, which it does not). A version not
kept is a UserError naming the versions that are.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from fedasync.errors import CheckpointError
from fedasync.events import read_events
from runkit.configload import bounded
from server.bundle import (
    BUNDLE_DIR,
    erasures_at,
    evaluation_of,
    read_run_info,
    write_bundle,
)
from server.checkpoint import CHECKPOINT_FILE, CheckpointState, load_state
from server.models import MODELS_DIR, ModelStore, snapshot_name

log = logging.getLogger("fedasync.server")

SHOWN = 20
"""How many kept versions an error names (the newest)."""


def _checkpoint(run_dir: Path) -> CheckpointState | None:
    path = run_dir / CHECKPOINT_FILE
    return load_state(path) if path.exists() else None


def kept_versions(run_dir: Path, state: CheckpointState | None) -> dict[int, str]:
    """Every version whose weights ``run_dir`` keeps, and where: ``snapshot``,
    ``checkpoint`` or ``best`` (the first of these that has it); ``state``: its checkpoint."""
    out = {v: "snapshot" for v in ModelStore(run_dir / MODELS_DIR, 0).versions()}
    if state is not None:
        out.setdefault(state.version, "checkpoint")
        best = state.parts.get("best")
        if best is not None:
            out.setdefault(int(best["version"]), "best")
    return dict(sorted(out.items()))


def load_version(run_dir: Path, version: int) -> dict[str, torch.Tensor]:
    """Version ``version``'s weights from ``run_dir``; CheckpointError (a UserError) naming
    the versions kept when it is not."""
    store = ModelStore(run_dir / MODELS_DIR, 0)
    if (store.folder / snapshot_name(version)).is_file():
        return store.load(version)
    state = _checkpoint(run_dir)
    kept = kept_versions(run_dir, state)
    where = kept.get(version)
    if where == "checkpoint" and state is not None:
        return dict(state.params)
    if where == "best" and state is not None:
        return dict(state.parts["best"]["params"])
    shown = list(kept)[-SHOWN:]
    listed = ", ".join(map(str, shown)) if shown else "none"
    more = f" (the newest {SHOWN} of {len(kept)})" if len(kept) > SHOWN else ""
    raise CheckpointError(
        f"version {version} is not kept in {bounded(run_dir, 200)}: versions kept{more}: {listed} "
        "(server.keep_models snapshots, the checkpoint's and the best evaluated one)"
    )


def export(run_dir: Path, version: int, out: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Write the bundle of ``version`` to ``out`` (default ``<run>/bundle/version-<N>``);
    the folder and what the bundle says of erasures (``honoured``, ``applied_later``).
    An ``out`` that exists and is not empty is refused (only a bundle folder of the run's
    own is replaced)."""
    info = read_run_info(run_dir)  # first: a folder that is no run says so
    params = load_version(run_dir, version)
    folder = out if out is not None else run_dir / BUNDLE_DIR / f"version-{version}"
    ours = folder.resolve().parent == (run_dir / BUNDLE_DIR).resolve()
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())) and not ours:
        raise CheckpointError(
            f"--out {bounded(folder, 200)} exists and is not empty: name a new folder"
        )
    events = run_dir / "metrics.jsonl"
    evals = (
        [e for e in read_events(events, skip_bad=True) if e.get("event") == "eval"]
        if events.exists()
        else []
    )
    erasures = _erasures(run_dir, version)
    write_bundle(
        folder,
        params,
        version,
        info,
        selected="export",
        evaluation=evaluation_of(evals, version, info),
        erasures=erasures,
    )
    return folder, erasures


def _erasures(run_dir: Path, version: int) -> dict[str, Any]:
    """What the run's erasure store says of ``version`` (none without a store)."""
    path = run_dir / "erasures.sqlite"
    if not path.exists():
        return erasures_at(None, version)
    from server.erasure.store import ErasureStore

    with ErasureStore(path) as store:
        return erasures_at(store, version)
