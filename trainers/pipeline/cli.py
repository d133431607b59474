"""``fedasync pipeline [--config FILE] [key=value ...]``: one pipeline-parallel training run.

Prints one line and writes the run folder (:mod:`trainers.pipeline.run`). Config errors are
one line, exit 2 (``fedasync.errors.UserError``); a stage that fails or dies is named
(exit 1), and ``run.resume=true`` continues from the last checkpoint.

Ctrl-C (SIGINT), SIGTERM or SIGHUP at any moment: the stage processes (which ignore SIGINT)
checkpoint a common step when they can and are stopped, and one line on stderr says where the
run stopped, the last step every stage has a checkpoint of and the command that resumes from
it (or that there is none yet, and the run starts afresh); exit 128 + the signal's number
(130, 143, 129), without a traceback.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from typing import Any

from fedasync.interrupt import (
    Interrupted,
    exit_now,
    interruptible,
    resume_or_afresh,
    signal_of,
    stop_line,
)
from trainers.pipeline.config import PipelineConfig, load_pipeline_config


def add_parser(sub: Any) -> None:
    """Add the ``pipeline`` subcommand to the ``fedasync`` parser."""
    p = sub.add_parser(
        "pipeline", help="pipeline-parallel training: GPipe, 1F1B, PipeDream-2BW, PACI"
    )
    p.add_argument("--config", help="YAML config file (default: the built-in defaults)")
    p.add_argument("--verbose", action="store_true", help="log INFO to the console too")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. pipeline.schedule=1f1b")


def run(args: argparse.Namespace) -> int:
    """Run ``fedasync pipeline``; the exit code."""
    from trainers.pipeline.dist import StageFailed
    from trainers.pipeline.run import run_config

    if args.verbose:
        logging.getLogger("fedasync").setLevel(logging.INFO)
    cfg: PipelineConfig | None = None
    stopped: tuple[str, int] | None = None
    try:
        with interruptible():
            cfg = load_pipeline_config(args.config, args.overrides)  # a UserError: exit 2
            try:
                s = run_config(cfg)
            except StageFailed as e:
                print(
                    f"fedasync pipeline: {e}; rerun with run.resume=true to continue from the "
                    "last checkpoint"
                )
                return 1
    except KeyboardInterrupt as e:
        stopped = _stopped(args, e), signal_of(e)[1]
    if stopped is not None:  # out of the except: the run's queues are let go (no leak warning)
        gc.collect()
        print(stopped[0], file=sys.stderr)
        exit_now(stopped[1])
    meas = s.get("measured") or {}
    mem = ", ".join(
        f"{m['activation_peak_bytes'] / 2**20:.1f}+{m['weight_peak_bytes'] / 2**20:.1f}"
        for m in s["memory"]
    )
    print(
        f"pipeline {s['schedule']} (P={s['stages']}, m={s['micro']}, {s['optimizer']}, "
        f"{s['backend']} on {s['device']}): steps {s['start']}->{s['steps']} in "
        f"{s['wall_s']:.1f} s, {s['tokens_per_s']:.0f} tokens/s, held-out loss "
        f"{(s['final_val_loss'] or float('nan')):.3f}, bubble "
        f"{meas.get('bubble_fraction', float('nan')):.2f} (simulated "
        f"{meas.get('simulated', {}).get('bubble_fraction', float('nan')):.2f}), "
        f"max drift {s['max_drift_seen']}, peak MiB activations+weights per stage [{mem}]; "
        f"run folder {s['run_dir']}"
    )
    return 0


def _stopped(args: argparse.Namespace, e: KeyboardInterrupt) -> str:
    """The stop line: where, the checkpoint and the command that resumes (or that none is)."""
    where = (e.where if isinstance(e, Interrupted) else "") or "during start-up"
    ckpt = e.checkpoint if isinstance(e, Interrupted) else None
    return stop_line(
        "pipeline", e, where, resume_or_afresh("pipeline", args.config, args.overrides, ckpt)
    )
