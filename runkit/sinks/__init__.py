"""The metrics sinks: a run's event log followed live into TensorBoard (by default) and MLflow.

Every run kind writes its events to ``metrics.jsonl`` (fedasync.events), the source of truth;
the sinks derive from it, so a run's code knows nothing of them. `following` wraps a run
command's run (``fedasync simulate``, ``deploy local``, ``node``, ``rl``, ``pipeline``,
``market``, and `runkit.recipe.drive`): a thread tails the logs (runkit.tail) and writes each
event's scalars, by the one table of tag names (runkit.sinks.tags), to

- TensorBoard event files in ``<run folder>/tensorboard`` (``tensorboard`` in ``run.trackers``, on by default;
  runkit.sinks.tensorboard_sink), and
- MLflow (``mlflow`` in ``run.trackers``, off by default; ``run.mlflow_uri``, by default a local store in the
  run folder; runkit.sinks.mlflow_sink),

then the run's PNGs as images at the end. A sink that fails is logged once and dropped; the
run goes on. docs/metrics.md lists every tag.
"""

from runkit.sinks.follow import (
    TENSORBOARD_DIR,
    Follower,
    following,
    sinks_for,
    start_following,
)

__all__ = ["TENSORBOARD_DIR", "Follower", "following", "sinks_for", "start_following"]
