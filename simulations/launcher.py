"""Simulation mode: run the ServerApp and one ClientApp per silo on Flower's simulation engine.

``simulate(cfg)`` runs the configured mode and, with ``lab.compare_sync``, the synchronous
FedAvg baseline on the same data, speeds and virtual clock; then it fills in time-to-target
(95% of the baseline's best score unless ``lab.target_accuracy`` is set), writes
``summary.json`` and the PNG plots. Flower's engine runs on Ray: by default a private Ray is
started and stopped here (its temp folder is private to the run and removed afterwards);
with ``engine.ray_address`` the run attaches to a running cluster as one Ray job and leaves
the cluster as it found it (Ray ends the job's actors when this driver disconnects).

How a run ends (``run``, behind ``fedasync simulate``): finished, the table and where the outputs
are (exit 0); an exception, one line and the traceback in run.log (exit 1); Ctrl-C or SIGTERM
(exit 130 / 143), the ServerApp stops at its next poll, writes a checkpoint and stops the
erasure service, then Ray is stopped and one line says where it stopped and how to resume. In
every case no process of the run's private Ray is left (``stop_session_processes``), and each
run first stops what earlier runs whose driver was killed (kill -9) left behind
(``processes.sweep_orphans``): Ray's DashboardAgent and RuntimeEnvAgent survive their driver.

One file (just over 400 lines) because it is one command's life cycle read top to bottom:
logging, signals, Ray's start and stop, the runs, the report; the process bookkeeping is
already apart (``processes``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedasync.errors import UserError
from fedasync.events import read_events
from fedasync.interrupt import Interrupted, exit_now, restore, set_handlers
from fedasync.processes import (
    FLOWER_ENV,
    RAY_SESSION_ENV,
    RAY_TMP_PREFIX,
    stop_session_processes,
    sweep_orphans,
    write_owner,
)
from runkit.configload import to_container
from runkit.folder import EVENTS
from runkit.sinks import following
from server.config import EngineConfig, FedAsyncConfig
from server.summary import time_to_target, write_summary
from simulations.config import to_yaml
from simulations.plots import plot_score_vs_time, plot_silo_contribution, plot_staleness

CLIENT_CPUS = 1
"""CPUs Ray reserves for each ClientApp actor. A constant, not a setting: a silo trains on
``client.num_threads`` threads, 1 by default, and no run has reserved more; ``engine.num_cpus``
decides how many silos train at once."""

log = logging.getLogger("fedasync")

BASELINE_DIR = "baseline-sync"


def _quiet_environment() -> None:
    for name, value in FLOWER_ENV.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("flwr", "ray"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Flower 1.42 warns on every run that run_simulation is deprecated (docs/how-it-works.md says so once)
    flwr_log = logging.getLogger("flwr")
    if not any(isinstance(f, _DropDeprecation) for f in flwr_log.filters):
        flwr_log.addFilter(_DropDeprecation())


def _route_flower_logs() -> None:
    """Flower's log lines go to run.log with ours; on the console only with ``--verbose``.

    Flower logs an error in its simulation runtime with a traceback on its own console
    handler; the run's one line on stderr says what happened and where the log is."""
    flwr_log = logging.getLogger("flwr")
    ours = logging.getLogger("fedasync").handlers
    verbose = any(type(h) is logging.StreamHandler and h.level <= logging.INFO for h in ours)
    for h in list(flwr_log.handlers):
        if isinstance(h, logging.FileHandler):
            flwr_log.removeHandler(h)  # an earlier run's
        else:
            h.setLevel(logging.WARNING if verbose else logging.CRITICAL + 1)
    for h in ours:
        if isinstance(h, logging.FileHandler):
            flwr_log.addHandler(h)


class _DropDeprecation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "run_simulation" not in record.getMessage()


def setup_logging(run_dir: Path, verbose: bool = False) -> None:
    """INFO to ``run.log`` in the run folder; warnings (and INFO when verbose) to the console."""
    run_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger("fedasync")
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
    fh = logging.FileHandler(run_dir / "run.log")
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(fh)
    ch = logging.StreamHandler()
    ch.setLevel(logging.INFO if verbose else logging.WARNING)
    ch.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(ch)
    root.propagate = False


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


def _set_signals(handler: Any) -> dict[int, Any]:
    """Handle SIGINT, SIGTERM and SIGHUP (the terminal closed) with ``handler``; the handlers
    they had. Main thread only."""
    return set_handlers(handler)


def _restore_signals(previous: dict[int, Any]) -> None:
    restore(previous)


def _init_ray(init_args: dict[str, Any]) -> None:
    """``ray.init`` as Flower's Ray backend calls it (which then finds Ray running).

    Done here so that this driver's SIGINT/SIGTERM handlers can be put back right after it:
    ``ray.init`` replaces the SIGTERM handler with its own (it stops Ray's processes, then
    ``sys.exit(1)``) and its core worker installs a native failure-signal handler that writes
    a C++ stack dump for SIGTERM into the log.
    """
    import ray

    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath
    ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **init_args)


def run_engine(cfg: FedAsyncConfig, run_dir: Path) -> dict[str, Any]:
    """One run of the ServerApp against ``silos.count`` ClientApps on Flower's simulation engine.

    However it ends (finished, an exception, SIGINT or SIGTERM: Interrupted) the ServerApp's
    thread has ended, with the erasure service, and no process of its private Ray is left. It
    first stops what earlier runs whose driver was killed left behind (``sweep_orphans``).
    """
    import ray
    from flwr.simulation import run_simulation

    from clients.app import app as client_app
    from server.app import StopHandle, make_server_app

    _quiet_environment()
    _route_flower_logs()
    sweep_orphans()
    result: dict[str, Any] = {}
    handle = StopHandle()
    server_app = make_server_app(cfg, run_dir, result, handle)
    ray_tmp = tempfile.mkdtemp(prefix=RAY_TMP_PREFIX)
    write_owner(Path(ray_tmp))  # how a later run tells this run's leftovers from others'
    previous = os.environ.get(SESSION_ENV)
    os.environ[SESSION_ENV] = ray_tmp  # inherited by every Ray process: how we find them
    backend_config: dict[str, Any] = {
        "client_resources": {
            "num_cpus": CLIENT_CPUS,
            "num_gpus": cfg.engine.client_gpus,
        },
        "init_args": {**ray_init_args(cfg.engine, ray_tmp), "logging_level": "ERROR"},
    }
    if cfg.engine.ray_address:
        log.info("attaching to the Ray cluster at %s", cfg.engine.ray_address)
    handlers = _set_signals(_raise_interrupted)
    try:
        _init_ray(backend_config["init_args"])
        _set_signals(_raise_interrupted)  # ray.init replaced them
        with _EngineWorkers():
            run_simulation(
                server_app=server_app,
                client_app=client_app,
                num_supernodes=cfg.silos.count,
                backend_config=backend_config,
            )
    except Interrupted as e:
        e.run_dir = run_dir
        raise
    finally:
        # a second Ctrl-C while stopping must not leave processes behind: stopping is bounded
        ignored = _set_signals(signal.SIG_IGN)
        try:
            stopped = handle.stop(timeout_s=30.0)
            if not stopped:
                log.error("the server app did not stop within 30 s")
                ending = sys.exc_info()[1]
                if isinstance(ending, Interrupted):
                    ending.server_left_running = True
            if ray.is_initialized():
                ray.shutdown()
            # after a signal or an error Ray had no chance to stop its own: expected, run.log only
            cut_short = sys.exc_info()[0] is not None
            stop_session_processes(
                ray_tmp,
                grace_s=3.0 if cut_short else 10.0,
                level=logging.INFO if cut_short else logging.WARNING,
            )
            if previous is None:
                os.environ.pop(SESSION_ENV, None)
            else:
                os.environ[SESSION_ENV] = previous
            shutil.rmtree(ray_tmp, ignore_errors=True)
        finally:
            _restore_signals(ignored)
            _restore_signals(handlers)
    if not result:
        raise RuntimeError(f"the server app did not finish; see {run_dir / 'run.log'}")
    return result


SESSION_ENV = RAY_SESSION_ENV


class _EngineWorkers:
    """Flower 1.42's simulation engine, made to let its message workers leave Ray before Ray
    shuts down. A signal that lands while the engine waits for its workers (a
    ``ThreadPoolExecutor`` exit) ends that wait early; the engine's ``finally`` then stops its
    workers (a stop event: each ends when its Ray call returns) and terminates its Ray backend,
    whose ``terminate`` calls ``ray.shutdown()`` at once. A worker still in a Ray call then uses
    Ray after shutdown, and Ray's core worker ends the whole process with exit code 1 (no
    checkpoint line, no 130). Installed for one run: each worker is tracked while it runs, and
    the backend's ``terminate`` first waits (at most ``wait_s``) for the tracked ones to end.
    FlowerInternalsMoved if the two are not where flwr 1.42 has them."""

    def __init__(self, wait_s: float = 5.0) -> None:
        from flwr.server.superlink.fleet.vce import vce_api
        from flwr.server.superlink.fleet.vce.backend import raybackend

        from protocol.transport import FlowerInternalsMoved

        backend = getattr(raybackend, "RayBackend", None)
        if not callable(getattr(vce_api, "worker", None)) or backend is None:
            raise FlowerInternalsMoved(
                "flwr's vce_api.worker or RayBackend moved: simulations.launcher was written "
                "for flwr 1.42"
            )
        self.wait_s = wait_s
        self.running: set[threading.Thread] = set()
        self.done = threading.Condition()
        self._api, self._backend = vce_api, backend
        self._worker, self._terminate = vce_api.worker, backend.terminate

    def __enter__(self) -> _EngineWorkers:
        worker, terminate = self._worker, self._terminate

        def tracked(*args: Any, **kwargs: Any) -> None:
            with self.done:
                self.running.add(threading.current_thread())
            try:
                worker(*args, **kwargs)
            finally:
                with self.done:
                    self.running.discard(threading.current_thread())
                    self.done.notify_all()

        def terminate_after_workers(backend: Any) -> None:
            with self.done:
                if not self.done.wait_for(lambda: not self.running, timeout=self.wait_s):
                    log.info("%d engine worker(s) still in Ray; stopping it", len(self.running))
            terminate(backend)

        self._api.worker = tracked
        self._backend.terminate = terminate_after_workers
        return self

    def __exit__(self, *exc: object) -> None:
        self._api.worker, self._backend.terminate = self._worker, self._terminate


def ray_init_args(engine: EngineConfig, ray_tmp: str) -> dict[str, Any]:
    """What Flower's Ray backend passes to ``ray.init`` (its ``init_args``).

    Private (``engine.ray_address`` None): a new local Ray with ``engine.num_cpus`` CPUs and
    its temp folder in ``ray_tmp``; ``address="local"`` so that a ``RAY_ADDRESS`` in the
    environment cannot attach it elsewhere. Attached: only the address; the cluster's nodes
    fix CPUs and temp folders, and Ray refuses ``num_cpus`` when connecting.
    """
    args: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if engine.ray_address:
        return {**args, "address": engine.ray_address}
    num_cpus = engine.num_cpus or os.cpu_count() or 1
    return {**args, "address": "local", "num_cpus": num_cpus, "_temp_dir": ray_tmp}


def _baseline_config(cfg: FedAsyncConfig) -> FedAsyncConfig:
    """The sync baseline of ``cfg``: the same run in ``server.mode=sync``, without faults (a new
    config; ``cfg`` is not changed). With central DP the baseline weighs silos equally
    (``server.sample_weighting=false``): sync with DP is only valid so, since sample weights
    would break the per-silo sensitivity the noise is scaled to."""
    dp = cfg.server.dp.noise_multiplier is not None
    weighting = cfg.server.sample_weighting and not dp
    server = replace(cfg.server, mode="sync", sample_weighting=weighting)
    return replace(
        cfg,
        server=server,
        lab=replace(cfg.lab, faults=[], compare_sync=False),
    )


def simulate(cfg: FedAsyncConfig, *, verbose: bool = False) -> dict[str, Any]:
    """Run ``cfg`` (and its sync baseline); write summaries and plots; return the summary.
    The metrics sinks follow both runs' event logs meanwhile (runkit.sinks)."""
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    setup_logging(run_dir, verbose)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    if cfg.task.bundle is not None:
        _print_bundle(cfg)
    else:
        from server.benchmark import federation

        fed = federation(cfg)
        print(
            f"fedasync: {cfg.data.benchmark} ({fed.spec.modality}, {fed.spec.task}) across "
            f"{cfg.silos.count} silos"
        )
        print(fed.table())
    t0 = time.monotonic()
    logs = (EVENTS, f"{BASELINE_DIR}/{EVENTS}")
    with following(cfg.run, "simulate", run_dir, patterns=logs, config=to_container(cfg)):
        runs, summary = _run_and_plot(cfg, run_dir)
    _print_result(runs, run_dir, time.monotonic() - t0)
    return summary


def _print_bundle(cfg: FedAsyncConfig) -> None:
    """What a bundle task's run trains: the bundle, its task and how its datalist splits."""
    from clients.task import split_items
    from medical_data.monai_bundle import read_bundle

    bundle = read_bundle(str(cfg.task.bundle))
    items = bundle.items("train")
    groups = split_items(items, cfg.silos.count, cfg.data.partition, cfg.run.seed)
    print(
        f"fedasync: bundle {bundle.root} ({bundle.task}) across {cfg.silos.count} silos, "
        f"partition={cfg.data.partition}: {'/'.join(str(len(g)) for g in groups)} of "
        f"{len(items)} items; cache {cfg.task.cache} items per silo"
    )


def _run_and_plot(
    cfg: FedAsyncConfig, run_dir: Path
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The run and its sync baseline, their time to target, summaries and plots: every run's
    summary by mode, and the run's own."""
    summary = run_engine(cfg, run_dir)
    runs: dict[str, dict[str, Any]] = {cfg.server.mode: summary}
    baseline = None
    if cfg.lab.compare_sync and cfg.server.mode != "sync":
        bdir = run_dir / BASELINE_DIR
        bcfg = _baseline_config(cfg)
        (bdir).mkdir(parents=True, exist_ok=True)
        (bdir / "config.yaml").write_text(to_yaml(bcfg))
        baseline = run_engine(bcfg, bdir)
        runs["sync"] = baseline
    target = cfg.lab.target_accuracy
    source = "lab.target_accuracy"
    if target is None:
        ref = baseline if baseline is not None else summary
        target = 0.95 * ref["best_score"]
        source = f"95% of {ref['mode']} best"
    for s in runs.values():
        s["target_accuracy"] = target
        s["target_source"] = source
        s["time_to_target_s"] = time_to_target(s["evals"], target)
    if baseline is not None:
        ta, tb = summary["time_to_target_s"], baseline["time_to_target_s"]
        summary["speedup_vs_sync"] = (tb / ta) if (ta and tb) else None
        summary["baseline"] = {
            k: baseline[k]
            for k in ("mode", "final_score", "best_score", "time_to_target_s", "versions")
        }
        write_summary(run_dir / BASELINE_DIR / "summary.json", baseline)
    write_summary(run_dir / "summary.json", summary)
    if cfg.run.plots:
        stal = [
            e["staleness"] for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "update"
        ]
        plot_score_vs_time(runs, run_dir / "accuracy_vs_time.png", summary["metric"], target)
        plot_staleness(stal, run_dir / "staleness_hist.png", cfg.server.mode)
        plot_silo_contribution(summary, run_dir / "silo_contribution.png")
    return runs, summary


def _print_result(runs: dict[str, dict[str, Any]], run_dir: Path, wall: float) -> None:
    print()
    print(
        f"{'mode':10s} {'final':>7s} {'best':>7s} {'versions':>8s} {'applied':>8s} {'rejected':>8s} {'t_target(s)':>11s} {'stale_mean':>10s}"
    )
    for mode, s in runs.items():
        ttt = s["time_to_target_s"]
        print(
            f"{mode:10s} {s['final_score']:7.4f} {s['best_score']:7.4f} {s['versions']:8d} "
            f"{s['updates_applied']:8d} {s['updates_rejected_total']:8d} "
            f"{(f'{ttt:.0f}' if ttt is not None else 'never'):>11s} {s['staleness_mean']:10.2f}"
        )
    main = next(iter(runs.values()))
    if main.get("speedup_vs_sync") is not None:
        print(
            f"time-to-target speedup vs sync: {main['speedup_vs_sync']:.2f}x (target {main['target_accuracy']:.4f} {main['metric']})"
        )
    print(f"outputs: {run_dir}/ (summary.json, metrics.jsonl, *.png) in {wall:.0f}s wall")


def run(
    cfg: FedAsyncConfig,
    *,
    verbose: bool = False,
    check: Callable[[dict[str, Any]], str | None] = lambda summary: None,
) -> int:
    """``fedasync simulate``: run ``cfg`` and say how it ended. Exit code 0: finished (the table
    and where the outputs are); 1: ``check(summary)`` says what is wrong, or the run failed (one
    line; the traceback in run.log, on the console too with ``verbose``); 130: Ctrl-C (SIGINT),
    143: SIGTERM, 129: SIGHUP (one line: where it stopped, its checkpoint, how to resume). A UserError
    passes through (the CLI turns it into one line)."""
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    handlers = _set_signals(_raise_interrupted)
    try:
        failed = check(simulate(cfg, verbose=verbose))
        if failed is not None:
            print(f"fedasync: {failed}", file=sys.stderr)
            return 1
        return 0
    except KeyboardInterrupt as e:  # Interrupted, or Ctrl-C before its handler was set
        stopped = e.run_dir if isinstance(e, Interrupted) and e.run_dir else run_dir
        name = e.args[0] if isinstance(e, Interrupted) else "SIGINT"
        where = where_stopped(stopped)
        if stopped != run_dir:  # in the sync baseline: the run itself had finished
            where = (
                f"in the sync baseline {where}, after the {cfg.server.mode} run finished "
                f"{where_stopped(run_dir)}"
            )
        print(f"fedasync: stopped by {name} {where}; {_resume(run_dir)}", file=sys.stderr)
        code = e.exit_code if isinstance(e, Interrupted) else 130
        if isinstance(e, Interrupted):
            # Everything the run started is stopped by now (run_engine's finally: the ServerApp
            # asked to stop, Ray's processes by pid, the checkpoint written). A normal exit
            # would still join every non-daemon thread left in this process: Flower's ServerApp
            # thread when it did not stop in time, and, seen twice in full test suites, some
            # other thread after a clean stop, which held the exit for minutes after this line.
            exit_now(code)
        return code
    except UserError:
        raise
    except Exception as e:
        log.info("the run failed", exc_info=True)  # INFO: run.log, the console only when verbose
        while e.__cause__ is not None and isinstance(e.__cause__, Exception):
            e = e.__cause__  # Flower wraps what went wrong in RuntimeErrors of its own
        print(
            f"fedasync: the run failed {where_stopped(run_dir)}: {type(e).__name__}: {e}; "
            f"traceback in {run_dir / 'run.log'}",
            file=sys.stderr,
        )
        return 1
    finally:
        _restore_signals(handlers)


def where_stopped(run_dir: Path) -> str:
    """'at version V (t=T s virtual)' from the run's event log, or 'before training' (also
    what ``deploy local`` says when a signal stopped it, with the wall clock)."""
    from fedasync.events import read_events

    try:
        events = read_events(run_dir / "metrics.jsonl")
    except (OSError, ValueError):
        events = []
    clock = next((e.get("clock") for e in events if e["event"] == "start"), None)
    last = next((e for e in reversed(events) if "version" in e and "t" in e), None)
    if last is None or not any(e["event"] == "update" for e in events):
        return "before training"
    return f"at version {last['version']} (t={last['t']:.1f} s {clock or ''})".replace(" )", ")")


def _resume(run_dir: Path) -> str:
    """Where the checkpoint is and the command that resumes from it."""
    ckpt = run_dir / "checkpoint.pt"
    if not ckpt.exists():
        return "no checkpoint yet: run it again to start afresh"
    return (
        f"checkpoint {ckpt}; resume with: fedasync simulate --config {run_dir / 'config.yaml'} "
        "run.resume=true"
    )
