"""How an RL run ends: its backends closed, its outputs written (``policy.pt``, ``hf_policy/``
for an HF policy, the ``end`` event, ``summary.json``), a checkpoint of the finished run when a
signal comes while they are written, and where a stop happened (for the command's stop line).

Paper: none. :meth:`trainers.rl.engine.RLRun.run` calls these in that order.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedasync.interrupt import Interrupted, shielded
from fedasync.tensors import to_cpu
from trainers.rl.config import to_container
from trainers.rl.run_checkpoint import save_run

if TYPE_CHECKING:
    from trainers.rl.engine import RLRun

log = logging.getLogger("fedasync.rl")


def close_all(run: RLRun, bar: Any, stopping: bool) -> None:
    """Close the progress bar and the backends; ``stopping``: an error in doing so (a Ray
    the signal reached) is logged, not raised."""
    for close in (
        bar.close if bar is not None else None,
        run.scoring.close,
        run.backend.close,
    ):
        if close is None:
            continue
        try:
            close()
        except Exception as e:
            if not stopping:
                raise
            log.info("closing during the stop: %s: %s", type(e).__name__, str(e)[:200])


def write_outputs(run: RLRun) -> dict[str, Any]:
    """``policy.pt``, the ``end`` event and ``summary.json``; the summary."""
    summary = run.summary()
    torch.save(to_cpu(dict(run.policy.state_dict())), run.run_dir / "policy.pt")
    if run.cfg.policy.kind == "hf":  # and <run>/hf_policy/, loadable with policy.hf_path
        from trainers.rl.hf import export_policy

        export_policy(run.policy, run.run_dir)
    run.event("end", version=run.version, **{k: summary[k] for k in ("final_accuracy",)})
    run.folder.close()
    run.events = None
    run.folder.write_summary(summary)
    return summary


def save_finished(run: RLRun) -> Path:
    """A checkpoint of the finished run (a signal stopped it while it wrote its outputs or
    drew its plots): resuming from it writes them again. Its path."""
    with shielded():
        if run.events is None:
            run.events = run.folder.open_events(to_container(run.cfg))
        path = save_run(run)
        run.folder.close()
        run.events = None
    return path


def note_stop(run: RLRun, e: BaseException) -> None:
    """Say on ``e`` (an Interrupted) where the run stopped and its checkpoint."""
    if not isinstance(e, Interrupted):
        return
    e.run_dir, e.checkpoint = run.run_dir, run.checkpoint
    if run.phase == "start-up":
        e.where = "during start-up"
    elif run.phase == "finishing":
        e.where = f"after training ({run.version} versions), writing its outputs"
    elif run.phase == "plots":
        e.where = f"after training ({run.version} versions), drawing its plots"
    else:
        e.where = f"at version {run.version} (t={run.clock.now:.1f} s {run.clock.kind})"
    if run.checkpoint is not None and run.checkpoint_version not in (None, run.version):
        e.where += f", the last checkpoint at version {run.checkpoint_version}"
