"""A run's folder, ``<run.out_dir>/<run.name>``: it owns the event log, ``summary.json`` and
the checkpoint.

What every run command does with its folder, done once:
- a fresh run clears what an earlier run of the same name left (the files the command names
  as its own, nothing else);
- a resumed run reads the checkpoint (verified, fedasync.checkpoint), checks that it was
  written under a compatible config (`check_compatible`: only the keys the command lets
  differ, ``run.*`` by default, may), and truncates the event log to the byte offset the
  checkpoint recorded, so no event is reported twice;
- a checkpoint holds the config, the event log's offset and the run's own ``state_dict``;
- ``summary.json`` is written atomically, non-finite floats as null.

The folder knows nothing of what a run computes: the run gives it a ``state_dict`` to keep
and gets the same dict back on resume (runkit.recipe drives the two).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from fedasync.checkpoint import load_checkpoint, save_checkpoint
from fedasync.errors import CheckpointError
from fedasync.events import EventLog, json_safe, read_events

EVENTS = "metrics.jsonl"
"""The event log's name in the folder."""
SUMMARY = "summary.json"
"""The summary's name in the folder."""
CHECKPOINT = "checkpoint.pt"
"""The checkpoint's name in the folder."""
FORMAT = 1
"""The layout of a checkpoint written here: ``format``, ``config``, ``events_offset``,
``state`` (the run's own)."""


def flat_keys(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flat_keys(v, key + "."))
        else:
            out[key] = v
    return out


def check_compatible(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    may_differ: Iterable[str] = ("run",),
    *,
    what: str = "the checkpoint",
) -> None:
    """Raise CheckpointError naming the keys (at most five) where ``saved`` and ``current``
    configs differ, other than those under ``may_differ`` (dotted keys or section names)."""
    allowed = tuple(may_differ)
    a, b = flat_keys(saved), flat_keys(current)

    def free(key: str) -> bool:
        return any(key == p or key.startswith(p + ".") for p in allowed)

    differ = sorted(k for k in a.keys() | b.keys() if not free(k) and a.get(k) != b.get(k))
    if differ:
        shown = ", ".join(
            f"{k} ({str(a.get(k, '-'))[:40]} there, {str(b.get(k, '-'))[:40]} now)"
            for k in differ[:5]
        )
        more = f" and {len(differ) - 5} more" if len(differ) > 5 else ""
        raise CheckpointError(
            f"{what} was written by a run with another configuration: {shown}{more} "
            f"(only {', '.join(allowed) or 'nothing'} may differ on resume)"
        )


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` to ``path`` as indented strict JSON (non-finite floats as null),
    atomically: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(json_safe(obj), indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunFolder:
    """``<out_dir>/<name>``: the event log, summary.json and the checkpoint of one run.

    ``owned``: the names (files or folders; ``*`` patterns too) a fresh run clears, beyond the
    three above.
    ``may_differ``: the config keys a resumed run may change (`check_compatible`).
    """

    def __init__(
        self,
        out_dir: str | Path,
        name: str,
        *,
        owned: Iterable[str] = (),
        may_differ: Iterable[str] = ("run",),
    ) -> None:
        self.path = Path(out_dir) / name
        self.owned = (EVENTS, SUMMARY, CHECKPOINT, *owned)
        self.may_differ = tuple(may_differ)
        self.events: EventLog | None = None
        """The open event log (after `start` or `resume`)."""
        self.config: dict[str, Any] = {}
        """The run's config as plain dicts (kept in every checkpoint)."""

    @property
    def checkpoint_path(self) -> Path:
        """Where the checkpoint is (whether or not there is one yet)."""
        return self.path / CHECKPOINT

    @property
    def events_path(self) -> Path:
        """Where the event log is."""
        return self.path / EVENTS

    @property
    def summary_path(self) -> Path:
        """Where summary.json is."""
        return self.path / SUMMARY

    def start(self, config: dict[str, Any]) -> EventLog:
        """A fresh run: clear what an earlier run left, open an empty event log."""
        self.path.mkdir(parents=True, exist_ok=True)
        for name in self.owned:
            for p in self.path.glob(name) if "*" in name else [self.path / name]:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink(missing_ok=True)
        return self.open_events(config)

    def open_events(self, config: dict[str, Any]) -> EventLog:
        """Open the event log for appending as it is (a run that keeps checkpoints of its own
        and resumes from them; `keep_events` then drops what came after)."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.events = EventLog(self.events_path)
        return self.events

    def keep_events(self, keep: Callable[[dict[str, Any]], bool]) -> None:
        """Rewrite the event log with only the events ``keep`` accepts (atomically; a torn last
        line is dropped): a run resumed from a checkpoint of its own drops the events of the
        steps after it, so none is reported twice."""
        if not self.events_path.exists():
            return
        kept = [e for e in read_events(self.events_path, skip_bad=True) if keep(e)]
        reopen = self.events is not None
        self.close()
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".metrics-", suffix=".jsonl")
        try:
            with os.fdopen(fd, "w") as f:
                f.writelines(json.dumps(e) + "\n" for e in kept)
            os.replace(tmp, self.events_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        if reopen:
            self.events = EventLog(self.events_path)

    def resume(self, config: dict[str, Any]) -> dict[str, Any]:
        """A resumed run: the checkpoint's run state, once the checkpoint is verified and its
        config found compatible, with the event log truncated to the checkpoint's offset.
        Raises CheckpointError (no checkpoint, damaged, another config, another layout)."""
        path = self.checkpoint_path
        if not path.is_file():
            raise CheckpointError(f"run.resume=true but {path} does not exist")
        saved = load_checkpoint(path)
        if not isinstance(saved, dict) or saved.get("format") != FORMAT or "state" not in saved:
            raise CheckpointError(
                f"{path} was written by an older fedasync (another checkpoint layout; this one "
                f"reads run-folder format {FORMAT}): start the run afresh (without run.resume)"
            )
        check_compatible(saved["config"], config, self.may_differ, what=str(path))
        self.config = config
        self.events = EventLog(self.events_path)
        self.events.truncate(int(saved["events_offset"]))
        state = saved["state"]
        assert isinstance(state, dict)
        return state

    def save_checkpoint(self, state: dict[str, Any]) -> Path:
        """Write the checkpoint atomically: the config, the event log's offset, ``state``."""
        assert self.events is not None, "start or resume the folder first"
        save_checkpoint(
            self.checkpoint_path,
            {
                "format": FORMAT,
                "config": self.config,
                "events_offset": self.events.offset(),
                "state": state,
            },
        )
        return self.checkpoint_path

    def write_summary(self, summary: dict[str, Any]) -> Path:
        """Write summary.json atomically (a reader never sees half of one)."""
        write_json(self.summary_path, summary)
        return self.summary_path

    def read_events(self) -> list[dict[str, Any]]:
        """The events so far (a torn last line left out)."""
        return read_events(self.events_path) if self.events_path.exists() else []

    def close(self) -> None:
        """Close the event log (fsync)."""
        if self.events is not None:
            self.events.close()
            self.events = None
