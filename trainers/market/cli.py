"""``fedasync market [--config FILE] [key=value ...]``: the continuous-time pricing market.

One setting (``market.*``) over ``run.seeds`` seeds, or, with ``sweep.rates`` and
``sweep.latencies``, the phase diagram over every (rate, latency) pair; seeds and cells run
in parallel in a process pool (``run.workers``). Prints one line per setting (the collusion
index with its 95% interval over the uncorrupted seeds, corrupted seeds counted, the
deviation test's outcome) and writes the run folder: ``<setting>/seed-<s>/metrics.jsonl``
(``start``, ``window`` every ``run.window`` time units, ``diverged``, ``end``) and
``trace.npz``, ``summary.json`` and, with ``plots`` in ``run.trackers``, PNGs. Config errors are one line,
exit 2 (``fedasync.errors.UserError``).

Each seed that finishes writes ``result.json`` in its folder; ``run.resume=true`` loads those
(of the same config) and runs the rest. Ctrl-C (SIGINT), SIGTERM or SIGHUP at any moment:
the pool's pending seeds are cancelled and its workers (which ignore SIGINT) stopped, and one
line on stderr says how many seed runs were done and the command that resumes; exit 128 + the
signal's number (130, 143, 129), without a traceback.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from fedasync.events import json_safe
from fedasync.interrupt import (
    Interrupted,
    exit_now,
    interruptible,
    resume_command,
    signal_of,
    stop_line,
)
from runkit.folder import EVENTS
from runkit.sinks import following
from trainers.market.config import MarketConfig, load_market_config, to_container


def run_market(cfg: MarketConfig) -> dict[str, Any]:
    """Run ``cfg`` (one setting or its sweep); the summary, also in
    ``<out_dir>/<name>/summary.json``. The metrics sinks follow every seed's event log
    (runkit.sinks: one stream per seed)."""
    with following(cfg.run, "market", patterns=(f"*/seed-*/{EVENTS}",), config=to_container(cfg)):
        return _run_market(cfg)


def _run_market(cfg: MarketConfig) -> dict[str, Any]:
    from fedasync.progress import progress
    from trainers.market.run import run_settings, sweep_settings

    root = Path(cfg.run.out_dir) / cfg.run.name
    root.mkdir(parents=True, exist_ok=True)
    settings = sweep_settings(cfg)
    total = sum(c.run.seeds for c in settings)
    started = time.perf_counter()
    try:
        from tqdm import tqdm as bar_factory
    except ImportError:  # pragma: no cover - tqdm is a dependency
        bar_factory = None
    bar = progress(total, "market", tty_bar=bar_factory, disable=not cfg.run.progress, unit="run")
    try:
        results = run_settings(settings, root, bar)
    finally:
        bar.close()
    try:
        return _summarise(cfg, root, results, started)
    except Interrupted as e:
        e.run_dir = root
        e.where = f"after all {total} seed runs, while it wrote the summary and plots"
        raise


def _summarise(
    cfg: MarketConfig, root: Path, results: dict[str, Any], started: float
) -> dict[str, Any]:
    """summary.json and the plots of a finished run; the summary."""
    from trainers.market.seed import benchmarks, build_market

    summary: dict[str, Any] = {
        "config": to_container(cfg),
        **benchmarks(build_market(cfg)),
        "settings": {k: {x: y for x, y in v.items() if x != "runs"} for k, v in results.items()},
        "runs": {k: v["runs"] for k, v in results.items()},
        "wall_s": time.perf_counter() - started,
    }
    if cfg.run.plots:
        from trainers.market.plots import plot_all

        sweep = (cfg.sweep.rates, cfg.sweep.latencies) if cfg.sweep.rates else None
        summary["plots"] = [str(p) for p in plot_all(results, root, sweep)]
    (root / "summary.json").write_text(json.dumps(json_safe(summary), indent=1) + "\n")
    return summary


def describe(label: str, s: dict[str, Any]) -> str:
    """One line for a setting's aggregate."""
    n = s["ok"] + s["corrupted"]
    if s["ok"]:
        half = s["delta_ci95"]
        delta = f"Delta {s['delta']:.3f}" + (
            f" ± {half:.3f} (95% CI over {s['ok']} seeds)" if not math.isnan(half) else " (1 seed)"
        )
    else:
        delta = "no uncorrupted seed"
    corrupted = f", {s['corrupted']}/{n} corrupted" if s["corrupted"] else ""
    dev = (
        f"; deviation: punished {s['punished']}/{s['deviations']}, back "
        f"{s['recovered']}/{s['deviations']}"
        if s["deviations"]
        else ""
    )
    return f"{label}: {delta}{corrupted}{dev}"


def add_parser(sub: Any) -> None:
    """Add the ``market`` subcommand to the ``fedasync`` parser."""
    p = sub.add_parser(
        "market", help="continuous-time pricing market: collusion of DDPG firms under asynchrony"
    )
    p.add_argument("--config", help="YAML config file (default: the built-in defaults)")
    p.add_argument("--verbose", action="store_true", help="log INFO to the console too")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. market.clock=sync")


def run(args: argparse.Namespace) -> int:
    """Run ``fedasync market``; the exit code."""
    if args.verbose:
        logging.getLogger("fedasync").setLevel(logging.INFO)
    cfg: MarketConfig | None = None
    stopped: tuple[str, int] | None = None
    try:
        with interruptible():
            cfg = load_market_config(args.config, args.overrides)  # a UserError: exit 2
            s = run_market(cfg)
    except KeyboardInterrupt as e:
        stopped = _stopped(args, cfg, e), signal_of(e)[1]
    if stopped is not None:  # out of the except: the pool's queues are let go (no leak warning)
        gc.collect()
        print(stopped[0], file=sys.stderr)
        exit_now(stopped[1])
    assert cfg is not None
    for label, agg in s["settings"].items():
        print(describe(label, agg))
    print(
        f"market: p_N={s['p_nash']:.3f} p_M={s['p_monopoly']:.3f}; {len(s['settings'])} "
        f"setting(s) in {s['wall_s']:.0f} s; run folder {Path(cfg.run.out_dir) / cfg.run.name}"
    )
    return 0


def _stopped(args: argparse.Namespace, cfg: MarketConfig | None, e: KeyboardInterrupt) -> str:
    """The stop line: how many seed runs were done, where their results are, the command that
    resumes (it loads them and runs the rest)."""
    where = (e.where if isinstance(e, Interrupted) else "") or "during start-up"
    resume = resume_command("market", args.config, args.overrides)
    if cfg is None:
        return stop_line("market", e, where, f"resume with: {resume}")
    root = Path(cfg.run.out_dir) / cfg.run.name
    return stop_line(
        "market",
        e,
        where,
        f"finished seeds and checkpoints of unfinished ones in {root}; resume with: {resume}",
    )
