"""``fedasync rl [--config FILE] [key=value ...]``: one asynchronous RL run.

Prints one line per outcome and writes the run folder: metrics.jsonl (one ``step`` event per
learner step, ``eval``, ``rollout``, ``drop``, ``reject``, ``checkpoint``), summary.json and,
with ``plots`` in ``run.trackers``, PNGs. Config errors are one line, exit 2 (``fedasync.errors.UserError``).

Ctrl-C (SIGINT), SIGTERM or SIGHUP at any moment: the run stops at its next safe point and
writes ``checkpoint.pt`` (``trainers.rl.engine.RLRun.step_loop``), its backends are closed
(every Ray process it started is gone), and one line on stderr says where it stopped, the
checkpoint and the command that resumes from it (or that there is none yet); exit 128 + the
signal's number (130, 143, 129), without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedasync.interrupt import (
    Interrupted,
    exit_now,
    interruptible,
    resume_or_afresh,
    shielded,
    signal_of,
    stop_line,
)
from runkit.sinks import following
from trainers.rl.config import RLConfig, load_rl_config, to_container

log = logging.getLogger("fedasync.rl")


def with_backend(cfg: RLConfig) -> tuple[RLConfig, Any]:
    """The config the run uses and the backend it asks for (None: the one-process mode).

    Without Ray, the one-process mode, and it says so: a new config with
    ``rollout.backend=local`` (and the virtual clock for a wall one, which needs Ray's
    actors). ``cfg`` itself is left as it was."""
    if cfg.rollout.backend != "ray":
        return cfg, None
    try:
        from trainers.rl.ray_backend import RayBackend, ray_available
    except ImportError as e:  # pragma: no cover - Ray is a dependency of flwr[simulation]
        reason: str | None = f"{type(e).__name__}: {e}"
    else:
        reason = ray_available()
        if reason is None:
            from fedasync.devices import pick_device
            from trainers.rl.backend import build_task

            return cfg, RayBackend(cfg, build_task(cfg), pick_device(cfg.run.device))
    log.warning(
        "Ray is not available (%s): running the one-process mode instead", str(reason)[:200]
    )
    clock = cfg.rollout.clock
    if clock == "wall":
        log.warning("the wall clock needs Ray's actors: using the virtual clock")
        clock = "virtual"
    return replace(cfg, rollout=replace(cfg.rollout, backend="local", clock=clock)), None


def make_backend(cfg: RLConfig) -> Any:
    """The backend the config asks for (None: the one-process mode, and it says so); the
    config that goes with it is `with_backend`'s. ``cfg`` is left as it was."""
    return with_backend(cfg)[1]


def run_rl(cfg: RLConfig) -> dict[str, Any]:
    """Run ``cfg`` and return its summary (also in ``<out_dir>/<name>/summary.json``), the
    metrics sinks following its event log (runkit.sinks).

    A signal (handled by the caller, e.g. :func:`fedasync.interrupt.interruptible`) ends it
    with :class:`fedasync.interrupt.Interrupted` once every process it started is stopped;
    the exception says where it stopped and the checkpoint to resume from."""
    with following(cfg.run, "rl", config=to_container(cfg)):
        return _run_rl(cfg)


def _run_rl(cfg: RLConfig) -> dict[str, Any]:
    from trainers.rl.engine import RLRun

    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    cfg, backend = with_backend(cfg)
    try:
        run = RLRun(cfg, run_dir, backend)
        summary = run.run()
    except BaseException as e:
        if backend is not None:  # idempotent: the run may have closed it already
            if isinstance(e, KeyboardInterrupt):
                with shielded():
                    backend.close()
            else:
                backend.close()
        raise
    if cfg.run.plots:
        from trainers.rl.plots import plot_run

        try:
            summary["plots"] = [str(p) for p in plot_run(run_dir)]
        except KeyboardInterrupt as e:
            run.phase = "plots"
            run.save_finished()
            run.note_stop(e)
            raise
    return summary


def add_parser(sub: Any) -> None:
    """Add the ``rl`` subcommand to the ``fedasync`` parser."""
    p = sub.add_parser("rl", help="asynchronous RL on a small language-model policy")
    p.add_argument("--config", help="YAML config file (default: the built-in defaults)")
    p.add_argument("--verbose", action="store_true", help="log INFO to the console too")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. rollout.mode=sync")


def run(args: argparse.Namespace) -> int:
    """Run ``fedasync rl``; the exit code. A signal ends the process here (module docstring)."""
    if args.verbose:
        logging.getLogger("fedasync").setLevel(logging.INFO)
    cfg: RLConfig | None = None
    try:
        with interruptible():
            cfg = load_rl_config(args.config, args.overrides)  # a UserError: one line, exit 2
            s = run_rl(cfg)
    except KeyboardInterrupt as e:
        print(_stopped(args, cfg, e), file=sys.stderr)
        exit_now(signal_of(e)[1])
    ttt = s["time_to_target_s"]
    print(
        f"rl {s['mode']} ({s['correction']}, S={s['max_staleness']}, {s['workers']} workers, "
        f"{s['backend']}, {s['clock']} clock): {s['versions']} versions in {s['time_s']:.1f} s, "
        f"accuracy {s['initial_accuracy']:.3f} -> {s['final_accuracy']:.3f}"
        + (f", target reached at {ttt:.1f} s" if ttt is not None else "")
        + (
            f", KL(student‖teacher) {d['final_teacher_rkl']:.3f} ({d['loss']}, top-{d['top_k']}"
            f", teacher accuracy {d['teacher'].get('accuracy') or float('nan'):.3f})"
            if (d := s.get("distill"))
            else ""
        )
        + f", dropped {sum(s['dropped'].values())}; run folder "
        f"{Path(cfg.run.out_dir) / cfg.run.name}"
    )
    return 0


def _stopped(args: argparse.Namespace, cfg: RLConfig | None, e: KeyboardInterrupt) -> str:
    """The stop line: where, the checkpoint and the command that resumes (or that none is)."""
    where = (e.where if isinstance(e, Interrupted) else "") or "during start-up"
    ckpt = e.checkpoint if isinstance(e, Interrupted) else None
    if ckpt is None and cfg is not None and cfg.run.resume:  # stopped before it loaded it
        path = Path(cfg.run.out_dir) / cfg.run.name / "checkpoint.pt"
        ckpt = path if path.is_file() else None
    return stop_line("rl", e, where, resume_or_afresh("rl", args.config, args.overrides, ckpt))
