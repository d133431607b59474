"""Simulation mode: run the ServerApp and one ClientApp per silo on Flower's simulation engine.

``simulate(cfg)`` runs the configured mode and, with ``run.compare_sync``, the synchronous
FedAvg baseline on the same data, speeds and virtual clock; then it fills in time-to-target
(95% of the baseline's best score unless ``run.target_accuracy`` is set), writes
``summary.json`` and the PNG plots. Flower's engine runs on Ray: by default a private Ray is
started and stopped here (its temp folder is private to the run and removed afterwards);
with ``engine.ray_address`` the run attaches to a running cluster as one Ray job and leaves
the cluster as it found it (Ray ends the job's actors when this driver disconnects).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from server.config import EngineConfig, FedAsyncConfig
from server.summary import time_to_target, write_summary
from simulations.config import to_yaml
from simulations.plots import plot_score_vs_time, plot_silo_contribution, plot_staleness
from simulations.processes import pids_with_env

log = logging.getLogger("fedasync")

BASELINE_DIR = "baseline-sync"


def _quiet_environment() -> None:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("flwr", "ray"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Flower 1.42 warns on every run that run_simulation is deprecated (README says so once)
    flwr_log = logging.getLogger("flwr")
    if not any(isinstance(f, _DropDeprecation) for f in flwr_log.filters):
        flwr_log.addFilter(_DropDeprecation())


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


def run_engine(cfg: FedAsyncConfig, run_dir: Path) -> dict[str, Any]:
    """One run of the ServerApp against ``silos.count`` ClientApps on Flower's simulation engine."""
    import ray
    from flwr.simulation import run_simulation

    from clients.app import app as client_app
    from server.app import make_server_app

    _quiet_environment()
    result: dict[str, Any] = {}
    server_app = make_server_app(cfg, run_dir, result)
    ray_tmp = tempfile.mkdtemp(prefix="fa-ray-")
    previous = os.environ.get(SESSION_ENV)
    os.environ[SESSION_ENV] = ray_tmp  # inherited by every Ray process: how we find them
    backend_config: dict[str, Any] = {
        "client_resources": {
            "num_cpus": cfg.engine.client_cpus,
            "num_gpus": cfg.engine.client_gpus,
        },
        "init_args": {**ray_init_args(cfg.engine, ray_tmp), "logging_level": "ERROR"},
    }
    if cfg.engine.ray_address:
        log.info("attaching to the Ray cluster at %s", cfg.engine.ray_address)
    try:
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=cfg.silos.count,
            backend_config=backend_config,
        )
    finally:
        if ray.is_initialized():
            ray.shutdown()
        stop_session_processes(ray_tmp)
        if previous is None:
            os.environ.pop(SESSION_ENV, None)
        else:
            os.environ[SESSION_ENV] = previous
        shutil.rmtree(ray_tmp, ignore_errors=True)
    if not result:
        raise RuntimeError(f"the server app did not finish; see {run_dir / 'run.log'}")
    return result


SESSION_ENV = "FEDASYNC_RAY_SESSION"


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


def stop_session_processes(session: str, grace_s: float = 10.0) -> None:
    """Stop, by pid, every process of this run's Ray session.

    Every process of a private Ray (GCS, raylet, and the workers, which Ray re-parents to
    init) inherits ``FEDASYNC_RAY_SESSION=<session>`` from this process. An attached cluster's
    processes were started by ``ray start``, not by us, and never carry it: they are left alone.
    ``ray.shutdown()`` asks a private Ray's processes to exit but does not wait for the
    workers; a leftover one could outlive the command and hang CI. Wait ``grace_s``, then
    SIGTERM, then SIGKILL what is left. Linux only (/proc).
    """
    if not Path("/proc").is_dir():
        return
    deadline = time.monotonic() + grace_s
    signals = [signal.SIGTERM, signal.SIGKILL, signal.SIGKILL]
    quiet = 0
    while quiet < 2:  # two scans in a row with nothing left: a worker spawned late is caught
        left = pids_with_env(SESSION_ENV, session)
        if not left:
            quiet += 1
            time.sleep(0.3)
            continue
        quiet = 0
        if time.monotonic() < deadline:
            time.sleep(0.2)
            continue
        if not signals:
            log.error("Ray processes %s survived SIGKILL", left)
            return
        sig = signals.pop(0)
        log.warning("stopping %d leftover Ray process(es) with %s: %s", len(left), sig.name, left)
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(1.0)


def _baseline_config(cfg: FedAsyncConfig) -> FedAsyncConfig:
    b = copy.deepcopy(cfg)
    b.server.mode = "sync"
    b.run.compare_sync = False
    b.faults = []
    return b


def simulate(cfg: FedAsyncConfig, *, verbose: bool = False) -> dict[str, Any]:
    """Run ``cfg`` (and its sync baseline); write summaries and plots; return the summary."""
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    setup_logging(run_dir, verbose)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    from server.app import _federation

    fed = _federation(cfg)
    print(
        f"fedasync: {cfg.data.benchmark} ({fed.spec.modality}, {fed.spec.task}) across {cfg.silos.count} silos"
    )
    print(fed.table())
    t0 = time.monotonic()
    summary = run_engine(cfg, run_dir)
    runs: dict[str, dict[str, Any]] = {cfg.server.mode: summary}
    baseline = None
    if cfg.run.compare_sync and cfg.server.mode != "sync":
        bdir = run_dir / BASELINE_DIR
        bcfg = _baseline_config(cfg)
        (bdir).mkdir(parents=True, exist_ok=True)
        (bdir / "config.yaml").write_text(to_yaml(bcfg))
        baseline = run_engine(bcfg, bdir)
        runs["sync"] = baseline
    target = cfg.run.target_accuracy
    source = "run.target_accuracy"
    if target is None:
        ref = baseline if baseline is not None else summary
        target = 0.95 * ref["best_accuracy"]
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
            for k in ("mode", "final_accuracy", "best_accuracy", "time_to_target_s", "versions")
        }
        write_summary(run_dir / BASELINE_DIR / "summary.json", baseline)
    write_summary(run_dir / "summary.json", summary)
    from server.events import read_events

    stal = [
        e["staleness"] for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "update"
    ]
    plot_score_vs_time(runs, run_dir / "accuracy_vs_time.png", summary["metric"], target)
    plot_staleness(stal, run_dir / "staleness_hist.png", cfg.server.mode)
    plot_silo_contribution(summary, run_dir / "silo_contribution.png")
    _print_result(runs, run_dir, time.monotonic() - t0)
    return summary


def _print_result(runs: dict[str, dict[str, Any]], run_dir: Path, wall: float) -> None:
    print()
    print(
        f"{'mode':10s} {'final':>7s} {'best':>7s} {'versions':>8s} {'applied':>8s} {'rejected':>8s} {'t_target(s)':>11s} {'stale_mean':>10s}"
    )
    for mode, s in runs.items():
        ttt = s["time_to_target_s"]
        print(
            f"{mode:10s} {s['final_accuracy']:7.4f} {s['best_accuracy']:7.4f} {s['versions']:8d} "
            f"{s['updates_applied']:8d} {s['updates_rejected_total']:8d} "
            f"{(f'{ttt:.0f}' if ttt is not None else 'never'):>11s} {s['staleness_mean']:10.2f}"
        )
    main = next(iter(runs.values()))
    if main.get("speedup_vs_sync") is not None:
        print(
            f"time-to-target speedup vs sync: {main['speedup_vs_sync']:.2f}x (target {main['target_accuracy']:.4f} {main['metric']})"
        )
    print(f"outputs: {run_dir}/ (summary.json, metrics.jsonl, *.png) in {wall:.0f}s wall")
