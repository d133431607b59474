"""The fedasync ServerApp: builds the global model and runs the asynchronous loop.

``make_server_app(cfg, run_dir)`` is what the simulation launcher hands to Flower's simulation
engine. The module-level ``app`` is the same ServerApp for Flower's deployment engine
(``flwr run``), which reads the whole config as JSON from the run config key ``config-json``
and runs on the wall clock.

A little over 400 lines because it also holds what a run does around the loop: the
erasure coordinator's and the service's set-up, silo evaluation, and the run's end
(summary, checkpoint, stop on a signal).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from medical_data.federation import Federation
from medical_data.networks import build_network
from medical_data.tasks import evaluate
from protocol import keys as P
from protocol import wire
from protocol.config import build_silos, to_dict
from protocol.messages import EvaluateReply, EvaluateRequest
from protocol.reading import ErrorReply, Malformed
from server.config import FedAsyncConfig, from_container
from server.loop import AsyncServer
from server.roster import exchange
from server.summary import build_summary, write_summary

log = logging.getLogger("fedasync.server")


def _federation(cfg: FedAsyncConfig) -> Federation:
    return build_silos(cfg.data, cfg.silos.count, cfg.run.seed)


def initial_model(cfg: FedAsyncConfig) -> torch.nn.Module:
    """The benchmark's network, initialised from ``run.seed``."""
    spec = _federation(cfg).spec
    torch.manual_seed(cfg.run.seed)
    return build_network(
        cfg.data.network or spec.network, spec.in_channels, spec.num_classes, spec.image_size
    )


def evaluate_silos(srv: AsyncServer, timeout_s: float = 300.0) -> dict[int, dict[str, float]]:
    """Ask every silo to evaluate the current global model on its own data."""
    silos = sorted(srv.roster)
    arrays = wire.encode(srv.params)  # one encoding for every silo's message
    request = EvaluateRequest(srv.setup_json, srv.params)
    msgs = [request.to_message(srv.roster[s], arrays=arrays) for s in silos]
    out: dict[int, dict[str, float]] = {}
    for silo, reply in zip(silos, exchange(srv.grid, msgs, timeout_s)):
        try:
            if reply is None:
                raise Malformed("no reply")
            got = EvaluateReply.from_message(reply)
        except (ErrorReply, Malformed) as e:
            log.warning("silo %d did not evaluate the final model: %s", silo, e)
            continue
        out[silo] = {"loss": got.loss, "score": got.score}
        srv.events.write("silo_eval", t=srv.clock.now, version=srv.version, silo=silo, **out[silo])
    return out


def run_server(
    grid: Grid, cfg: FedAsyncConfig, run_dir: Path, *, wall_clock: bool = False
) -> dict[str, Any]:
    """Run one federated job on ``grid``; write metrics.jsonl, checkpoints and summary.json."""
    t0 = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)
    fed = _federation(cfg)
    model = initial_model(cfg)
    task = fed.spec.task

    watch = _verifier(cfg, fed) if cfg.backdoor.enabled and cfg.backdoor.watch else None

    def evaluate_fn(params: dict[str, torch.Tensor]) -> dict[str, float]:
        model.load_state_dict(params)
        res = evaluate(model, fed.test, task=task)
        if watch is not None:  # the backdoor over time (backdoor.watch)
            report = watch(params, cfg.backdoor.silo, [])
            res.update({f"bd_{k}": v for k, v in report.items() if k != "test_accuracy"})
        return res

    if not cfg.run.resume:
        _start_afresh(run_dir)
    srv = AsyncServer(cfg, grid, run_dir, model.state_dict(), evaluate_fn, wall_clock=wall_clock)
    srv.sample_ids_fn = lambda silo: fed.silos[silo].sample_ids
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
        )
        srv.connect()
        if cfg.erasures or cfg.unlearning.service:
            service = _attach_erasure(srv, cfg, fed, run_dir)
        resumed = cfg.run.resume and srv.resume()
        if cfg.run.resume and not resumed:
            log.warning("run.resume=true but %s has no checkpoint: starting afresh", run_dir)
        if not resumed:
            srv.evaluate()
        progress = None
        if cfg.run.progress:
            from tqdm import tqdm

            from fedasync.progress import progress as make_progress

            progress = make_progress(
                cfg.run.budget_s,
                f"{cfg.server.mode:8s}",
                tty_bar=tqdm,
                unit="s",
                initial=srv.clock.now,
                mininterval=0.5,
                bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} {unit} [{elapsed}<{remaining}{postfix}]",
            )
            srv.progress = progress
        srv.run()
        evals = srv.stats.evals
        if not evals or evals[-1]["version"] != srv.version:
            srv.evaluate()
        if progress is not None:
            progress.close()
        srv.checkpoint()
        silo_evals = evaluate_silos(srv) if cfg.server.evaluate_silos else {}
        metric = "accuracy" if task == "classification" else "dice"
        summary = build_summary(
            srv, metric=metric, wall_time_s=time.monotonic() - t0, silo_evals=silo_evals
        )
        srv.events.write(
            "end", t=srv.clock.now, version=srv.version, final_score=summary["final_accuracy"]
        )
        if srv.erasure is not None:
            summary["erasures"] = erasure_summary(srv)
        if srv.privacy.ledger is not None:
            summary["central_dp"] = central_dp_summary(srv)
        write_summary(run_dir / "summary.json", summary)
        return summary
    except RunStopped:
        if srv.started_at is not None:
            srv.checkpoint()  # a resume goes on from where it stopped
        raise
    finally:
        if service is not None:
            service.stop(grace=1.0).wait(5.0)
        srv.events.close()
        srv.privacy.close()


def central_dp_summary(srv: AsyncServer) -> dict[str, Any]:
    """Central DP's settings and every silo's epsilon (all runs of its ledger), also logged."""
    dp = srv.cfg.server.dp
    ledger = srv.privacy.ledger
    assert ledger is not None
    eps = {str(s): ledger.epsilon(s) for s in sorted(srv.roster)}
    releases = {str(s): ledger.releases(s) for s in sorted(srv.roster)}
    log.info(
        "central DP (noise %.3g x clip %.3g, delta %g): epsilon per silo %s",
        dp.noise_multiplier,
        srv.cfg.server.clip_norm,
        dp.delta,
        ", ".join(f"{s}: {e:.3g} ({releases[s]} releases)" for s, e in eps.items()),
    )
    return {
        "noise_multiplier": dp.noise_multiplier,
        "clip_norm": srv.cfg.server.clip_norm,
        "delta": dp.delta,
        "epsilon_budget": dp.epsilon_budget,
        "ledger": str(ledger.path),
        "epsilon": eps,
        "releases": releases,
    }


def _start_afresh(run_dir: Path) -> None:
    """A run that does not resume starts a new event log; an old erasure store (an audit
    log) is kept aside, never deleted."""
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    store = run_dir / "erasures.sqlite"
    if store.exists():
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for suffix in ("", "-wal", "-shm"):
            old = store.with_name(store.name + suffix)
            if old.exists():
                old.rename(store.with_name(f"erasures.{stamp}.sqlite{suffix}"))


def _verifier(cfg: FedAsyncConfig, fed: Any) -> Any:
    """``verify(params, silo, ids)``: the verification metrics of a model on silo ``silo``'s
    training data (only ``ids`` when given; the backdoor applied in verification runs), the
    test set, and in verification runs the triggered test set."""
    from medical_data.backdoor import triggered_set
    from medical_data.tasks import select, training_data
    from medical_data.verification import verification_report

    task = fed.spec.task
    vmodel = initial_model(cfg)
    bd = to_dict(cfg.backdoor)
    b = cfg.backdoor
    triggered = (
        triggered_set(fed.test, b.target_label, b.trigger_size, pattern=b.trigger_pattern)
        if b.enabled
        else None
    )
    untriggered = (
        triggered_set(fed.test, b.target_label, b.trigger_size, trigger=False)
        if b.enabled
        else None
    )

    def verify(params: dict[str, torch.Tensor], silo: int, ids: list[str]) -> dict[str, float]:
        vmodel.load_state_dict(params)
        forget = select(training_data(fed, silo, bd, cfg.run.seed), ids, keep=True)
        return verification_report(
            vmodel,
            forget=forget,
            test=fed.test,
            triggered=triggered,
            untriggered=untriggered,
            target_label=cfg.backdoor.target_label if triggered is not None else None,
            task=task,
        )

    return verify


def _attach_erasure(srv: AsyncServer, cfg: FedAsyncConfig, fed: Any, run_dir: Path) -> Any:
    """Give ``srv`` an erasure coordinator (store in the run folder) and, when configured, start
    the erasure gRPC service. Returns the gRPC server to stop, or None."""
    from server.erasure.store import ErasureStore
    from server.unlearning import ErasureCoordinator

    verify_fn = _verifier(cfg, fed)
    store = ErasureStore(run_dir / "erasures.sqlite")
    srv.erasure = ErasureCoordinator(srv, store, verify_fn)
    if not cfg.unlearning.service:
        return None
    from server.erasure.auth import Authorizer, generate_credentials, write_private
    from server.erasure.service import ErasureService, serve

    cred = Path(cfg.unlearning.credentials) if cfg.unlearning.credentials else None
    if cred is None:
        cred = run_dir / "credentials.json"
        if not cred.exists():
            write_private(run_dir / "tokens.json", generate_credentials(cfg.silos.count, cred))
    service = ErasureService(store, Authorizer.from_file(cred), _Catalog(srv, fed))
    server, port = serve(service, cfg.unlearning.address, server_credentials=_tls(cfg))
    host = cfg.unlearning.address.rsplit(":", 1)[0]
    tmp = run_dir / "erasure_address.tmp"
    tmp.write_text(f"{host}:{port}\n")
    os.replace(tmp, run_dir / "erasure_address")  # whole or absent for a reader
    log.info(
        "erasure service listening on %s:%d (%s)",
        host,
        port,
        "TLS" if cfg.unlearning.tls_certfile else "insecure",
    )
    return server


def _tls(cfg: FedAsyncConfig) -> Any:
    """The erasure service's TLS credentials (certificate and key), or None: insecure."""
    u = cfg.unlearning
    if u.tls_certfile is None or u.tls_keyfile is None:
        return None
    import grpc

    pair = (Path(u.tls_keyfile).read_bytes(), Path(u.tls_certfile).read_bytes())
    return grpc.ssl_server_credentials([pair])


class _Catalog:
    """What the erasure service may ask the training server."""

    def __init__(self, srv: AsyncServer, fed: Any):
        self.srv, self.fed = srv, fed

    def silo_ids(self) -> set[int]:
        return set(range(len(self.fed.silos)))

    def sample_ids(self, silo: int) -> set[str]:
        return {str(x) for x in self.fed.silos[silo].sample_ids}

    def model_version(self) -> int:
        return self.srv.version

    def is_online(self, silo: int) -> bool:
        return silo in self.srv.roster and not self.srv.is_down(silo)


def erasure_summary(srv: AsyncServer) -> dict[str, Any]:
    """Every request's final state, the verification report of each verified one, and the
    same metrics on the final model for every applied erasure (``at_end``)."""
    co = srv.erasure
    requests = co.store.list()
    ids_of = {r.id: list(r.sample_ids) for r in requests}
    calibrating = [
        {**co.row(e), "after_relearn": None} for e in co.active.values() if e.boundary is not None
    ]
    for row in [*co.report, *calibrating]:
        row["at_end"] = co.verify_fn(srv.params, row["silo"], ids_of.get(row["request"], []))
    return {
        "applied": [*co.report, *calibrating],
        "requests": [
            {
                "id": r.id,
                "silo": r.silo,
                "state": r.state.value,
                "requester": r.requester,
                "samples": len(r.sample_ids),
                "failure_reason": r.failure_reason,
            }
            for r in requests
        ],
        "verified": co.report,
    }


class RunStopped(BaseException):
    """The launcher stopped the run (Ctrl-C, SIGTERM): raised in the ServerApp's thread at its
    next poll of the grid. A BaseException, so that no ``except Exception`` takes it for a
    silo's failure."""


class StoppableGrid:
    """``grid`` whose reading calls (``pull_messages``, ``get_node_ids``) raise RunStopped once
    ``stop`` is set; everything else is passed through. Pushing never raises, so the loop is
    stopped between two steps, never inside one."""

    def __init__(self, grid: Grid, stop: threading.Event):
        self._grid, self._stop = grid, stop

    def pull_messages(self, *args: Any, **kwargs: Any) -> Any:
        """The grid's, unless the run was stopped (then ``RunStopped``)."""
        if self._stop.is_set():
            raise RunStopped
        return self._grid.pull_messages(*args, **kwargs)

    def get_node_ids(self, *args: Any, **kwargs: Any) -> Any:
        """The grid's, unless the run was stopped (then ``RunStopped``)."""
        if self._stop.is_set():
            raise RunStopped
        return self._grid.get_node_ids(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class StopHandle:
    """How the simulation launcher stops a running ServerApp and waits for its thread, which
    Flower does not make a daemon: a process cannot exit while it runs."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.started = False
        self.done = threading.Event()

    def stop(self, timeout_s: float) -> bool:
        """Ask the run to stop; whether its ServerApp ended (or never started) in ``timeout_s``."""
        self.requested.set()
        return not self.started or self.done.wait(timeout_s)


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
                summary = run_server(StoppableGrid(grid, handle.requested), cfg, run_dir)  # type: ignore[arg-type]
            except RunStopped:
                log.info("the run was stopped")
                return
            finally:
                handle.done.set()
        if result is not None:
            result.update(summary)

    return app


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Deployment entry point: the config arrives as JSON in run config ``config-json``; the
    loop runs on the wall clock (replies taken in arrival order)."""
    raw = context.run_config.get("config-json", "{}")
    cfg = from_container(P.loads(str(raw)))
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    _log_to(run_dir / "run.log")
    if cfg.run.compare_sync and cfg.server.mode != "sync":
        log.warning(
            "run.compare_sync=true is simulation-only: no sync baseline is run in deployment "
            "(benchmarks/deployment_overhead.py compares with Flower's FedAvg)"
        )
    run_server(grid, cfg, run_dir, wall_clock=True)


def _log_to(path: Path) -> None:
    """The ``fedasync`` loggers' INFO and above to ``path`` (run.log, as in simulation);
    warnings still reach stderr, which Flower streams to ``flwr run``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("fedasync")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
