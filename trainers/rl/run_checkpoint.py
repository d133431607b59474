"""The RL run's checkpoint (``checkpoint.pt``): composed of its parts' ``state_dict`` (the
learner, the weight snapshots, the clock, the schedule, the teacher scoring, the statistics and
the costs) and the version; restored part by part.

Paper: none. The run folder (runkit.folder) writes it atomically with the config and the event
log's length, checks on resume that only ``run.*`` differs, and cuts the event log back to it.
A file of an older fedasync rl (one flat dict, before the run kit) is refused with a
CheckpointError: start that run afresh.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainers.rl.config import to_container

if TYPE_CHECKING:
    from trainers.rl.engine import RLRun


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


def save_run(run: RLRun) -> Path:
    """``checkpoint.pt``: the version and each part's ``state_dict`` (the folder adds the
    config and the event log's length), written atomically; then the ``checkpoint`` event.
    Its path."""
    assert run.events is not None and run.learner_done_at is None
    state = {"version": run.version, **{name: p.state_dict() for name, p in parts(run).items()}}
    path = run.folder.save_checkpoint(state)
    run.checkpoint, run.checkpoint_version = path, run.version
    run.event("checkpoint", version=run.version, path=str(path))
    return path


def load_run(run: RLRun) -> None:
    """Restore the run from ``path``: every part, the event log cut to the checkpoint, the
    teacher started, the groups at the teacher and the rollouts in flight sent again."""
    s = run.folder.resume(to_container(run.cfg))
    run.events = run.folder.events
    run.version = int(s["version"])
    for name in ("learner", "snapshots", "clock", "stats", "costs"):
        parts(run)[name].load_state_dict(s[name])
    for v in run.snapshots.versions():
        snap = run.snapshots.get(v)
        assert snap is not None
        run.backend.publish(v, snap)
    inflight = run.schedule.load_state_dict(s["schedule"])
    run.event("resume", version=run.version, path=str(run.folder.checkpoint_path))
    run.scoring.start(run.backend.kind)
    run.scoring.load_state_dict(s["scoring"])  # the groups at it again, same times
    for job in inflight:  # the same groups again, under the same versions and times
        first = job.attempt == 0
        g = job.group_id
        run.backend.submit(job, die=first and g in run.die, nan=first and g in run.nan)
