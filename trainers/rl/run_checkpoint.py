"""The RL run's checkpoint (``checkpoint.pt``): composed of its parts' ``state_dict`` (the
learner, the weight snapshots, the clock, the schedule, the teacher scoring, the statistics and
the costs), with the config, the version and the event log's length; restored part by part.

Paper: none. The file is written atomically by :func:`fedasync.checkpoint.save_checkpoint`.
Format 2 (this one) keeps each part under its own key; a format-1 file (one flat dict, before
the engine was split) is refused with a CheckpointError: start that run afresh.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedasync.checkpoint import load_checkpoint, save_checkpoint
from fedasync.errors import CheckpointError
from fedasync.events import EventLog
from trainers.rl.config import to_container

if TYPE_CHECKING:
    from trainers.rl.engine import RLRun

CHECKPOINT_FORMAT = 2
"""Version 2: each part's ``state_dict`` under its own key (1: one flat dict, not read)."""


def parts(run: RLRun) -> dict[str, Any]:
    """The parts a checkpoint holds, by key: each has ``state_dict``/``load_state_dict``."""
    return {
        "learner": run.learner,
        "snapshots": run.snapshots,
        "clock": run.clock,
        "schedule": run.schedule,
        "scoring": run.scoring,
        "stats": run.stats,
        "costs": run.costs,
    }


def save_run(run: RLRun, path: Path) -> None:
    """``checkpoint.pt``: the config, the version, each part's ``state_dict`` and the
    event log's length, written atomically; then the ``checkpoint`` event."""
    assert run.events is not None and run.learner_done_at is None
    state = {
        "format": CHECKPOINT_FORMAT,
        "config": to_container(run.cfg),
        "version": run.version,
        **{name: part.state_dict() for name, part in parts(run).items()},
        "events_offset": run.events.offset(),
    }
    save_checkpoint(path, state)
    run.checkpoint, run.checkpoint_version = path, run.version
    run.event("checkpoint", version=run.version, path=str(path))


def load_run(run: RLRun, path: Path) -> None:
    """Restore the run from ``path``: every part, the event log cut to the checkpoint, the
    teacher started, the groups at the teacher and the rollouts in flight sent again."""
    s = load_checkpoint(path)
    if s.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{path} was written by an older fedasync rl (checkpoint format "
            f"{s.get('format', 1)}, this one reads {CHECKPOINT_FORMAT}): start the run "
            "afresh (without run.resume)"
        )
    if s["config"] != {**to_container(run.cfg), "run": s["config"]["run"]}:
        raise CheckpointError(
            f"{path} was written by a run with another configuration (only run.* may differ)"
        )
    run.version = int(s["version"])
    for name in ("learner", "snapshots", "clock", "stats", "costs"):
        parts(run)[name].load_state_dict(s[name])
    for v in run.snapshots.versions():
        snap = run.snapshots.get(v)
        assert snap is not None
        run.backend.publish(v, snap)
    inflight = run.schedule.load_state_dict(s["schedule"])
    run.events = EventLog(run.run_dir / "metrics.jsonl")
    run.events.truncate(int(s["events_offset"]))
    run.event("resume", version=run.version, path=str(path))
    run.scoring.start(run.backend.kind)
    run.scoring.load_state_dict(s["scoring"])  # the groups at it again, same times
    for job in inflight:  # the same groups again, under the same versions and times
        first = job.attempt == 0
        g = job.group_id
        run.backend.submit(job, die=first and g in run.die, nan=first and g in run.nan)
