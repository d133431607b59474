"""One pricing-market run per seed, the forced-deviation test, and settings run in parallel.

Paper: the market and the collusion index are Calvano, Calzolari, Denicolò and Pastorello
(AER 2020); the continuous-time setting (Poisson clocks, observation latency), the DDPG
agents and the two failure modes are arXiv 2606.09884 (Murthy and Pandey 2026), whose
benchmark this reimplements from its description (no code of theirs was read).

A run (``run_seed``): the firms' clocks (trainers.market.env.ContinuousMarket) give the next
revision time and who revises. At an event every mover first observes (its own price, its
competitors' as of ``latency`` ago) and settles its transition since its previous revision
(the profit it earned, discounted continuously, and the discount e^(-rho x elapsed)), which
its agent remembers before it learns (``agent.updates_per_revision`` gradient steps); then
every mover sets its new price. In the synchronous mode all firms are movers at every event,
so none sees another's new price before setting its own, as in a simultaneous-move game.
Training stops at the horizon (``run.horizon``, or ``run.revisions`` per firm). The collusion index is measured on the profit actually
earned over the last ``run.measure_fraction`` of the horizon: the firms' mean time-average
profit pi_bar, Delta = (pi_bar - pi_N) / (pi_M - pi_N).

Failure mode 2: a critic whose loss or Q-values leave the detector's bounds (or turn NaN)
raises ``CriticDiverged``; the run stops there and is *corrupted*: reported, counted, and left
out of every average.

The forced deviation (``deviation_test``, after training, agents frozen and greedy): the
market runs for half of ``run.deviation_span`` to settle, then firm 0, at its next revision,
sets the static best response to the prices it sees (an undercut when prices are above
Nash) for one revision, then follows its policy again. Reported: the prices before, the
competitors' lowest price after the deviation (a punishment when it falls below theirs
before by more than a tolerance), and the recovery time: from the deviation until every
price is back within the tolerance of its pre-deviation level and stays there to the end of
the span (None: no recovery within it). Calvano et al.'s signature of collusion is a
punishment followed by a return.

Settings run in parallel over seeds (``run_settings``): a process pool (spawned workers, one
torch thread each), one task per (setting, seed); results are the same as one process would
get, since every run is seeded from its own seed only.

One seed (its market, agents, loop, deviation test and folder) is trainers.market.seed's. A
seed that finishes writes ``result.json`` in its folder (atomically); with ``run.resume`` a
seed whose result is there, of the same config, is loaded instead of run again, and one with a
checkpoint continues from it. A signal (Ctrl-C reaches the pool's workers too: they ignore
SIGINT, and start with it blocked) stops the run: each running seed checkpoints at its next
event (the pool's workers are told through a shared event), the pending seeds are cancelled
and the workers stopped, and :class:`fedasync.interrupt.Interrupted` says how many seeds were
done and which were saved mid-run (``where``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed, wait
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from fedasync.interrupt import (
    DeferredStop,
    Interrupted,
    children_start_deaf,
    ignore_interrupts,
    shielded,
)
from trainers.market.config import MarketConfig
from trainers.market.results import RESULT, load_result
from trainers.market.seed import run_seed

log = logging.getLogger("fedasync.market")

STOP_GRACE_S = 10.0
"""Seconds a stopped run waits for its running seeds to write their checkpoints."""


def setting_label(cfg: MarketConfig) -> str:
    """A setting's folder name: clock, rate and latency (e.g. ``async-r1-d0.5``)."""
    m = cfg.market
    return f"{m.clock}-r{m.rate:g}-d{m.latency:g}"


def confidence_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width of the ``level`` Student-t interval); half-width nan for < 2 values."""
    if not values:
        return math.nan, math.nan
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return float(x.mean()), math.nan
    from scipy import stats

    half = float(stats.t.ppf(0.5 + level / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return float(x.mean()), half


def aggregate(results: list[dict[str, Any]]) -> dict[str, Any]:
    """A setting's seeds summed up: Delta's mean and 95% interval over the uncorrupted seeds,
    the corrupted ones counted (and why), and the deviation test's outcomes."""
    ok = [r for r in results if r["status"] == "ok" and "delta" in r]
    deltas = [r["delta"] for r in ok]
    mean, half = confidence_interval(deltas)
    devs = [r["deviation"] for r in ok if "deviation" in r]
    rec = [d["recovery_time"] for d in devs if d["recovery_time"] is not None]
    return {
        "delta": mean,
        "delta_ci95": half,
        "delta_sd": float(np.std(deltas, ddof=1)) if len(deltas) > 1 else math.nan,
        "deltas": deltas,
        "seeds": [r["seed"] for r in results],
        "ok": len(ok),
        "corrupted": len(results) - len(ok),
        "corrupted_reasons": [r["corrupted"]["reason"] for r in results if r.get("corrupted")],
        "price_mean": float(np.mean([np.mean(r["price_mean"]) for r in ok])) if ok else math.nan,
        "punished": sum(d["punished"] for d in devs),
        "recovered": sum(d["recovered"] for d in devs),
        "deviations": len(devs),
        "recovery_time_mean": float(np.mean(rec)) if rec else None,
        "seconds": float(sum(r["seconds"] for r in results)),
    }


_STOP: Any = None
"""In a pool worker: the event its parent sets to ask every running seed to checkpoint."""


def _worker_init(stop: Any) -> None:
    """A pool worker's start: SIGINT ignored (its parent stops it), the stop event kept."""
    global _STOP
    ignore_interrupts()
    _STOP = stop


def _task(cfg: MarketConfig, seed: int, run_dir: str) -> dict[str, Any]:
    """A pool task: one seed (a module-level function, so that it pickles)."""
    stop = _STOP
    return run_seed(cfg, seed, Path(run_dir), should_stop=None if stop is None else stop.is_set)


def _run_serial(
    todo: list[tuple[MarketConfig, int, Path]],
    done: Callable[[MarketConfig, dict[str, Any]], None],
) -> None:
    """``todo`` one after another in this process. The first signal asks the running seed to
    stop at its next event with a checkpoint; then :class:`Interrupted` goes on (a second
    signal, or a seed that does not get there within the grace, raises at once)."""
    with DeferredStop(STOP_GRACE_S) as stop:
        for cfg, seed, d in todo:
            stop.check()
            result = run_seed(cfg, seed, d, should_stop=lambda: stop.requested is not None)
            done(cfg, result)
        stop.check()


def pool_size(cfg: MarketConfig, tasks: int) -> int:
    """Worker processes for ``tasks`` runs (``run.workers``, 0: one per core)."""
    want = cfg.run.workers or (os.cpu_count() or 1)
    return max(1, min(want, tasks))


def run_settings(
    settings: list[MarketConfig], root: Path, progress_bar: Any = None
) -> dict[str, dict[str, Any]]:
    """Run every setting over its seeds (``run.seed`` ..), in parallel when more than one
    process is asked for; {setting label: aggregate, with the per-seed results}. Each seed's
    folder is ``root/<label>/seed-<s>``. With ``run.resume`` the seeds already finished there
    are loaded (module docstring); a signal raises :class:`fedasync.interrupt.Interrupted`
    once the pool is stopped, its ``where`` saying how many seeds were done."""
    tasks = [
        (cfg, cfg.run.seed + k, root / setting_label(cfg) / f"seed-{cfg.run.seed + k}")
        for cfg in settings
        for k in range(cfg.run.seeds)
    ]
    by_label: dict[str, list[dict[str, Any]]] = {setting_label(c): [] for c in settings}
    finished = 0

    def done(cfg: MarketConfig, result: dict[str, Any]) -> None:
        nonlocal finished
        finished += 1
        by_label[setting_label(cfg)].append(result)
        if progress_bar is not None:
            progress_bar.update(1)
            progress_bar.set_postfix_str(
                f"{setting_label(cfg)} seed {result['seed']}: "
                + (f"Delta={result['delta']:.2f}" if "delta" in result else result["status"])
            )

    todo = []
    for cfg, seed, d in tasks:
        loaded = load_result(d, cfg, seed) if cfg.run.resume else None
        if loaded is not None:
            done(cfg, loaded)
            continue
        (d / RESULT).unlink(missing_ok=True)  # an earlier run's, or one of another config
        todo.append((cfg, seed, d))
    if finished:
        log.info("resumed: %d of %d seed runs loaded from %s", finished, len(tasks), root)
    workers = pool_size(settings[0], len(todo)) if settings and todo else 1
    saved: list[int] = []  # seeds stopped with a checkpoint

    def finish(cfg: MarketConfig, result: dict[str, Any]) -> None:
        if result["status"] == "stopped":
            saved.append(int(result["seed"]))
        else:
            done(cfg, result)

    try:
        if workers == 1:
            _run_serial(todo, finish)
        else:
            _run_pool(todo, workers, finish)
    except Interrupted as e:
        e.run_dir = root
        e.where = f"with {finished} of {len(tasks)} seed runs done"
        if saved:
            e.where += f" and {len(saved)} checkpointed mid-run (seed {', '.join(map(str, saved))})"
        raise
    out = {}
    for cfg in settings:
        label = setting_label(cfg)
        results = sorted(by_label[label], key=lambda r: r["seed"])
        out[label] = {
            "clock": cfg.market.clock,
            "rate": cfg.market.rate,
            "latency": cfg.market.latency,
            **aggregate(results),
            "runs": results,
        }
    return out


def _run_pool(
    todo: list[tuple[MarketConfig, int, Path]],
    workers: int,
    done: Callable[[MarketConfig, dict[str, Any]], None],
) -> None:
    """``todo`` on a pool of ``workers`` spawned processes, ``done`` called as each finishes.
    The workers ignore SIGINT (and start with it blocked: ``children_start_deaf``); on any
    exception here (a signal's Interrupted) the pending seeds are cancelled and the workers
    stopped before it goes on."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init, initargs=(stop,))
    futures: dict[Any, MarketConfig] = {}
    try:
        with children_start_deaf():  # the workers start as the tasks are submitted
            futures = {pool.submit(_task, cfg, seed, str(d)): cfg for cfg, seed, d in todo}
        for f in as_completed(futures):
            done(futures[f], f.result())
            del futures[f]
    except BaseException:
        with shielded():  # bounded: the grace, then 5 s, then SIGKILL
            stop.set()  # the running seeds checkpoint at their next event and return
            running = [f for f in futures if f.running()]
            stopped, _ = wait(running, timeout=STOP_GRACE_S) if running else (set(), set())
            for f in stopped:
                if f.exception() is None:  # one that failed as it stopped has no checkpoint
                    done(futures[f], f.result())
            _stop_pool(pool)
        raise
    pool.shutdown(wait=True)


def _stop_pool(pool: ProcessPoolExecutor, grace_s: float = 5.0) -> None:
    """Cancel the pool's pending tasks and stop its workers (SIGTERM, then SIGKILL)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(deadline - time.monotonic(), 0.0))
        if p.is_alive():
            p.kill()
            p.join(5)


def sweep_settings(cfg: MarketConfig) -> list[MarketConfig]:
    """The settings a config asks for: its own, or one per (rate, latency) of its sweep."""
    if not cfg.sweep.rates:
        return [cfg]
    return [
        replace(cfg, market=replace(cfg.market, rate=r, latency=d))
        for r in cfg.sweep.rates
        for d in cfg.sweep.latencies
    ]
