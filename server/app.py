"""The fedasync ServerApp: builds the global model and runs the asynchronous loop.

``make_server_app(cfg, run_dir)`` is what the simulation launcher hands to Flower's simulation
engine: everything runs on one machine, so the server builds the benchmark's federation too
(its pooled test set to evaluate on, the silos' sample ids to check erasures against). The
module-level ``app`` is the ServerApp for Flower's deployment engine (``flwr run``): it reads
the whole config as JSON from the run config key ``config-json``, runs on the wall clock and
holds no silo's data (``run_server(..., data_here=False)``):

- the network comes from the benchmark's spec in the registry (no data is read);
- what it knows of the silos' data is what they report at the roster query: sample and class
  counts, and the salted digests of their sample ids (``protocol.ids``), against which the
  erasure service checks requests (each silo checks them again against its own ids);
- the global model is evaluated on the coordinator's own held-out set (``data.server_test``, a
  Decathlon datalist) during the run, or, without one, by the silos on their own data at the
  end (federated: their mean weighted by sample count; ``FederatedEvaluation``).

The server is built complete by ``build_server``. What a run does around the loop lives
beside it: the benchmark's federation and model (server/benchmark.py), evaluation by the silos
(server/evaluation.py), the erasure coordinator, verifier and service (server/erasure_setup.py),
the stop handle (server/run_stop.py), the summary (server/summary.py) and the final and best
models as MONAI bundles (server/bundle.py; the run's description they need is written as it
starts).
"""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedasync.errors import ConfigError
from fedasync.interrupt import DeferredStop
from medical_data.federation import Federation, SiloData
from medical_data.monai_bundle import read_bundle
from medical_data.registry import BenchmarkSpec, get_spec
from medical_data.tasks import evaluate
from protocol import ids as digests
from protocol.transport import short_backoff
from server.benchmark import bundle_evaluation, federation, initial_model, server_test_set
from server.bundle import BUNDLE_DIR, describe_run, write_run_bundles, write_run_info
from server.config import FedAsyncConfig
from server.erasure_setup import (
    LiveCatalog,
    coordinator_for,
    erasure_summary,
    known_ids,
    start_service,
    verifier,
    watched_ids,
)
from server.evaluation import FederatedEvaluation, Silos
from server.loop import AsyncServer
from server.models import MODELS_DIR
from server.roster import check_reports
from server.run_stop import RunStopped, StopHandle, StoppableGrid, stop_reason
from server.strategies import strategy_for
from server.summary import build_summary, central_dp_summary, write_summary
from server.unlearning import ErasureCoordinator

log = logging.getLogger("fedasync.server")
milestones = logging.getLogger("fedasync.run")
"""A run's start, stop and end: in run.log, and in a deployment on the ServerApp's stderr too,
which Flower streams to ``flwr run --stream`` and keeps for ``flwr log``."""


def run_server(
    grid: Grid,
    cfg: FedAsyncConfig,
    run_dir: Path,
    *,
    wall_clock: bool = False,
    data_here: bool = True,
    summary_on_stop: bool = False,
) -> dict[str, Any]:
    """Run one federated job on ``grid``; write metrics.jsonl, checkpoints and summary.json.

    A stop (``RunStopped`` from a ``StoppableGrid``, or the SuperLink refusing the run after
    ``flwr stop``: server.run_stop.stop_reason) writes a checkpoint and is raised again; with ``summary_on_stop`` the
    run ends there as a finished one does instead (evaluated where it can be without the
    silos, summary.json with ``stopped``: the reason and the version).

    ``data_here``: the benchmark's federation may be built in this process (simulation, and the
    tests that play a deployment in-process); False for the deployment ServerApp, which holds
    no silo's data (module docstring)."""
    t0 = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)
    bundle = None if cfg.task.bundle is None else read_bundle(cfg.task.bundle)
    fed: Federation | None = federation(cfg) if data_here and bundle is None else None
    test: SiloData | None
    bundle_eval = None
    if bundle is not None:
        spec, test = bundle.spec(), None
        bundle_eval = bundle_evaluation(bundle) if data_here else None
        on = "bundle validation list" if bundle_eval is not None else "silos (federated)"
    elif fed is not None:
        spec, test, on = fed.spec, fed.test, "benchmark test set"
    else:
        spec = get_spec(cfg.data.benchmark)
        _check_deployable(cfg)
        test = None if cfg.data.server_test is None else server_test_set(cfg, spec)
        on = "silos (federated)" if test is None else "coordinator test set (data.server_test)"
    model = initial_model(cfg, spec)
    task = spec.task
    federated = FederatedEvaluation() if test is None and bundle_eval is None else None
    run_cfg = cfg
    if federated is not None:
        run_cfg = replace(cfg, server=replace(cfg.server, eval_every=2**62))  # never mid-run...
        mid_run = strategy_for(run_cfg).evaluates(1)  # (...unless the strategy evaluates each)
        log.info(
            "no coordinator test set (data.server_test): the silos evaluate the model on their "
            "own data at the end%s (federated, weighted by sample count)",
            " and after every version (every round)" if mid_run else "",
        )

    watch = (
        verifier(cfg, fed, spec=spec, test=test)
        if cfg.lab.backdoor.enabled and cfg.lab.backdoor.watch
        else None
    )
    watched = watched_ids(cfg, fed) if watch is not None else []

    def evaluate_fn(params: dict[str, torch.Tensor]) -> dict[str, float]:
        if federated is not None:
            return federated(params)
        if bundle_eval is not None:
            model.load_state_dict(params)
            return bundle_eval(model)
        assert test is not None
        model.load_state_dict(params)
        res = evaluate(model, test, task=task)
        if watch is not None:  # the backdoor over time (lab.backdoor.watch)
            report = watch(params, cfg.lab.backdoor.silo, watched)
            res.update({f"bd_{k}": v for k, v in report.items() if k != "test_accuracy"})
        return res

    if not cfg.run.resume:
        _start_afresh(run_dir)
    srv = build_server(
        cfg,
        grid,
        run_dir,
        model.state_dict(),
        evaluate_fn,
        run_cfg=run_cfg,
        wall_clock=wall_clock,
        fed=fed,
        spec=spec,
        test=test,
    )
    silos = Silos(srv.grid, srv.setup_json, srv.roster, lambda: bool(srv.inflight), srv.silo_eval)
    if federated is not None:
        federated.silos = silos
    service = None
    try:
        srv.events.write(
            "start",
            t=0.0,
            version=0,
            mode=cfg.server.mode,
            clock=srv.clock.kind,
            benchmark=cfg.data.benchmark,
            silos=cfg.silos.count,
            evaluation=on,
        )
        srv.connect()
        check_reports(srv.silo_reports, spec)
        catalog = LiveCatalog(
            cfg.silos.count,
            known_ids(fed, srv.silo_reports, srv.id_salt),
            version=lambda: srv.version,
            online=lambda silo: silo in srv.roster and not srv.is_down(silo),
        )
        service = start_service(cfg, run_dir, srv.erasure, catalog)
        resumed = cfg.run.resume and srv.resume()
        if cfg.run.resume and not resumed:
            log.warning("run.resume=true but %s has no checkpoint: starting afresh", run_dir)
        samples = None if test is None else len(test)
        if bundle_eval is not None:
            samples = bundle_eval.samples
        info = describe_run(
            cfg, spec, srv.silo_reports, evaluation_on=on, test_samples=samples, bundle=bundle
        )
        write_run_info(run_dir, info)  # what its bundles say of the run (server/bundle.py)
        milestones.info(
            "run %s at version %d: %s, %d silos, budget %gs, run folder %s",
            "resumed" if resumed else "started",
            srv.version,
            cfg.server.mode,
            cfg.silos.count,
            cfg.run.budget_s,
            run_dir,
        )
        if not resumed and federated is None:
            srv.evaluate()
        stopped: str | None = None
        try:
            srv.run()
        except BaseException as e:
            if stop_reason(e) is None:
                raise
            if srv.started_at is not None:
                srv.checkpoint()  # a resume goes on from where it stopped
            if not summary_on_stop:
                raise
            stopped = stop_reason(e)
            milestones.info(
                "run stopped at version %d (%s): checkpoint written", srv.version, stopped
            )
        if federated is not None:
            federated.final = True  # the run is over: the silos' jobs may be waited for
        evals = srv.stats.evals
        if (not evals or evals[-1]["version"] != srv.version) and not (stopped and federated):
            srv.evaluate()  # (a stopped run cannot reach its silos: no federated evaluation)
        if srv.progress is not None:
            srv.progress.close()
        srv.checkpoint()
        if federated is not None:
            silo_evals = federated.per_silo
        elif cfg.server.evaluate_silos and stopped is None:
            silo_evals = silos.evaluate(srv.params)
        else:
            silo_evals = {}
        metric = "accuracy" if task == "classification" else "dice"
        summary = build_summary(
            srv.facts(), srv.stats, metric=metric, wall_time_s=time.monotonic() - t0
        )
        for s, ev in silo_evals.items():  # each silo's own evaluation (none: not evaluated)
            summary["per_silo"][str(s)]["eval"] = ev
        summary["evaluation"] = {"on": on, "samples": None if test is None else len(test)}
        summary["silo_data"] = {
            str(s): {"num_samples": r.num_samples, "class_counts": list(r.class_counts)}
            for s, r in sorted(srv.silo_reports.items())
        }
        if stopped is not None:
            summary["stopped"] = {"reason": stopped, "version": srv.version}
        srv.events.write(
            "end",
            t=srv.clock.now,
            version=srv.version,
            final_score=summary["final_score"],
            **({"stopped": stopped} if stopped is not None else {}),
        )
        if isinstance(srv.erasure, ErasureCoordinator):
            summary["erasures"] = erasure_summary(srv.erasure, srv.params)
        if srv.privacy.ledger is not None:
            summary["central_dp"] = central_dp_summary(cfg, srv.privacy.ledger, srv.roster)
        summary["bundles"] = _bundles(srv, info)
        write_summary(run_dir / "summary.json", summary)
        milestones.info(
            "run %s at version %d: score %s; summary in %s",
            "stopped" if stopped else "ended",
            srv.version,
            summary["final_score"],
            run_dir / "summary.json",
        )
        return summary
    except BaseException as e:
        if stop_reason(e) is not None and srv.started_at is not None:
            srv.checkpoint()  # a resume goes on from where it stopped
        raise
    finally:
        srv.puller.close()
        if service is not None:
            service.stop(grace=1.0).wait(5.0)
        srv.events.close()
        srv.privacy.close()


def build_server(
    cfg: FedAsyncConfig,
    grid: Grid,
    run_dir: Path,
    params: dict[str, torch.Tensor],
    evaluate_fn: Any,
    *,
    run_cfg: FedAsyncConfig | None = None,
    wall_clock: bool = False,
    fed: Federation | None = None,
    spec: BenchmarkSpec | None = None,
    test: SiloData | None = None,
) -> AsyncServer:
    """The run's server, built complete from ``params`` (the initial model) and
    ``evaluate_fn``: its erasure coordinator when the run may erase (``erasures`` or
    ``unlearning.address``), the silos' sample ids when ``fed`` is here (simulation), else the
    salt the silos report their ids' digests under, and the progress display
    (``run.progress``). ``run_cfg``: the config the loop runs by (default ``cfg``)."""
    erasure = None
    if cfg.erasures or cfg.unlearning.service:
        erasure = coordinator_for(cfg, fed, run_dir, spec=spec, test=test)
    return AsyncServer(
        cfg if run_cfg is None else run_cfg,
        grid,
        run_dir,
        params,
        evaluate_fn,
        wall_clock=wall_clock,
        sample_ids_fn=None if fed is None else (lambda silo: fed.silos[silo].sample_ids),
        id_salt="" if fed is not None else digests.new_salt(),
        erasure=erasure,
        progress=_progress_bar(cfg) if cfg.run.progress else None,
    )


def _progress_bar(cfg: FedAsyncConfig) -> Callable[[float], Any]:
    """What makes the run's progress display (fedasync.progress), from the clock time the
    loop starts at (0, or a resumed run's)."""

    def make(initial: float) -> Any:
        from tqdm import tqdm

        from fedasync.progress import progress as make_progress

        return make_progress(
            cfg.run.budget_s,
            f"{cfg.server.mode:8s}",
            tty_bar=tqdm,
            unit="s",
            initial=initial,
            mininterval=0.5,
            bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} {unit} [{elapsed}<{remaining}{postfix}]",
        )

    return make


def _check_deployable(cfg: FedAsyncConfig) -> None:
    """What a coordinator without the silos' data cannot do, said before anything starts."""
    for i, e in enumerate(cfg.erasures):
        if e.fraction < 1.0:
            raise ConfigError(
                f"erasures[{i}].fraction={e.fraction}: picking a share of a silo's samples "
                "needs its ids, which the coordinator does not hold in deployment; submit the "
                "ids through the erasure service (fedasync erase submit --samples ...)"
            )
    if cfg.lab.backdoor.enabled and cfg.lab.backdoor.relearn_silo is not None:
        raise ConfigError(
            "lab.backdoor.relearn_silo: a relearning attack trains on another silo's data, which "
            "only a simulation has"
        )


def _bundles(srv: AsyncServer, info: dict[str, Any]) -> dict[str, str]:
    """The run's final and best models as MONAI bundles (server/bundle.py), their folders by
    name; a failure is logged and leaves none (the checkpoint and snapshots are written:
    ``fedasync export`` makes them again)."""
    try:
        best = (srv.best.version, srv.best.params)
        store = srv.erasure.store if isinstance(srv.erasure, ErasureCoordinator) else None
        final = (srv.version, srv.params)
        return write_run_bundles(srv.run_dir, info, final, best, srv.stats.evals, store)
    except Exception as e:  # noqa: BLE001 - the run's results are written; say what failed
        log.error(
            "the run's MONAI bundles were not written (%s: %s); make one with "
            "`fedasync export %s --version %d`",
            type(e).__name__,
            str(e)[:300],
            srv.run_dir,
            srv.version,
            exc_info=True,
        )
        return {}


def _start_afresh(run_dir: Path) -> None:
    """A run that does not resume starts a new event log and no model snapshots or bundles;
    an old erasure store (an audit log) is kept aside, never deleted."""
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    for folder in (MODELS_DIR, BUNDLE_DIR):
        shutil.rmtree(run_dir / folder, ignore_errors=True)
    store = run_dir / "erasures.sqlite"
    if store.exists():
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for suffix in ("", "-wal", "-shm"):
            old = store.with_name(store.name + suffix)
            if old.exists():
                old.rename(store.with_name(f"erasures.{stamp}.sqlite{suffix}"))


def make_server_app(
    cfg: FedAsyncConfig,
    run_dir: Path,
    result: dict[str, Any] | None = None,
    handle: StopHandle | None = None,
) -> ServerApp:
    """A ServerApp bound to ``cfg`` for the simulation engine; its summary lands in ``result``.

    With ``handle``: once it is asked to stop, the run stops at its next poll (checkpoint
    written, erasure service stopped, event log closed) and the ServerApp returns without a
    summary.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        if handle is None:
            summary = run_server(grid, cfg, run_dir)
        else:
            handle.started = True
            try:
                asked = handle.requested
                grid = StoppableGrid(
                    grid, lambda: "stopped by the launcher" if asked.is_set() else None
                )  # type: ignore[assignment]
                summary = run_server(grid, cfg, run_dir)
            except RunStopped:
                log.info("the run was stopped")
                return
            finally:
                handle.done.set()
        if result is not None:
            result.update(summary)

    return app


app = ServerApp()


def simulated(grid: Grid) -> bool:
    """Whether ``grid`` is Flower's simulation runtime's (``flwr run`` against a local
    simulation SuperLink: the nodes are Ray actors on this machine), not a deployment's."""
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    return isinstance(grid, InMemoryGrid)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """``flwr run``'s entry point: the config arrives as the run config's flat keys
    (``server.run_config``). On Flower's deployment engine the loop runs on the wall clock
    (replies taken in arrival order) and the coordinator reads no silo data; on Flower's
    simulation runtime (a ``:local:`` SuperLink) on the virtual clock, with the benchmark
    built here, as ``fedasync simulate`` runs it."""
    from server.run_config import config_from_run_config

    cfg = config_from_run_config(context.run_config)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    _log_to(run_dir / "run.log")
    if cfg.lab.compare_sync:
        log.warning(
            "lab.compare_sync=true is run by `fedasync simulate` only, not under `flwr run` "
            "(benchmarks/deployment_overhead.py compares with Flower's FedAvg in deployment)"
        )
    if simulated(grid):
        run_server(grid, cfg, run_dir, wall_clock=False, data_here=True)
        return
    from flwr.superlink.grid import http_grid

    short_backoff(http_grid, "pull_objects")  # replies still arriving: retry in 10 ms, not 1 s
    # A stop (``flwr stop``: Flower's heartbeat then sends this process SIGINT, and the
    # SuperLink refuses the run's calls; a SIGTERM from whoever runs the coordinator) is taken
    # at the loop's next poll: checkpoint, evaluation, summary.json; then the process ends as
    # Flower ends a stopped ServerApp (its own SIGINT handler, put back). A second signal, or
    # no safe point within 60 s, stops at once (the last checkpoint stays).
    with DeferredStop(grace_s=60.0) as stop:

        def reason() -> str | None:  # read at each poll
            return None if stop.requested is None else signal.Signals(stop.requested).name

        try:
            run_server(
                StoppableGrid(grid, reason),  # type: ignore[arg-type]
                cfg,
                run_dir,
                wall_clock=True,
                data_here=False,
                summary_on_stop=True,
            )
        finally:
            signum = stop.requested
    if signum is not None:
        signal.raise_signal(signum)  # Flower's handler: "Task stopped by user.", its exit code


def _log_to(path: Path) -> None:
    """The ``fedasync`` loggers' INFO and above to ``path`` (run.log, as in simulation);
    warnings and the run's milestones (``fedasync.run``: start, stop, end) also to stderr,
    which Flower streams to ``flwr run --stream`` and keeps for ``flwr log``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("fedasync")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    shown = logging.StreamHandler(sys.stderr)  # (Flower mirrors stderr to the run's log)
    shown.setFormatter(logging.Formatter("fedasync: %(message)s"))
    shown.setLevel(logging.INFO)
    logging.getLogger("fedasync.run").addHandler(shown)
