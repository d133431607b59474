"""The run shape every trainer follows, and the one function that drives it.

A trainer is a `Recipe` (a Protocol, in the style of torchtune's recipe interface: no base
class to inherit from): ``setup`` builds what it trains, ``run`` trains until done, stopping at
a safe point when asked, ``state_dict`` / ``load_state_dict`` give and take back everything a
resumed run needs, and ``summary`` says what the run measured.

`drive` does the rest, the same for every trainer:
1. the run folder (runkit.folder): a fresh run clears it, a resumed one reads its checkpoint,
   checks its config and truncates the event log;
2. ``setup``, then, on resume, ``load_state_dict`` with the checkpoint's state;
3. ``run`` under one signal handler (fedasync.interrupt.DeferredStop): the first Ctrl-C,
   SIGTERM or SIGHUP asks the recipe to stop at its next safe point (it calls
   ``stop.check()`` there); drive then writes a checkpoint and lets the
   :class:`fedasync.interrupt.Interrupted` go on, carrying the run folder and the checkpoint,
   so the command prints its one stop line and exits 128 + the signal;
4. the final checkpoint and ``summary.json``;
5. meanwhile, the metrics sinks follow the event log (runkit.sinks: every numeric field of
   every event, as ``<event>/<field>``, until the trainer has rows of its own in
   runkit.sinks.tags).

A recipe may also checkpoint as it goes (``folder.save_checkpoint(self.state_dict())``).
docs/architecture.md walks through a forty-line trainer written this way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from fedasync.events import EventLog
from fedasync.interrupt import DeferredStop, Interrupted
from runkit.folder import RunFolder
from runkit.keys import RunKeys
from runkit.sinks import following


class Recipe(Protocol):
    """What a trainer is to `drive`."""

    def setup(self, folder: RunFolder) -> None:
        """Build the model, data and optimiser; ``folder.events`` is open for events."""

    def run(self, stop: DeferredStop) -> None:
        """Train to the end, calling ``stop.check()`` at every point the state is whole."""

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs (tensors, numbers, lists, dicts)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (what `state_dict` gave)."""

    def summary(self) -> dict[str, Any]:
        """What the run measured, for summary.json."""


def folder_of(keys: RunKeys, **kwargs: Any) -> RunFolder:
    """The run folder ``<run.out_dir>/<run.name>`` (kwargs: RunFolder's ``owned``,
    ``may_differ``)."""
    return RunFolder(keys.out_dir, keys.name, **kwargs)


def drive(
    recipe: Recipe,
    keys: RunKeys,
    config: dict[str, Any],
    *,
    folder: RunFolder | None = None,
    grace_s: float = 10.0,
) -> dict[str, Any]:
    """Run ``recipe`` in its folder from start (or its checkpoint, with ``run.resume``) to its
    summary; see the module's docstring. ``config``: the whole config as plain dicts (kept in
    the checkpoint and the ``start`` event). Raises CheckpointError (resume without a usable
    checkpoint) before ``setup``, and Interrupted on a signal, with ``run_dir`` and
    ``checkpoint`` set."""
    folder = folder or folder_of(keys)
    state = folder.resume(config) if keys.resume else None
    if state is None:
        events = folder.start(config)
    else:
        assert folder.events is not None
        events = folder.events
    try:
        with following(keys, "trainer", folder.path, config=config):
            return _drive(recipe, folder, events, state, grace_s)
    finally:
        folder.close()


def _drive(
    recipe: Recipe,
    folder: RunFolder,
    events: EventLog,
    state: dict[str, Any] | None,
    grace_s: float,
) -> dict[str, Any]:
    """`drive`'s steps 2 to 4, once the folder is ready."""
    recipe.setup(folder)
    if state is not None:
        recipe.load_state_dict(state)
        events.write("resume")
    else:
        events.write("start", config=folder.config)
    with DeferredStop(grace_s) as stop:
        try:
            recipe.run(stop)
        except Interrupted as e:
            e.run_dir = folder.path
            if e.at_safe_point:
                folder.save_checkpoint(recipe.state_dict())
            e.checkpoint = _checkpoint_or_none(folder.checkpoint_path)
            raise
    folder.save_checkpoint(recipe.state_dict())
    summary = recipe.summary()
    events.write("end")
    folder.write_summary(summary)
    return summary


def _checkpoint_or_none(path: Path) -> Path | None:
    return path if path.is_file() else None
