"""``fedasync pipeline [--config FILE] [key=value ...]``: one pipeline-parallel training run.

Prints one line and writes the run folder (:mod:`trainers.pipeline.run`). Config errors are
one line, exit 2 (``fedasync.errors.UserError``); a stage that fails or dies is named
(exit 1), and ``run.resume=true`` continues from the last checkpoint.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from trainers.pipeline.config import load_pipeline_config


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
    cfg = load_pipeline_config(args.config, args.overrides)  # a UserError: one line, exit 2
    try:
        s = run_config(cfg)
    except StageFailed as e:
        print(
            f"fedasync pipeline: {e}; rerun with run.resume=true to continue from the last "
            "checkpoint"
        )
        return 1
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
